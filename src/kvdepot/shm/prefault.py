"""Populating a mapping of the segment before it is used.

Fresh shared-memory pages cost a page fault each (~1 GB/s here, against ~20 GB/s for a copy into mapped
memory), so ``Prefaulter`` populates a whole mapping in the background. It uses ``MADV_POPULATE_WRITE``,
which fills page tables without touching contents, so it is safe while workers are already writing;
the call goes through ctypes, which releases the GIL for its duration. The server prefaults its
arena at start-up, and each worker its own mapping of it.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from kvdepot.errors import IllegalTransition

if TYPE_CHECKING:
    from kvdepot.shm.segment import SharedArena

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int

def _address_of(mm: mmap.mmap) -> int:
    arr = np.frombuffer(mm, dtype=np.uint8, count=1)
    addr = arr.ctypes.data
    del arr
    return addr


def populate(mm: mmap.mmap, offset: int, length: int) -> bool:
    """Fault in ``[offset, offset+length)`` of this mapping without changing its contents.

    Returns False when the kernel lacks MADV_POPULATE_WRITE (then pages fault in on first use).
    """
    page = mmap.PAGESIZE
    start = offset - offset % page
    length += offset - start
    rc = _libc.madvise(ctypes.c_void_p(_address_of(mm) + start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS):
            return False
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)}")
    return True


class PrefaultState(enum.Enum):
    """``IDLE ─start─► RUNNING ─► DONE | FAILED | UNSUPPORTED | STOPPED`` (the last four are final)."""

    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    STOPPED = "stopped"


class Prefaulter:
    """Populates an arena mapping in the background, reporting progress and how it ended."""

    def __init__(self, arena: SharedArena, step_bytes: int = 64 << 20, name: str = "kvdepot-prefault") -> None:
        self._arena = arena
        self._step = step_bytes
        self._name = name
        self._done_bytes = 0
        self._state = PrefaultState.IDLE
        self.error = ""
        self._finished = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    @property
    def state(self) -> PrefaultState:
        return self._state

    @property
    def progress(self) -> float:
        return 1.0 if self._arena.size == 0 else min(1.0, self._done_bytes / self._arena.size)

    @property
    def finished(self) -> bool:
        """Every page is populated (a failed or stopped run is not finished)."""
        return self._state is PrefaultState.DONE

    @property
    def supported(self) -> bool:
        return self._state is not PrefaultState.UNSUPPORTED

    def start(self) -> None:
        if self._state is not PrefaultState.IDLE:
            raise IllegalTransition(f"prefaulter is {self._state.value}, not idle: it runs once")
        self._state = PrefaultState.RUNNING
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run ended (however it ended); True if it did within the timeout."""
        return self._finished.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        t0 = time.perf_counter()
        next_log = t0 + 2.0
        size = self._arena.size
        end = PrefaultState.DONE
        try:
            for offset in range(0, size, self._step):
                if self._stop.is_set():
                    end = PrefaultState.STOPPED
                    return
                length = min(self._step, size - offset)
                if not populate(self._arena.mm, offset, length):
                    end = PrefaultState.UNSUPPORTED
                    log.warning("MADV_POPULATE_WRITE unsupported: arena pages will fault in on first use")
                    return
                self._done_bytes = offset + length
                now = time.perf_counter()
                if now >= next_log:
                    log.info("%s: %.0f%% of %.2f GiB", self._name, 100 * self.progress, size / 2**30)
                    next_log = now + 2.0
            self.seconds = time.perf_counter() - t0
            log.info("%s: %.2f GiB populated in %.1f s", self._name, size / 2**30, self.seconds)
        except (ValueError, OSError) as exc:  # the arena was closed under us, or the kernel refused
            end = PrefaultState.STOPPED if self._stop.is_set() else PrefaultState.FAILED
            self.error = str(exc)
            if end is PrefaultState.FAILED:
                log.error("%s failed at %.0f%%: %s", self._name, 100 * self.progress, exc)
        finally:
            self._state = end
            self._finished.set()
