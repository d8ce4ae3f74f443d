"""KV-cache accounting (no torch): the block pool and the KV manager, the one writer of per-context block tables."""
