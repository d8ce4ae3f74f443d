"""KV-cache accounting (no torch): the block pool and per-context block tables."""
