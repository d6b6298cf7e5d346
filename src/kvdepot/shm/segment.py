"""The shared-memory segment that holds L1: the server creates and owns it, same-host workers map it.

It knows bytes and offsets, never keys. The first ``HEADER_BYTES`` hold a random nonce, so a worker can
prove it mapped *this* server's segment before it trusts the shm path.

Four guarantees, each enforced here:

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
  The lock has an open file description of its own, which nothing else shares: the mapping is made
  through a second one. (A mapping holds a reference to the description it was made through, so a lock
  on that one would live as long as any process keeps the mapping.)
- **Forks are not watched.** A ``fork()`` child shares its parent's file descriptions, so it would keep
  the parent's liveness lock after the parent died, and the server would go on protecting the dead
  worker's slots for as long as the child lives. So in a child made by ``os.fork`` (and
  ``multiprocessing``'s fork start method) an at-fork hook closes the child's copy of the lock's
  descriptor (never ``F_UNLCK``: that would release the parent's lock), and the lock goes with the
  parent. The child *keeps* its mapping, so arrays that reference it stay valid memory, but made
  read-only: nothing watches the child, and a write through a view taken before the fork kills it
  with SIGSEGV instead of landing in space the server may have handed to someone else. New views are
  refused with an OSError (``buffer``, ``view``). A ``fork()`` from C, without the interpreter's
  at-fork hooks, is not covered. The owner's ``flock`` is per file description too, so a forked
  server child would keep the arena owned; the server never forks without exec (its descriptors are
  O_CLOEXEC), so the owner's side is left as it is.

Both sides import this module (``kvdepot.shm``), and it imports nothing of theirs.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from kvdepot.errors import ConfigError

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
NONCE_BYTES = 16
SHM_DIR = "/dev/shm"
_PREFIX = "kvdepot-"
# An arena's name, and nothing else: other files share the directory and the prefix (a worker's host
# cache file, ``kvdepot-kvcache-*``, which no lock holds while its worker lives).
_ARENA_NAME = re.compile(r"kvdepot-[0-9]+-[0-9a-f]{12}")
_LIVENESS_SPAN = 1 << 47  # liveness lock offsets lie in [size, size + span): far past any data

# struct flock on Linux x86-64/aarch64: short l_type, short l_whence, (pad), off_t l_start, off_t l_len,
# pid_t l_pid, (pad).
_FLOCK = struct.Struct("hh4xqqi4x")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mprotect.restype = ctypes.c_int


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
    """Unlink arenas that no server holds: only a segment whose ownership lock can be taken is stale, and
    only a file named as an arena is one."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not _ARENA_NAME.fullmatch(name):
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


def _other_users_arenas(shm_dir: str) -> str:
    """The arenas in ``shm_dir`` that belong to other users, said for a refusal for want of room: the
    sweep above cannot check or unlink them (mode 0600, the sticky bit), so a dead server of another user
    fills the directory for good, and "only 0.00 GiB free" alone would not say why ('' when none)."""
    me, found = os.geteuid(), []
    if me == 0:
        return ""  # root's sweep checked them all: what is left is live servers' own
    try:
        names = sorted(n for n in os.listdir(shm_dir) if _ARENA_NAME.fullmatch(n))
    except OSError:
        return ""
    for name in names:
        try:
            st = os.lstat(os.path.join(shm_dir, name))
        except OSError:
            continue
        if st.st_uid != me:
            found.append((name, st.st_uid, st.st_blocks * 512))
    if not found:
        return ""
    named = ", ".join(f"{name} (uid {uid}, {used / 2**30:.2f} GiB)" for name, uid, used in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return (
        f"{shm_dir} holds {sum(f[2] for f in found) / 2**30:.2f} GiB of other users' kvdepot arenas, which this "
        f"user (uid {me}) cannot remove: {named}{more}; a dead server's arena goes when a server of its user "
        f"starts on {shm_dir}, or remove it by hand"
    )


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


@dataclass(eq=False)
class SharedArena:
    """A mapped shared-memory segment. ``create`` (server) owns and unlinks it; ``attach`` (worker) maps
    it. Both keep the file open: the owner for its ownership lock, a worker for its liveness lock.

    In a ``fork()`` child of a worker the arena is ``forked``: no lock, no descriptor, a read-only
    mapping, and ``buffer`` raises (see the module's guarantees)."""

    path: str
    size: int
    nonce: bytes
    mm: mmap.mmap
    owner: bool
    _buffer: np.ndarray | None = field(repr=False)  # uint8 view of the whole mapping (``buffer``)
    fd: int = -1
    liveness_lock: int = -1  # the offset this worker holds its liveness lock at (-1: none)
    forked: bool = False  # this process is a fork() child of the one that attached: nothing watches it
    _pid: int = field(default_factory=os.getpid, repr=False)  # the process that created or attached it
    _address: int = field(default=0, repr=False)  # where the mapping starts (for mprotect in a child)
    _deferred: _DeferredRelease | None = field(default=None, repr=False)  # closed while views were alive

    @property
    def buffer(self) -> np.ndarray:
        """A uint8 view of the whole mapping; OSError in a fork() child of the worker that attached it."""
        if self.forked:
            raise OSError(
                f"arena {self.path} was mapped by process {self._pid}, and this process ({os.getpid()}) is a "
                f"fork() of it: the server does not watch forked processes, so they may not use arena slots "
                f"(their writes could land in space it has handed to someone else); create a KVClient in "
                f"this process instead",
            )
        assert self._buffer is not None
        return self._buffer

    @buffer.setter
    def buffer(self, value: np.ndarray) -> None:
        self._buffer = value

    @classmethod
    def create(cls, size: int, shm_dir: str = SHM_DIR, allow_over_memory: bool = False) -> SharedArena:
        if size <= HEADER_BYTES:
            raise ValueError(f"arena size {size} is too small")
        path = os.path.join(shm_dir, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            remove_stale_segments(shm_dir)
            try:
                check_capacity(size, shm_dir, allow_over_memory)
            except ArenaCapacityError as exc:
                others = _other_users_arenas(shm_dir)
                if not others:
                    raise
                raise ArenaCapacityError(f"{exc}; {others}") from None
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a directory that is not there, not a directory, or not writable
            raise ConfigError(f"--shm-dir {shm_dir}: cannot create the L1 arena there: {exc.strerror or exc}") from None
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
        """Map a server's arena; raises OSError/ValueError when it is not reachable or not the same one.

        Two opens: ``fd`` (kept, for the liveness lock) and one the mapping is made through (closed at
        once), so that the lock's file description is referenced by ``fd`` alone. The fork guard keeps a
        fork() from copying ``fd`` before the arena is registered for the at-fork hook."""
        with _fork_guard:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if st.st_size != size:
                    raise ValueError(f"{path} has size {st.st_size}, expected {size}")
                map_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    mst = os.fstat(map_fd)
                    if (mst.st_dev, mst.st_ino) != (st.st_dev, st.st_ino):
                        raise ValueError(f"{path} was replaced while it was being mapped")
                    mm = mmap.mmap(map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(map_fd)  # the mapping keeps its description; the lock's is ``fd``'s alone
            except BaseException:
                os.close(fd)
                raise
            if mm[:NONCE_BYTES] != nonce:
                mm.close()
                os.close(fd)
                raise ValueError(f"{path} is not the server's arena (nonce mismatch)")
            buffer = np.frombuffer(mm, dtype=np.uint8)
            arena = cls(path, size, nonce, mm, False, buffer, fd, _address=buffer.__array_interface__["data"][0])
            _attached.add(arena)
        return arena

    # --- liveness locks (workers hold one, the server tests it) ------------------------------------

    def hold_liveness_lock(self, offset: int) -> None:
        """Worker side: take the liveness lock the server assigned; OSError if it cannot be had."""
        if not self.size <= offset < self.size + _LIVENESS_SPAN:
            raise ValueError(f"liveness lock offset {offset} is outside the lock range")
        if self.fd < 0:
            raise OSError(f"cannot take the liveness lock at {offset}: arena {self.path} is {self._gone()}")
        try:
            _ofd_lock(self.fd, offset, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot take the liveness lock at {offset}: {os.strerror(exc.errno)}") from None
        self.liveness_lock = offset

    def lock_held(self, offset: int) -> bool:
        """Server side: does some process hold the liveness lock at ``offset``?"""
        if self.fd < 0:
            raise OSError(f"cannot test the liveness lock at {offset}: arena {self.path} is {self._gone()}")
        ltype, _ = _ofd_lock(self.fd, offset, fcntl.F_OFD_GETLK, fcntl.F_WRLCK)
        return ltype != fcntl.F_UNLCK

    def view(self, offset: int, length: int) -> np.ndarray:
        return self.buffer[offset : offset + length]

    def close(self) -> None:
        """Unmap (unless views are still alive) and let go of the lock. Safe in a fork() child too."""
        self._buffer = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
            unmapped = True
        except BufferError:
            # Views handed out are still alive; the mapping goes when they do.
            log.debug("arena %s still has exported views; leaving the mapping to the GC", self.path)
            unmapped = False
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self.fd >= 0:
                os.close(self.fd)  # releases the ownership lock (a live mapping keeps it, see create)
                self.fd = -1
        else:
            with _fork_guard:
                fd, self.fd, self.liveness_lock = self.fd, -1, -1
                _attached.discard(self)
                if unmapped:
                    if fd >= 0:
                        os.close(fd)  # releases the liveness lock
                    if self._deferred is not None:
                        self._deferred.release()  # an earlier close() left it to the views, now gone
                elif fd >= 0:
                    # Those views may still write into arena slots: the lock stays until they are gone.
                    self._deferred = _DeferredRelease(fd, self.mm, self._address, self.size)

    def _gone(self) -> str:
        return f"inherited through fork() from process {self._pid}" if self.forked else "closed"

    def _after_fork_in_child(self) -> None:
        """In a fork() child: let the liveness lock go with the parent, keep the mapping read-only."""
        if self.forked:
            return
        fd, self.fd, self.liveness_lock, self.forked = self.fd, -1, -1, True
        self._buffer = None  # new views are refused (``buffer``); ones taken before the fork stay valid
        if fd >= 0:
            try:
                os.close(fd)  # our reference to the lock's description; F_UNLCK would unlock the parent
            except OSError:
                pass
        if not self.mm.closed:
            _read_only(self._address, self.size)


class _DeferredRelease:
    """A worker arena closed while views of it were alive: its liveness lock (``fd``) stays until the
    mapping goes (the GC then closes it; not at interpreter exit, while daemon threads may still write),
    and a fork() child drops its copy. It holds no reference to the arena or the mapping."""

    def __init__(self, fd: int, mm: mmap.mmap, address: int, size: int) -> None:
        self.fd, self.address, self.size = fd, address, size
        self._mm = weakref.ref(mm)
        _pending.add(self)
        weakref.finalize(mm, self.release).atexit = False

    def release(self) -> None:
        with _fork_guard:
            fd, self.fd = self.fd, -1
            _pending.discard(self)
            if fd >= 0:
                os.close(fd)

    def _after_fork_in_child(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        mm = self._mm()
        if mm is not None and not mm.closed:
            _read_only(self.address, self.size)


def _read_only(address: int, size: int) -> None:
    if address:
        _libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(size), mmap.PROT_READ)


# --- fork() children -----------------------------------------------------------------------------------

# Worker arenas whose ``fd`` is open in this process, and the descriptors of those closed while views
# were alive: the at-fork hook walks both in the child. The guard is held from a worker's open() of the
# arena to its registration here, around the closing of its descriptor, and by fork() itself (before),
# so that no child inherits a descriptor it does not know of.
_attached: weakref.WeakSet[SharedArena] = weakref.WeakSet()
_pending: set[_DeferredRelease] = set()
_fork_guard = threading.RLock()


def _before_fork() -> None:
    _fork_guard.acquire()


def _after_fork_in_parent() -> None:
    _fork_guard.release()


def _after_fork_in_child() -> None:
    """Drop every worker arena's liveness lock in a fork() child: cheap (a close and an mprotect per
    arena) and never raising."""
    try:
        for item in [*_attached, *_pending]:
            try:
                item._after_fork_in_child()
            except Exception:  # noqa: BLE001, S110 - an at-fork hook must not raise, nor log (its locks)
                pass
        _attached.clear()
        _pending.clear()
    except Exception:  # noqa: BLE001, S110 - as above
        pass
    try:
        _fork_guard.release()
    except RuntimeError:
        pass


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


