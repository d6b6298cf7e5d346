"""The L1 arena: one shared-memory segment (mode 0600) that the server and same-host workers map.

It knows bytes and offsets, never keys. The first ``HEADER_BYTES`` hold a random nonce, so a worker can
prove it mapped *this* server's segment before it trusts the shm path.

Fresh shared-memory pages cost a page fault each (~1 GB/s here, against ~20 GB/s for a copy into mapped
memory), so ``Prefaulter`` populates the whole segment in the background at start-up. It uses
``MADV_POPULATE_WRITE``, which fills page tables without touching contents, so it is safe while workers
are already writing; the call goes through ctypes, which releases the GIL for its duration.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
NONCE_BYTES = 16
SHM_DIR = "/dev/shm"
_PREFIX = "kvdepot-"
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink arenas left behind by kvdepot servers that died without cleaning up."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        parts = name[len(_PREFIX) :].split("-", 1)
        if len(parts) == 2 and parts[0].isdigit() and not _pid_alive(int(parts[0])):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    return removed


@dataclass
class SharedArena:
    """A mapped shared-memory segment. ``create`` (server) owns and unlinks it; ``attach`` (worker) maps it."""

    path: str
    size: int
    nonce: bytes
    mm: mmap.mmap
    owner: bool
    buffer: np.ndarray  # uint8 view of the whole mapping

    @classmethod
    def create(cls, size: int, shm_dir: str = SHM_DIR) -> SharedArena:
        if size <= HEADER_BYTES:
            raise ValueError(f"arena size {size} is too small")
        remove_stale_segments(shm_dir)
        path = os.path.join(shm_dir, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask may have narrowed it further; never wider
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm[:NONCE_BYTES] = nonce
        return cls(path, size, nonce, mm, True, np.frombuffer(mm, dtype=np.uint8))

    @classmethod
    def attach(cls, path: str, size: int, nonce: bytes) -> SharedArena:
        """Map a server's arena; raises OSError/ValueError when it is not reachable or not the same one."""
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} has size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mm[:NONCE_BYTES] != nonce:
            mm.close()
            raise ValueError(f"{path} is not the server's arena (nonce mismatch)")
        return cls(path, size, nonce, mm, False, np.frombuffer(mm, dtype=np.uint8))

    def view(self, offset: int, length: int) -> np.ndarray:
        return self.buffer[offset : offset + length]

    def close(self) -> None:
        self.buffer = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:
            # Views handed out are still alive; the mapping goes when they do.
            log.debug("arena %s still has exported views; leaving the mapping to the GC", self.path)
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class Prefaulter:
    """Populates an arena mapping in the background, reporting progress. Started explicitly."""

    def __init__(self, arena: SharedArena, step_bytes: int = 64 << 20, name: str = "kvdepot-prefault") -> None:
        self._arena = arena
        self._step = step_bytes
        self._name = name
        self._done_bytes = 0
        self._supported = True
        self._finished = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    @property
    def progress(self) -> float:
        return 1.0 if self._arena.size == 0 else min(1.0, self._done_bytes / self._arena.size)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def supported(self) -> bool:
        return self._supported

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        t0 = time.perf_counter()
        next_log = t0 + 2.0
        size = self._arena.size
        try:
            for offset in range(0, size, self._step):
                if self._stop.is_set():
                    return
                length = min(self._step, size - offset)
                if not populate(self._arena.mm, offset, length):
                    self._supported = False
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
            log.warning("%s stopped: %s", self._name, exc)
        finally:
            self._done_bytes = size if self._supported and not self._stop.is_set() else self._done_bytes
            self._finished.set()
