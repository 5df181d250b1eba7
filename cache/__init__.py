"""The KV cache store: block pool (L1), hash index, the tiers below L1, eviction, statistics."""
