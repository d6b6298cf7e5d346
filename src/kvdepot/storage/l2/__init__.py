"""L2 tiers: adapters behind one non-blocking interface (``base``), found by ``registry``."""
