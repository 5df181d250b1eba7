"""Built-in cache tiers: memory (L2, host RAM) and disk (L3, persistent)."""
