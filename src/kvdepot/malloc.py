"""Process-wide allocator settings for processes that receive large ZeroMQ frames.

ZeroMQ receives each payload frame into a fresh malloc'd buffer. With glibc's defaults, freed
multi-MiB buffers go back to the OS (mmap'd chunks, heap trimming), so the next frame faults its
pages in again at ~1 GB/s, which caps inline transfers far below the socket's speed. Keeping large
buffers in the heap made 2 MiB-frame ZeroMQ transfers 2-3x faster here. The server calls it at
start; a KVClient on the inline transport calls it unless told not to (``tune_malloc=False`` or
``KVDEPOT_NO_MALLOC_TUNING=1``): the cost is up to ``trim_threshold`` of freed heap kept for reuse.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers_in_heap(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing to tune
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        log.debug("mallopt refused the heap settings")
    return ok
