"""The operator: kopf handlers, the reconcile step, elastic operations and the objects it builds (docs/architecture.md)."""
