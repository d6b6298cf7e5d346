"""``fs``: one file per object on a local filesystem, size-bounded with its own LRU, kept across restarts.

Layout under ``path``::

    .lock                 flock'd while a tier uses the directory (one tier per directory)
    <xx>/<key hex>        one object: the envelope (header, key, payload); xx = first byte of the
                          key's chunk-hash part, so 256 directories share the objects evenly
    <xx>/h<sha256 hex>    one object whose key is too long for its hex to be a file name (a peer tier's
                          disk takes keys up to 1 KiB): named by the key's digest, the key itself read
                          back from the envelope at start-up
    <xx>/.tmp-<random>    a write in progress; never read, removed at start-up

A write goes to a temporary name in the object's directory, is written whole, fsync'd, then renamed
over the real name (and the directory fsync'd), so a crash leaves either the old object, the new one,
or nothing, and never a torn object under a real name. A delete (or clear) fsyncs the directories it
unlinked from before it is reported done, so a deleted object does not come back after a power loss. A torn file that appears anyway (a lying disk,
an operator's ``truncate``) fails the envelope's length or checksum check on load: a miss, never bytes.

The in-memory index (key -> file size, in LRU order) is the authority on what the tier holds; it is
rebuilt in ``start()`` by scanning the directory, oldest modification time first, so the cache
survives a restart as the LRU it was: a load sets its file's modification time to now (when it is
older than ``TOUCH_AFTER_S``, so a hot object costs one metadata write a minute, not one per load).

Locks: ``_mu`` guards the index and byte counts and is never held over I/O. Renaming into place and
unlinking are paired with their index update under a per-key *name lock* (a stripe of 64), which is
held over that one metadata call and never over data I/O; it keeps an eviction's unlink from removing
an object that a concurrent put has just renamed into place.

A disk that fills before ``size_gb`` does (other data on it, a size larger than the disk) is not a
backend failure: the write that met ENOSPC/EDQUOT is refused alone, and the tier's capacity comes down
to what it holds then (said in the log and in its usage), so later writes evict its own oldest objects
to fit. Treated as a failure, it opened the tier's breaker on every write, and the objects already on
disk could not be read either. While it is smaller, a write looks at the disk's free space (at most every
few seconds) and grows it back towards ``size_gb`` as room comes back.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Annotated, ClassVar

from kvdepot.config import ConfigError, ConfigStruct, option
from kvdepot.storage.l2 import envelope
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import AdapterType, TierServices
from kvdepot.storage.l2.envelope import HEADER_BYTES, CorruptObject, DestinationMismatch, RejectedObject
from kvdepot.types import NAMESPACE_BYTES, ObjectKey

log = logging.getLogger(__name__)
ROOM_CHECK_S = 5.0  # while the disk is fuller than size_gb allows: how often a write looks for room again
TOUCH_AFTER_S = 60.0  # a load marks its file used (mtime: the LRU order a restart rebuilds) once it is this old

ALIGN = 4096  # O_DIRECT buffer, offset and length alignment
TMP_PREFIX = ".tmp-"
DIR_MODE = 0o700  # the directories the tier makes: under any umask (000 too) no other user lists, plants or removes objects
LOCK_NAME = ".lock"
MAX_KEY_BYTES = 127  # the file name is the key's hex: at most 254 characters (NAME_MAX is 255)
LONG_PREFIX = "h"  # + the sha256 hex of a longer key: 65 characters, an odd length no key's hex has
MAX_LONG_KEY_BYTES = 0xFFFF  # the envelope's key length is a u16
_NAME_LOCKS = 64
_FANOUT = [f"{i:02x}" for i in range(256)]


class FsConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    path: Annotated[str, option("directory of the tier (one tier per directory; kept across restarts)", min_length=1)]
    size_gb: Annotated[float, option("capacity in GiB (LRU beyond it)", gt=0)] = 10.0
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 2
    o_direct: Annotated[bool, option("read and write with O_DIRECT (bypass the page cache)")] = False
    fsync: Annotated[bool, option("fsync each object and its directory before it counts as stored")] = True

    def _check_together(self) -> None:
        if self.o_direct and not hasattr(os, "O_DIRECT"):
            raise ConfigError("o_direct=true, but this platform has no O_DIRECT")


class FsAdapter(BackendAdapter):
    kind = "fs"

    def __init__(self, name: str, config: FsConfig, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self._root = os.path.abspath(config.path)
        self._capacity = int(config.size_gb * (1 << 30))
        self._configured = self._capacity  # _capacity is less while the disk has no room for it all
        self._room_checked = 0.0  # when the disk's free space was last looked at (monotonic)
        self._room_lock = threading.Lock()  # one put looks at the disk's free space; the rest wait for it
        self._layout_lock = threading.Lock()  # one put makes vanished directories again (_restore_layout)
        self._o_direct = config.o_direct
        self._fsync = config.fsync
        self._index: OrderedDict[ObjectKey, int] = OrderedDict()  # key -> file bytes, oldest first
        self._used = 0  # bytes of indexed objects
        self._reserved = 0  # bytes of puts in flight
        self._mu = threading.Lock()
        self._name_locks = [threading.Lock() for _ in range(_NAME_LOCKS)]
        self._local = threading.local()  # per worker: its aligned O_DIRECT buffer
        self._lock_fd = -1

    def __repr__(self) -> str:
        with self._mu:
            objects, used = len(self._index), self._used
        return (
            f"FsAdapter({self.name!r}, path={self._root!r}, objects={objects}, used={used}, "
            f"capacity={self._capacity}, o_direct={self._o_direct}, healthy={self._healthy})"
        )

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the directory, check O_DIRECT, clean up and index what is there, then start workers."""
        os.makedirs(self._root, DIR_MODE, exist_ok=True)
        self._take_directory()
        try:
            for sub in _FANOUT:
                os.makedirs(os.path.join(self._root, sub), DIR_MODE, exist_ok=True)
            if self._o_direct:
                self._probe_o_direct()
            self._rebuild_index()
        except BaseException:
            self._release_directory()
            raise
        super().start()

    def _close_backend(self) -> None:
        # the workers' O_DIRECT buffers went with their threads (thread-local, unmapped when freed)
        self._release_directory()

    def _take_directory(self) -> None:
        fd = os.open(os.path.join(self._root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            # a second tier would delete the first one's writes in progress and miscount its bytes
            raise ConfigError(f"{self._root} is in use by another fs tier (this server's or another's): give each tier a path of its own") from None
        self._lock_fd = fd

    def _release_directory(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    def _probe_o_direct(self) -> None:
        """Fail at start-up, not on the first store, where the filesystem refuses O_DIRECT."""
        probe = os.path.join(self._root, f"{TMP_PREFIX}probe-{secrets.token_hex(8)}")
        buf = mmap.mmap(-1, ALIGN)
        fd = -1
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o600)
            os.write(fd, buf)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                raise ValueError(
                    f"fs tier {self.name}: the filesystem at {self._root} does not support O_DIRECT "
                    f"(tmpfs and some network filesystems refuse it); set o_direct=false"
                ) from None
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            buf.close()
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass

    def _rebuild_index(self) -> None:
        found: list[tuple[int, ObjectKey, int]] = []  # (mtime, key, size)
        removed = 0
        for name in os.listdir(self._root):
            if name.startswith(TMP_PREFIX):
                removed += _unlink_quiet(os.path.join(self._root, name))
        for sub in _FANOUT:
            with os.scandir(os.path.join(self._root, sub)) as entries:
                for entry in entries:
                    if entry.name.startswith(TMP_PREFIX):
                        removed += _unlink_quiet(entry.path)
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    key = _key_from_name(entry.name)
                    if key is None and _is_long_name(entry.name):
                        try:
                            key = _long_key_of(entry.path)
                        except envelope.NewerFormat:
                            continue  # a newer kvdepot's: its key cannot be read here, and it is not ours to remove
                        if key is None:  # torn before its key was whole (a power loss without fsync)
                            removed += _unlink_quiet(entry.path)
                            continue
                    if key is None or _fanout(key) != sub or self._path(key) != entry.path:
                        continue  # not ours: leave it alone
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size < HEADER_BYTES + len(key):  # torn (a power loss without fsync): never an object
                        removed += _unlink_quiet(entry.path)
                        continue
                    found.append((st.st_mtime_ns, key, st.st_size))
        found.sort(key=lambda f: f[0])
        index: OrderedDict[ObjectKey, int] = OrderedDict((key, size) for _, key, size in found)
        used = sum(index.values())
        over: list[ObjectKey] = []
        while used > self._capacity and index:  # size_gb shrank since the last run
            key, size = index.popitem(last=False)
            used -= size
            over.append(key)
        with self._mu:
            self._index, self._used, self._reserved = index, used, 0
        for key in over:
            _unlink_quiet(self._path(key))
        if removed or over:
            log.info("fs tier %s: removed %d unfinished or torn writes, evicted %d objects over size_gb", self.name, removed, len(over))
        log.info("fs tier %s: %d objects, %d bytes found in %s", self.name, len(index), used, self._root)

    # --- backend primitives --------------------------------------------------------------------------

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        data = memoryview(payload).cast("B")
        head = envelope.encode_header(key, data)
        total = len(head) + data.nbytes
        final = self._path(key)
        directory = os.path.dirname(final)
        if self._capacity < self._configured:
            self._regrow()
        with self._mu:
            victims = self._make_room(total, key)
            self._reserved += total
        committed = False
        tmp = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(8)}")
        try:
            self._unlink_victims(victims)
            try:
                try:
                    self._write_file(tmp, head, data, total)
                except FileNotFoundError:
                    # The object's directory is gone: wiped behind the tier's back (an operator freeing
                    # the disk, a tmp cleaner removing directories left empty). Made again, the write
                    # goes on; left alone, every write into it failed and kept the tier down for good.
                    self._restore_layout()
                    self._write_file(tmp, head, data, total)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._shrink_to_what_fits(total, exc)
                raise RejectedObject(f"the disk is full ({exc.strerror}): this object is not stored") from None
            with self._name_lock(key):
                os.rename(tmp, final)
                with self._mu:
                    self._reserved -= total
                    old = self._index.pop(key, None)
                    if old is not None:
                        self._used -= old
                    self._index[key] = total
                    self._used += total
                committed = True
            if self._fsync:
                # Durability only (the object is whole either way); synced once per batch in _flush.
                self._dirty_dirs().add(directory)
        finally:
            if not committed:
                with self._mu:
                    self._reserved -= total
                _unlink_quiet(tmp)

    def _restore_layout(self) -> None:
        """Make the tier's directories (and its lock) again where they vanished, and forget the objects
        indexed under a vanished one: their files went with it, and the index must not claim them."""
        with self._layout_lock:  # one worker restores; the others find it done
            if not os.path.exists(os.path.join(self._root, LOCK_NAME)):
                # The flock held is on a deleted file: take the new one, or another tier could take
                # the directory while this one writes into it.
                os.makedirs(self._root, DIR_MODE, exist_ok=True)
                old_fd, self._lock_fd = self._lock_fd, -1
                try:
                    self._take_directory()  # ConfigError if another tier took the directory meanwhile
                finally:
                    if old_fd >= 0:
                        os.close(old_fd)
            lost = set()
            for sub in _FANOUT:
                directory = os.path.join(self._root, sub)
                if not os.path.isdir(directory):
                    os.makedirs(directory, DIR_MODE, exist_ok=True)
                    lost.add(sub)
        if not lost:
            return
        with self._mu:
            candidates = [key for key in self._index if _fanout(key) in lost]
        gone = []
        for key in candidates:
            with self._name_lock(key):
                if os.path.exists(self._path(key)):
                    continue  # stored again since the directory came back
                with self._mu:
                    size = self._index.pop(key, None)
                    if size is not None:
                        self._used -= size
                        gone.append(key)
        log.warning("L2 %s: %d of the tier's directories under %s vanished (made again): %d objects lost with them",
                    self.name, len(lost), self._root, len(gone))  # fmt: skip
        self._tell_removed(gone, "lost")

    def _shrink_to_what_fits(self, attempted: int, exc: OSError) -> None:
        """The disk ran out before ``size_gb``: keep at most what the tier holds now (this write aside)."""
        with self._mu:
            fits = max(0, self._used + self._reserved - attempted)
            if fits >= self._capacity:
                return
            was, self._capacity = self._capacity, fits
            self._room_checked = time.monotonic()
        log.warning(
            "L2 %s: the disk under %s is full (%s) with the tier at %.3f GiB of its %.3f GiB: it keeps at most that, "
            "evicting its oldest objects to fit, and grows back as the disk has room again",
            self.name, self._root, exc.strerror, fits / (1 << 30), was / (1 << 30),
        )  # fmt: skip

    def _regrow(self) -> None:
        """Towards ``size_gb`` again, by what the disk has free now (keeping a sixteenth of it spare).

        The other workers' puts wait while one looks, and the look counts as done only with the new
        capacity in place: a put that went on with the old one would evict objects the disk now has
        room for (it did, a few dozen at a time, when the looking thread lost the CPU)."""
        if time.monotonic() - self._room_checked < ROOM_CHECK_S:
            return
        with self._room_lock:
            now = time.monotonic()
            if now - self._room_checked < ROOM_CHECK_S:
                return  # another put has just looked
            try:
                st = os.statvfs(self._root)
            except OSError:
                self._room_checked = now
                return
            free = st.f_bavail * st.f_frsize
            with self._mu:
                fits = min(self._configured, self._used + self._reserved + free - free // 16)
                grew = fits > self._capacity
                if grew:
                    self._capacity = fits
                self._room_checked = now
        if not grew:
            return
        log.info("L2 %s: the disk has room again: the tier keeps up to %.3f GiB (size_gb %.3f)",
                 self.name, fits / (1 << 30), self._configured / (1 << 30))  # fmt: skip

    def _dirty_dirs(self) -> set[str]:
        dirs = getattr(self._local, "dirty", None)
        if dirs is None:
            dirs = self._local.dirty = set()
        return dirs

    def _flush(self) -> None:
        dirs = self._dirty_dirs()
        while dirs:
            _fsync_dir(dirs.pop())

    def _make_room(self, need: int, replacing: ObjectKey | None = None) -> list[ObjectKey]:
        """Under ``_mu``: drop unpinned objects, oldest first, until ``need`` more bytes fit. The copy of
        ``replacing`` already here leaves when the new one is renamed over it: its bytes count as freed,
        and it is not dropped to make room for its own replacement.

        Returns the dropped keys, whose files the caller unlinks after releasing ``_mu``."""
        if need > self._capacity:
            raise RejectedObject(f"object of {need} bytes exceeds the tier's {self._capacity}")
        # Walk from the oldest end only as far as needed, choosing first and removing after: a copy of
        # the whole index on every put held _mu (which every lookup and load waits on) for ~0.3 s at a
        # million objects, full or not.
        over = self._used + self._reserved + need - self._capacity
        if replacing is not None:
            over -= self._index.get(replacing, 0)
        victims: list[tuple[ObjectKey, int]] = []
        for key, size in self._index.items():
            if over <= 0:
                break
            if key == replacing or self.is_pinned(key):
                continue
            victims.append((key, size))
            over -= size
        if over > 0:
            raise RejectedObject("fs tier is full of pinned objects and writes in flight")
        for key, size in victims:
            del self._index[key]
            self._used -= size
        self._tell_removed([key for key, _ in victims], "evicted")  # under _mu: ordered with _announce_stored
        return [key for key, _ in victims]

    def _eviction_lock(self) -> threading.Lock:
        return self._mu

    def _still_here(self, keys: list[ObjectKey], recheck: bool) -> list[ObjectKey]:
        return [k for k in keys if k in self._index]  # under _mu: see BackendAdapter._announce_stored

    def _unlink_victims(self, victims: list[ObjectKey]) -> None:
        for key in victims:
            with self._name_lock(key):
                with self._mu:
                    if key in self._index:
                        continue  # stored again since it was chosen: that file is the new one
                _unlink_quiet(self._path(key))

    def _write_file(self, tmp: str, head: bytes, data: memoryview, total: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self._o_direct:
            flags |= os.O_DIRECT
        fd = os.open(tmp, flags, 0o600)  # a tenant's KV: the server's user's alone, as the L1 arena is
        try:
            if self._o_direct:
                padded = -(-total // ALIGN) * ALIGN
                buf = self._aligned_buffer(padded)
                with memoryview(buf) as mv:
                    mv[: len(head)] = head
                    mv[len(head) : total] = data
                    mv[total:padded] = bytes(padded - total)
                    _write_all(fd, mv[:padded])
                os.ftruncate(fd, total)  # the file is exactly the envelope, as without O_DIRECT
            else:
                _write_all(fd, memoryview(head))
                _write_all(fd, data)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _aligned_buffer(self, size: int) -> mmap.mmap:
        """This worker's page-aligned buffer (mmap memory), grown as needed and reused."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                self._local.buf = None  # closed now: a mapping that fails next (ENOMEM) must not leave it here
                buf.close()
            buf = self._local.buf = mmap.mmap(-1, size)
        return buf

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        with self._mu:
            if key not in self._index:
                return False
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget_if_gone(key, path)
            return False
        try:
            st = os.fstat(fd)
            size = st.st_size
            prefix = os.pread(fd, HEADER_BYTES + len(key), 0)
            header = envelope.decode_header(prefix)
            if header.key_len != len(key):
                raise CorruptObject("object is filed under another key")
            if size != header.total:
                raise CorruptObject(f"file has {size} bytes, header says {header.total}")
            dst = memoryview(dest).cast("B")
            if dst.nbytes != header.payload_len:
                raise DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
            _read_exact(fd, dst, HEADER_BYTES + header.key_len)
            envelope.verify(key, header, prefix[HEADER_BYTES:], dst)
            if time.time() - st.st_mtime > TOUCH_AFTER_S:
                _touch(fd)  # used now: a restart orders the LRU by these times
        finally:
            os.close(fd)
        return True

    def _forget_if_gone(self, key: ObjectKey, path: str) -> None:
        """The file vanished behind our back (an operator, another tool): drop it from the index, and say
        so (KV events: a router would otherwise keep the block for good, as the tier never evicts it)."""
        with self._name_lock(key):
            if os.path.exists(path):
                return  # a put renamed a new one into place meanwhile
            with self._mu:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
                    self._tell_removed((key,), "lost")  # under _mu: ordered with _announce_stored, as evictions are

    def payload_size(self, key: ObjectKey) -> int | None:
        """The stored payload's length in bytes (None: not here), from the index."""
        with self._mu:
            size = self._index.get(key)
        return None if size is None else size - HEADER_BYTES - len(key)

    def keys(self) -> list[ObjectKey]:
        """Every indexed object, oldest first."""
        with self._mu:
            return list(self._index)

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        with self._mu:
            return [k in self._index for k in keys]

    def _delete(self, key: ObjectKey) -> None:
        path = self._path(key)
        with self._name_lock(key):
            with self._mu:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
            removed = _unlink_quiet(path)
        if removed and self._fsync:
            # Without the directory's fsync a power loss can bring the deleted object back; synced once
            # per task in _flush (the delete, clear or store batch that removed it), as writes are.
            self._dirty_dirs().add(os.path.dirname(path))

    def _clear(self) -> int:
        with self._mu:
            keys = list(self._index)
        for key in keys:
            self._delete(key)
        return len(keys)

    def _usage(self) -> tuple[int, int, int]:
        with self._mu:
            return self._used, self._capacity, len(self._index)

    # --- naming --------------------------------------------------------------------------------------

    def _path(self, key: ObjectKey) -> str:
        if not key or len(key) > MAX_LONG_KEY_BYTES:
            raise ValueError(f"fs tier: keys must have 1 to {MAX_LONG_KEY_BYTES} bytes, not {len(key)}")
        return os.path.join(self._root, _fanout(key), _file_name(key))

    def path_of(self, key: ObjectKey) -> str:
        """Where ``key``'s object lives (or would); for tests and operators."""
        return self._path(key)

    def _name_lock(self, key: ObjectKey) -> threading.Lock:
        return self._name_locks[hash(key) % _NAME_LOCKS]

    def corrupt_for_test(self, key: ObjectKey, offset: int, mask: int = 0xFF) -> None:
        """Flip one byte of the stored file (its ``mask`` bits; tests prove a corrupt object is a miss, never bad KV)."""
        with open(self._path(key), "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ mask]))


def _fanout(key: bytes) -> str:
    """The first byte of the chunk-hash part as two hex digits (the namespace part is shared by many)."""
    part = key[NAMESPACE_BYTES:] or key
    return part[:1].hex()


def _file_name(key: bytes) -> str:
    """The key's hex, or (too long for a file name) its digest's: the envelope keeps the key itself."""
    if len(key) <= MAX_KEY_BYTES:
        return key.hex()
    return LONG_PREFIX + hashlib.sha256(key).hexdigest()


def _is_long_name(name: str) -> bool:
    return len(name) == len(LONG_PREFIX) + 64 and name.startswith(LONG_PREFIX) and all(c in "0123456789abcdef" for c in name[len(LONG_PREFIX):])


def _long_key_of(path: str) -> ObjectKey | None:
    """The key a digest-named object holds (from its envelope); None when the file is too short to say
    (NewerFormat: a newer kvdepot's object)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(HEADER_BYTES)
            header = envelope.decode_header(prefix)
            key = f.read(header.key_len)
    except (OSError, CorruptObject):
        return None
    if len(key) != header.key_len or _file_name(key) != os.path.basename(path):
        return None
    return ObjectKey(key)


def _key_from_name(name: str) -> ObjectKey | None:
    if not name or len(name) % 2 or len(name) > 2 * MAX_KEY_BYTES:
        return None
    try:
        return ObjectKey(bytes.fromhex(name))
    except ValueError:
        return None


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def _read_exact(fd: int, dest: memoryview, offset: int) -> None:
    """``preadv`` straight into ``dest``: the payload is copied once, from the page cache."""
    got = 0
    while got < dest.nbytes:
        n = os.preadv(fd, [dest[got:]], offset + got)
        if n == 0:
            raise CorruptObject(f"file ended after {got} of {dest.nbytes} payload bytes")
        got += n


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:  # a read-only mount, a file of another owner: the order is a hint, the load stands
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> int:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


ADAPTER = AdapterType(
    "fs",
    FsConfig,
    FsAdapter,
    help="local filesystem, one file per object, size-bounded LRU, survives restarts",
)
