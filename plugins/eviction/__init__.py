"""Built-in eviction policies: lru, lfu, adaptive (ARC), clock."""
