"""The operator: kopf handlers, the reconcile step, elastic operations, the objects it builds (docs/architecture.md)."""
