"""The shared-memory segment that carries L1, and what both the server and its workers do with it."""

from kvdepot.shm.prefault import Prefaulter, PrefaultState, populate
from kvdepot.shm.segment import (
    HEADER_BYTES,
    ArenaCapacityError,
    SharedArena,
    available_memory_bytes,
    check_capacity,
    liveness_offset,
    remove_stale_segments,
    shm_free_bytes,
)

__all__ = [
    "HEADER_BYTES",
    "ArenaCapacityError",
    "PrefaultState",
    "Prefaulter",
    "SharedArena",
    "available_memory_bytes",
    "check_capacity",
    "liveness_offset",
    "populate",
    "remove_stale_segments",
    "shm_free_bytes",
]
