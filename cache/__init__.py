"""The KV cache store: block pool (L1), prefix index, tiers (L2/L3), eviction."""
