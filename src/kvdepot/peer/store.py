"""``PeerStore``: a page store every node of a peer cluster can read, with no master to run.

::

    from kvdepot.peer import PeerStore
    with PeerStore(discovery="10.0.0.1:31995", host="10.0.0.2", pool_size_mb=4096, secret="...") as store:
        store.set("page-1", page_bytes)            # one copy into this node's pool, then published
        store.batch_exists(["page-1", "page-2"])   # leading pages found anywhere (SGLang HiCache's rule)
        store.get_into("page-1", buffer)           # straight into a caller's buffer, from whichever node has it

Keys are ``str`` (UTF-8) or ``bytes``, up to 1 KiB. A page is any contiguous buffer. Every get or exists
either answers within ``timeout_s`` or is a miss; a page read is always exactly the bytes set under its key
(checked against the checksum recorded when it was set), never another page's.

One store may be used from many threads. ``close`` waits for the calls in flight (each ends within its
deadline) before it closes the node's sockets; a call after it raises KVDepotError (CONNECTION).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, TypeVar

from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.peer.config import PeerConfig
from kvdepot.peer.dataplane import PageOutcome
from kvdepot.peer.node import PeerNode
from kvdepot.types import leading_run

Key = str | bytes
F = TypeVar("F", bound=Callable[..., Any])


def _key(key: Key) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return bytes(key)
    try:
        return bytes(memoryview(key))  # bytes-like only: bytes(5) would be five zero bytes, bytes([1, 2]) two bytes
    except TypeError:
        raise TypeError(f"a page key is a str or bytes, got {type(key).__name__} {key!r:.60}") from None


def _in_flight(method: F) -> F:
    """A call ``close`` waits for, and one refused once the store is closed: the node's ZeroMQ sockets
    must outlive every call using them (closing a socket another thread polls aborts the process)."""

    @wraps(method)
    def call(self: PeerStore, *args: Any, **kwargs: Any) -> Any:
        with self._calls_done:
            if self._closed:
                raise KVDepotError("PeerStore is closed", ErrorCode.CONNECTION)
            self._calls += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._calls_done:
                self._calls -= 1
                if not self._calls:
                    self._calls_done.notify_all()

    return call  # type: ignore[return-value]


class PeerStore:
    def __init__(self, config: PeerConfig | None = None, **options: Any) -> None:
        """``PeerStore(discovery=..., host=..., pool_size_mb=..., secret=...)`` or ``PeerStore(PeerConfig(...))``;
        the options are ``PeerConfig``'s (``kvdepot peer --help`` lists them)."""
        if config is not None and options:
            raise TypeError("give a PeerConfig or keyword options, not both")
        self.config = config or PeerConfig(**options)
        self._calls = 0  # public calls in flight
        self._closed = False
        self._calls_done = threading.Condition()
        self.node = PeerNode(self.config).start()

    def __enter__(self) -> PeerStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Refuse new calls, wait for those in flight (each ends within its deadline), then close the node."""
        with self._calls_done:
            if self._closed:
                return
            self._closed = True
            self._calls_done.wait_for(lambda: not self._calls)
        self.node.close()

    @property
    def node_id(self) -> str:
        assert self.node.info is not None
        return self.node.info.id

    # --- writes --------------------------------------------------------------------------------------

    def set(self, key: Key, value) -> bool:
        return self.batch_set([key], [value])[0]

    @_in_flight
    def batch_set(self, keys: Sequence[Key], values: Sequence) -> list[bool]:
        """Per key: stored in this node's pool and published, and still held when the call ends (False:
        larger than the pool, the pool is full of pages being read, or a later page of this call
        evicted it: a batch larger than the pool keeps its last pages, or those a disk tier took). A
        value is any contiguous buffer, or a strided numpy array (a page of a layer-first host pool),
        gathered straight into the pool."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        return self.node.put_many([(_key(k), v) for k, v in zip(keys, values, strict=True)])

    @_in_flight
    def delete(self, key: Key) -> bool:
        """Remove this node's page of ``key`` (other nodes' copies are theirs)."""
        return self.node.delete(_key(key))

    @_in_flight
    def clear(self) -> int:
        """Remove every page this node published."""
        return self.node.clear()

    # --- reads ---------------------------------------------------------------------------------------

    def exists(self, key: Key, **options) -> bool:
        """``options``: ``batch_exists``'s (``timeout_s``, ``hint``, ``recompute_s``), as for every read."""
        return self.batch_exists([key], **options) == 1

    def batch_exists(self, keys: Sequence[Key], timeout_s: float | None = None, hint: str = "", recompute_s: float | None = None) -> int:
        """How many leading keys some node holds (and, with ``recompute_s``, is worth pulling from)."""
        return leading_run(self.exists_many(keys, timeout_s, hint, recompute_s))

    @_in_flight
    def exists_many(self, keys: Sequence[Key], timeout_s: float | None = None, hint: str = "", recompute_s: float | None = None) -> list[bool]:
        """``timeout_s`` (here and in every read): this call's deadline instead of the configured one.
        ``hint`` (here and in every read): a router's ``host[:port]`` of the node that holds the pages,
        asked first; a wrong one falls back to the directory. ``recompute_s`` (here and in every read):
        what computing these pages again would take; other nodes' pages whose pull is estimated slower
        are not counted (a scheduler that plans on this lookup then recomputes them, rather than
        planning a load the read would decline)."""
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        # Asked of the directory every time (what a scheduler plans around stays exact); a get that
        # follows reads from the locations found here without asking again.
        locations = self.node.resolve([_key(k) for k in keys], deadline, hint, remembered=False)
        locations = self.node.worth_pulling(locations, recompute_s)
        self.node.warm(locations)  # pages found only on a disk: promoted now, for the read that follows
        return [loc is not None for loc in locations]

    def get(self, key: Key, **options) -> bytes | None:
        """``options``: ``batch_get``'s (``timeout_s``, ``hint``, ``recompute_s``), as for every read."""
        return self.batch_get([key], **options)[0]

    @_in_flight
    def batch_get(self, keys: Sequence[Key], timeout_s: float | None = None, hint: str = "", recompute_s: float | None = None) -> list[bytes | None]:
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        raw = [_key(k) for k in keys]
        locations = self.node.resolve(raw, deadline, hint)
        buffers = [bytearray(loc.length) if loc is not None else bytearray(0) for loc in locations]
        got, _ = self.node.fetch(raw, [memoryview(b) for b in buffers], deadline, located=locations, recompute_s=recompute_s)
        return [bytes(b) if ok is PageOutcome.HIT else None for b, ok in zip(buffers, got, strict=True)]

    def get_into(self, key: Key, dest, **options) -> bool:
        """Read ``key``'s page straight into ``dest`` (a writable buffer of exactly the page's size)."""
        return self.batch_get_into([key], [dest], **options)[0]

    @_in_flight
    def batch_get_into(self, keys: Sequence[Key], dests: Sequence, timeout_s: float | None = None, hint: str = "",
                       recompute_s: float | None = None) -> list[bool]:  # fmt: skip
        """Per key: its page read into its buffer (contiguous, writable) and verified. A buffer of
        another size is a miss. ``recompute_s``: what computing these pages again would cost the
        caller; pages on other nodes are then pulled only when the estimate says it is faster."""
        if len(keys) != len(dests):
            raise ValueError(f"{len(keys)} keys for {len(dests)} buffers")
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        views = [memoryview(d).cast("B") for d in dests]
        got, _ = self.node.fetch([_key(k) for k in keys], views, deadline, hint=hint, recompute_s=recompute_s)
        return [ok is PageOutcome.HIT for ok in got]

    # --- state ---------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        s = self.node.pool.stats()
        return {
            "node": self.node_id,
            "head": self.node.head,
            "joined": self.node.joined,
            "members": [n.id for n in self.node.members()],
            "masters": self.node.masters(),
            "pool": {"capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes, "keys": s.keys, "evictions": s.evictions},
            "directory_records": len(self.node.shard),
            "publish": {"owed": len(self.node.owed), "repaid": self.node.repaid, "unpublish_owed": len(self.node.unpublish_owed),
                        "unpublish_dropped": self.node.unpublish_owed.dropped},  # records some owner missed, sent again
            "disk": self._disk_status(),
            "peers": self.node.planner.snapshot(),
            "pull_decisions": self.node.metrics.summary()["pull_decisions"],
        }

    def _disk_status(self) -> dict[str, Any] | None:
        disk = self.node.disk
        if disk is None:
            return None
        used, capacity, pages = disk.usage()
        return {"used_bytes": used, "capacity_bytes": capacity, "pages": pages, "written": disk.written, "promoted": disk.promoted,
                "dropped": disk.dropped, "skipped": disk.skipped, "corrupt": disk.corrupt}  # fmt: skip
