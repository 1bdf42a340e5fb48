"""Package path of the proto package `shardwise.agent.v1` (see `shardwise.agents.proto`)."""
