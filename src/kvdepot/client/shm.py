"""Attaching to the server's shared-memory arena from a worker process."""

from __future__ import annotations

import logging

from kvdepot.protocol.messages import ShmInfo
from kvdepot.storage.arena import Prefaulter, SharedArena

log = logging.getLogger(__name__)


def try_attach(info: ShmInfo | None, prefault: bool = True) -> tuple[SharedArena | None, Prefaulter | None, str]:
    """Map the arena if this process can (same host, same user, same segment); else (None, None, why)."""
    if info is None:
        return None, None, "the server offers no shared-memory arena"
    try:
        arena = SharedArena.attach(info.path, info.size, info.nonce)
    except (OSError, ValueError) as exc:
        return None, None, f"cannot map {info.path}: {exc}"
    prefaulter = None
    if prefault:
        # Our page tables start empty even where the server's pages exist; filling them in the
        # background keeps first-touch faults out of the transfers.
        prefaulter = Prefaulter(arena, name="kvdepot-client-prefault")
        prefaulter.start()
    return arena, prefaulter, f"mapped {info.path}"
