"""Background movers that keep L1 healthy and connected to L2; none ever blocks the request path.

- ``driver``: the one thread that drains the tiers' completions and steps the L2 controllers.
- ``store``: pushes new L1 objects to the tiers (write-through, bounded queue).
- ``prefetch``: loads LOOKUP misses from the tiers into L1.
- ``eviction``: keeps L1 under its high watermark and salts under their quotas.
- ``owners``: the leases these controllers hold are the server's own.
"""

from kvdepot.storage.controllers.driver import TierDriver
from kvdepot.storage.controllers.eviction import EvictionController
from kvdepot.storage.controllers.owners import BACKGROUND_LEASE_TTL_S, PREFETCH_OWNER, STORE_OWNER
from kvdepot.storage.controllers.prefetch import PrefetchController, Prefetched, PrefetchJob, PrefetchStats
from kvdepot.storage.controllers.store import StoreController, StoreStats

__all__ = [
    "BACKGROUND_LEASE_TTL_S",
    "PREFETCH_OWNER",
    "STORE_OWNER",
    "EvictionController",
    "PrefetchController",
    "PrefetchJob",
    "Prefetched",
    "PrefetchStats",
    "StoreController",
    "StoreStats",
    "TierDriver",
]
