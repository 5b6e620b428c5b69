"""`pdserve bench kv`: raw NIXL transfers (micro) and the two KV connectors end to end (e2e)."""
