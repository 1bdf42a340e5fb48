"""The local cluster: an API server emulator, process-backed nodes, a scheduler and Prometheus, for development
and tests (docs/architecture.md)."""
