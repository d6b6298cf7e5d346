"""The shared-memory segment that holds L1: the server creates and owns it, same-host workers map it.

It knows bytes and offsets, never keys. The first ``HEADER_BYTES`` hold a random nonce, so a worker can
prove it mapped *this* server's segment before it trusts the shm path.

Three guarantees, each enforced here:

- **Reserved, not promised.** ``create`` refuses a size larger than the shm filesystem's free space (or,
  unless the operator allows it, the machine's available memory) and then reserves every page with
  ``posix_fallocate``. A tmpfs that cannot hold the arena fails at start with ENOSPC, never later with
  a SIGBUS in the server or a worker.
- **Owned by a lock, not a pid.** The owning server holds an exclusive ``flock`` on the segment for its
  whole life. ``remove_stale_segments`` deletes only segments nobody holds a lock on, so a server in
  another PID namespace (containers sharing ``/dev/shm``) never deletes a live arena because it cannot
  see the owner's pid.
- **Watchable mappers.** A worker that maps the arena holds an OFD write lock on one byte *past the end*
  of the segment, at an offset the server gives it (``liveness_offset``). The lock lives exactly as long
  as some process holds the worker's file description, so ``lock_held`` tells the server whether a
  process that may still write into arena slots is running, in any PID namespace, without a pid.

Both sides import this module (``kvdepot.shm``), and it imports nothing of theirs.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np

from kvdepot.errors import ConfigError

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
NONCE_BYTES = 16
SHM_DIR = "/dev/shm"
_PREFIX = "kvdepot-"
_LIVENESS_SPAN = 1 << 47  # liveness lock offsets lie in [size, size + span): far past any data

# struct flock on Linux x86-64/aarch64: short l_type, short l_whence, (pad), off_t l_start, off_t l_len,
# pid_t l_pid, (pad).
_FLOCK = struct.Struct("hh4xqqi4x")


class ArenaCapacityError(ConfigError):
    """The arena cannot be backed by real memory: refuse to start rather than SIGBUS later."""


# --- capacity ----------------------------------------------------------------------------------------


def shm_free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None when it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_capacity(size: int, shm_dir: str, allow_over_memory: bool = False) -> None:
    """Raise ArenaCapacityError, naming the free space and the flag, unless ``size`` bytes fit."""
    gib = 1 << 30
    free = shm_free_bytes(shm_dir)
    if size > free:
        raise ArenaCapacityError(
            f"--l1-size-gb asks for {size / gib:.2f} GiB but {shm_dir} has only {free / gib:.2f} GiB free; "
            f"lower --l1-size-gb or give --shm-dir a filesystem with room",
        )
    mem = available_memory_bytes()
    if mem is not None and size > mem and not allow_over_memory:
        raise ArenaCapacityError(
            f"--l1-size-gb asks for {size / gib:.2f} GiB but this machine has only {mem / gib:.2f} GiB of memory "
            f"available; lower --l1-size-gb, or pass --l1-over-memory to start anyway (the OS may then swap or "
            f"kill processes)",
        )


# --- locks -------------------------------------------------------------------------------------------


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink arenas that no server holds: only a segment whose ownership lock can be taken is stale."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _try_flock(fd):  # nobody owns it: its server is gone (in whatever PID namespace)
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)  # also drops our lock
    return removed


def liveness_offset(size: int, token: bytes) -> int:
    """Where the mapper identified by ``token`` holds its liveness lock: one byte past the data, spread
    over a 2^47 range so two clients practically never share one (a clash only makes the second client
    fall back to the inline transport)."""
    h = int.from_bytes(hashlib.blake2b(token, digest_size=8).digest(), "little")
    return size + h % _LIVENESS_SPAN


def _ofd_lock(fd: int, offset: int, cmd: int, ltype: int) -> tuple[int, int]:
    arg = _FLOCK.pack(ltype, os.SEEK_SET, offset, 1, 0)
    out = fcntl.fcntl(fd, cmd, arg)
    ltype_out, _, _, _, pid = _FLOCK.unpack(out)
    return ltype_out, pid


@dataclass
class SharedArena:
    """A mapped shared-memory segment. ``create`` (server) owns and unlinks it; ``attach`` (worker) maps
    it. Both keep the file open: the owner for its ownership lock, a worker for its liveness lock."""

    path: str
    size: int
    nonce: bytes
    mm: mmap.mmap
    owner: bool
    buffer: np.ndarray  # uint8 view of the whole mapping
    fd: int = -1
    liveness_lock: int = -1  # the offset this worker holds its liveness lock at (-1: none)

    @classmethod
    def create(cls, size: int, shm_dir: str = SHM_DIR, allow_over_memory: bool = False) -> SharedArena:
        if size <= HEADER_BYTES:
            raise ValueError(f"arena size {size} is too small")
        remove_stale_segments(shm_dir)
        check_capacity(size, shm_dir, allow_over_memory)
        path = os.path.join(shm_dir, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            # Lock first: between create and lock, a sweeper could take a lock-free segment for stale.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)  # umask may have narrowed it further; never wider
            os.ftruncate(fd, size)
            t0 = time.perf_counter()
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ArenaCapacityError(
                    f"cannot reserve {size / 2**30:.2f} GiB for L1 in {shm_dir} ({os.strerror(exc.errno)}; "
                    f"{shm_free_bytes(shm_dir) / 2**30:.2f} GiB free now): lower --l1-size-gb",
                ) from None
            log.info("L1 arena: %.2f GiB reserved in %s in %.2f s", size / 2**30, shm_dir, time.perf_counter() - t0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm[:NONCE_BYTES] = nonce
        return cls(path, size, nonce, mm, True, np.frombuffer(mm, dtype=np.uint8), fd)

    @classmethod
    def attach(cls, path: str, size: int, nonce: bytes) -> SharedArena:
        """Map a server's arena; raises OSError/ValueError when it is not reachable or not the same one."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} has size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if mm[:NONCE_BYTES] != nonce:
            mm.close()
            os.close(fd)
            raise ValueError(f"{path} is not the server's arena (nonce mismatch)")
        return cls(path, size, nonce, mm, False, np.frombuffer(mm, dtype=np.uint8), fd)

    # --- liveness locks (workers hold one, the server tests it) ------------------------------------

    def hold_liveness_lock(self, offset: int) -> None:
        """Worker side: take the liveness lock the server assigned; OSError if it cannot be had."""
        if not self.size <= offset < self.size + _LIVENESS_SPAN:
            raise ValueError(f"liveness lock offset {offset} is outside the lock range")
        try:
            _ofd_lock(self.fd, offset, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot take the liveness lock at {offset}: {os.strerror(exc.errno)}") from None
        self.liveness_lock = offset

    def lock_held(self, offset: int) -> bool:
        """Server side: does some process hold the liveness lock at ``offset``?"""
        ltype, _ = _ofd_lock(self.fd, offset, fcntl.F_OFD_GETLK, fcntl.F_WRLCK)
        return ltype != fcntl.F_UNLCK

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
        if self.fd >= 0:
            os.close(self.fd)  # releases the ownership lock or the liveness lock
            self.fd = -1


