"""The disk tier under the pool (L4): pages that left the pool, kept on local disk and promoted back.

Write-through, asynchronous: ``put`` queues a page that the pool just took, pinned, and one writer thread
stores it in the fs tier's format (checksummed, written to a temporary name, fsync'd, renamed: a torn
write is never read) under an LRU bound of its own; the pin ends when the write does, so the pool cannot
evict a page before the disk has it. A full queue drops the write (counted): the page then simply
leaves with its eviction. A page evicted from the pool but on disk stays in the directory as
non-resident; a read promotes it (one disk read and one copy into the pool, under a new generation).
An unusable path turns the tier off with a warning; the node then deletes records on eviction.

Pages the tier lets go of on its own (its LRU under ``disk_size_gb``, an object found corrupt) are told
to the node (``on_dropped``), off the fs tier's locks: a page that was only here is then gone, and its
record with it; otherwise the directory would keep naming pages no read can deliver.

What the disk holds for a key is only ever the pool's current page of it, or nothing: a queued page that
was replaced, deleted or cleared before the writer reached it is not written (the pool retired it), a
delete waits for a write in progress and then removes it, and where the newest page of a key does not
reach the disk (a full queue, a failed write) the older one there is deleted. Otherwise a page deleted
or cleared (how an operator invalidates KV) could come back from disk through a promote or a restart.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from kvdepot.events import TierRemoved
from kvdepot.peer.pool import PoolEntry, PublishedPool
from kvdepot.storage.l2.contract import TierServices
from kvdepot.storage.l2.envelope import CorruptObject
from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
from kvdepot.types import ObjectKey

log = logging.getLogger(__name__)

QUEUE_PAGES = 4096


class _Dropped:
    """The fs tier's event sink: the keys it removed on its own, collected (it tells them under its
    index lock, where nothing may call back into it) until the tier hands them on."""

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._lock = threading.Lock()

    def publish(self, event: object) -> None:
        if isinstance(event, TierRemoved):
            with self._lock:
                self._keys += [bytes(k) for k in event.keys]

    def wants(self, kind: type) -> bool:
        return kind is TierRemoved

    def take(self) -> list[bytes]:
        with self._lock:
            keys, self._keys = self._keys, []
            return keys


class DiskTier:
    def __init__(self, path: str, size_bytes: int, pool: PublishedPool, on_dropped: Callable[[list[bytes]], None] | None = None) -> None:
        """``on_dropped``: called with the keys the tier let go of on its own (never under its locks)."""
        self._dropped = _Dropped()
        self._on_dropped = on_dropped
        # No fsync: a cache page lost to a power cut is a miss, and a page damaged by one fails its checksum
        # (a miss too); the write is still to a temporary name renamed whole, so a crash never shows a torn page.
        self._fs = FsAdapter("peer-disk", FsConfig(path=path, size_gb=size_bytes / (1 << 30), workers=1, fsync=False),
                             TierServices(sink=self._dropped))  # fmt: skip
        self._pool = pool
        self._queue: queue.Queue[PoolEntry | None] = queue.Queue(QUEUE_PAGES)
        self._thread: threading.Thread | None = None
        # Held by the writer from "is this page still current?" to the end of its write, and by every
        # delete: a delete never slips in between (and is never undone by the write that was under way).
        self._io = threading.Lock()
        self.written = 0
        self.skipped = 0  # queued pages replaced, deleted or cleared before their turn
        self.dropped = 0
        self.promoted = 0
        self.corrupt = 0

    def start(self) -> list[bytes]:
        """Take the directory and index it; returns the pages already there (a restart keeps them)."""
        self._fs.start()
        self._thread = threading.Thread(target=self._write_loop, name="kvdepot-peer-disk", daemon=True)
        self._thread.start()
        return [bytes(k) for k in self._fs.keys()]

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
        while True:  # whatever was still queued: unpin it
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            if entry is not None:
                self._pool.release(entry)
        self._fs.close()

    def put(self, entry: PoolEntry) -> None:
        """Write ``entry`` (pinned by the caller; this tier unpins it) to disk, later."""
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1
            self._pool.release(entry)
            self.delete(entry.key)  # an older page of this key must not outlive the newer one on disk

    def pending(self) -> int:
        """Pages queued for the disk (each pins its page in the pool)."""
        return self._queue.qsize()

    def has(self, key: bytes) -> bool:
        return self._fs.contains_now([ObjectKey(key)])[0]

    def load(self, key: bytes, into: Callable[[np.ndarray], object]) -> object | None:
        """Read ``key``'s page and hand it to ``into`` (which copies it where it goes); None when it is
        not on disk or fails its checksum (then it is gone from disk too). The read and ``into`` run
        under the lock every ``delete`` takes: a delete either comes first (nothing to load) or waits
        until ``into`` has put the page where the delete's caller removes it afterwards."""
        with self._io:
            size = self._fs.payload_size(ObjectKey(key))
            if size is None:
                return None
            buf = np.empty(size, np.uint8)
            try:
                if not self._fs.get_now(ObjectKey(key), memoryview(buf)):
                    return None
                corrupt = None
            except CorruptObject as exc:
                corrupt = exc
            if corrupt is None:
                self.promoted += 1
                return into(buf)
        self.corrupt += 1
        log.warning("peer disk: page %s failed its checksum (%s): deleted, a miss", key.hex()[:16], corrupt)
        self._tell_dropped()  # off _io: the node may call delete
        return None

    def size_of(self, key: bytes) -> int | None:
        return self._fs.payload_size(ObjectKey(key))

    def delete(self, key: bytes) -> None:
        """Remove ``key``'s page from disk; a write of it under way finishes first, then goes."""
        with self._io:
            self._fs.delete_now(ObjectKey(key))

    def usage(self) -> tuple[int, int, int]:
        """(bytes used, capacity, pages)."""
        u = self._fs.usage()
        return u.used_bytes, u.capacity_bytes, u.objects

    def _write_loop(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                with self._io:
                    if not entry.published:  # replaced, deleted or cleared while queued
                        self.skipped += 1
                        continue
                    try:
                        self._fs.put_now(ObjectKey(entry.key), self._pool.view(entry))
                        self.written += 1
                    except Exception as exc:  # a full or failing disk: the page just is not on disk
                        log.warning("peer disk: cannot write a page (%s: %s)", type(exc).__name__, exc)
                        self._forget_quietly(entry.key)  # nor an older page of its key
            finally:
                self._pool.release(entry)
            self._tell_dropped()  # what that write evicted to fit (after _io: the node may call delete)

    def _tell_dropped(self) -> None:
        keys = self._dropped.take()
        if not keys or self._on_dropped is None:
            return
        try:
            self._on_dropped(keys)
        except Exception:  # the writer goes on; the records are found stale on a read instead
            log.exception("peer disk: telling the node of %d dropped pages failed", len(keys))

    def _forget_quietly(self, key: bytes) -> None:
        try:
            self._fs.delete_now(ObjectKey(key))
        except Exception as exc:
            log.warning("peer disk: cannot delete an outdated page (%s: %s)", type(exc).__name__, exc)


def open_disk(path: str, size_bytes: int, pool: PublishedPool,
              on_dropped: Callable[[list[bytes]], None] | None = None) -> tuple[DiskTier | None, list[bytes]]:  # fmt: skip
    """The disk tier, or None (with a warning naming why) where ``path`` cannot be used."""
    tier = DiskTier(path, size_bytes, pool, on_dropped)
    try:
        return tier, tier.start()
    except (OSError, ValueError) as exc:
        log.warning("peer disk tier at %s is off: %s", path, exc)
        return None, []
