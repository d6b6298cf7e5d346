"""Attaching to the server's shared-memory arena from a worker process."""

from __future__ import annotations

import logging

from kvdepot.protocol.messages import ShmInfo
from kvdepot.shm import Prefaulter, SharedArena

log = logging.getLogger(__name__)


def try_attach(info: ShmInfo | None, prefault: bool = True) -> tuple[SharedArena | None, Prefaulter | None, str]:
    """Map the arena if this process can (same host, same user, same segment) and take the liveness lock
    the server watches it by; else (None, None, why)."""
    if info is None:
        return None, None, "the server offers no shared-memory arena"
    if info.liveness_lock < 0:
        return None, None, "the server gave no liveness lock for the arena"
    try:
        arena = SharedArena.attach(info.path, info.size, info.nonce)
    except (OSError, ValueError) as exc:
        return None, None, f"cannot map {info.path}: {exc}"
    try:
        arena.hold_liveness_lock(info.liveness_lock)
    except (OSError, ValueError) as exc:
        # Without the lock the server could not tell when we are gone, so it gives us no arena offsets.
        arena.close()
        return None, None, f"mapped {info.path} but {exc}"
    prefaulter = None
    if prefault:
        # Our page tables start empty even where the server's pages exist; filling them in the
        # background keeps first-touch faults out of the transfers.
        prefaulter = Prefaulter(arena, name="kvdepot-client-prefault")
        prefaulter.start()
    return arena, prefaulter, f"mapped {info.path}"
