"""Where the bytes live: the shared-memory arena, the L1 object table, eviction, and (later) L2 tiers."""
