"""Driving an L2 adapter from a test: keys, payloads, and waiting for results the way the server does
(poll the eventfd, then drain ``completed()``), checking that every task is answered exactly once."""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvdepot.storage.l2.contract import L2Adapter, TaskKind, TaskResult
from kvdepot.types import NAMESPACE_BYTES, ObjectKey

HASH_BYTES = 32


def make_keys(n: int, namespace: bytes | None = None) -> list[ObjectKey]:
    """``n`` keys shaped like the server's: a namespace digest + a chunk hash (random, so tests that
    share a persistent backend never see each other's objects)."""
    ns = namespace if namespace is not None else os.urandom(NAMESPACE_BYTES)
    return [ObjectKey(ns + os.urandom(HASH_BYTES)) for _ in range(n)]


def make_payload(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


@dataclass
class _Inbox:
    ready: dict[int, TaskResult] = field(default_factory=dict)  # delivered, not yet taken by wait()
    delivered: set[int] = field(default_factory=set)


_inboxes: weakref.WeakKeyDictionary[object, _Inbox] = weakref.WeakKeyDictionary()


def drain(adapter: L2Adapter) -> list[TaskResult]:
    """One ``completed()`` call, recorded: fails if any task id comes back a second time."""
    inbox = _inboxes.setdefault(adapter, _Inbox())
    results = adapter.completed()
    for r in results:
        assert isinstance(r, TaskResult), r
        assert r.task_id not in inbox.delivered, f"task {r.task_id} was delivered twice"
        inbox.delivered.add(r.task_id)
    return results


def wait(adapter: L2Adapter, task_id: int, timeout: float = 10.0) -> TaskResult:
    """Poll the adapter's eventfd until ``task_id``'s result arrives; other results are kept for
    their own ``wait``. Each task id must be delivered exactly once."""
    inbox = _inboxes.setdefault(adapter, _Inbox())
    poller = select.poll()
    poller.register(adapter.eventfd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while task_id not in inbox.ready:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"task {task_id} of {adapter!r} did not complete within {timeout}s")
        if not poller.poll(max(1, int(left * 1000))):
            continue
        for r in drain(adapter):
            inbox.ready[r.task_id] = r
    return inbox.ready.pop(task_id)


def store(adapter: L2Adapter, items: Sequence[tuple[ObjectKey, np.ndarray]]) -> TaskResult:
    r = wait(adapter, adapter.submit_store([(k, memoryview(a)) for k, a in items]))
    assert r.kind is TaskKind.STORE
    return r


def lookup(adapter: L2Adapter, keys: Sequence[ObjectKey]) -> int:
    r = wait(adapter, adapter.submit_lookup_and_lock(keys))
    assert r.kind is TaskKind.LOOKUP and r.ok, r
    return r.value


def unlock(adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
    r = wait(adapter, adapter.submit_unlock(keys))
    assert r.kind is TaskKind.UNLOCK and r.ok and r.value is None, r


def present(adapter: L2Adapter, key: ObjectKey) -> bool:
    """Presence without leaving a pin behind."""
    n = lookup(adapter, [key])
    if n:
        unlock(adapter, [key])
    return n == 1


def load(adapter: L2Adapter, keys: Sequence[ObjectKey], dests: Sequence[np.ndarray]) -> list[bool]:
    r = wait(adapter, adapter.submit_load(keys, [memoryview(d) for d in dests]))
    assert r.kind is TaskKind.LOAD and r.ok, r
    return r.value


def adapter_threads(adapter: L2Adapter) -> list[threading.Thread]:
    prefix = f"kvdepot-l2-{adapter.name}"
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]
