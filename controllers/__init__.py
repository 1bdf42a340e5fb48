"""What the operator asks of the agents: forming and checking worlds, the EPLB controller and the autoscaler
(docs/architecture.md)."""
