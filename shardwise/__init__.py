"""shardwise core."""
