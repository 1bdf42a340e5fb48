"""The node agent of a worker pod, its client, the rank runtime and the engines it supervises (docs/architecture.md)."""
