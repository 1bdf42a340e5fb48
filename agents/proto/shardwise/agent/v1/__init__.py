"""Generated stubs of `shardwise.agent.v1`; import them from `shardwise.agents.proto`."""
