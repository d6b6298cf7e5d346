"""The L2 adapter contract (ARCHITECTURE §6, ``storage/l2/contract.py``), run unchanged over every adapter.

Every test takes ``adapter`` (or ``make_adapter``), parametrized over memory, fs, valkey (one server and
a cluster) and s3. Keys are random per test, so server-backed adapters may share one server across
tests; counts are asserted as differences of ``usage()`` for the same reason.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvdepot.storage.l2.contract import L2Usage, TaskKind
from kvdepot.storage.l2.envelope import HEADER_BYTES, VERSION

from .helpers import (
    adapter_threads,
    drain,
    load,
    lookup,
    make_keys,
    make_payload,
    present,
    store,
    unlock,
    wait,
)

OWN_BOUND = ("memory", "fs")  # adapters whose used_bytes is exactly the sum of their envelopes


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def envelope_bytes(key: bytes, payload: np.ndarray) -> int:
    return HEADER_BYTES + len(key) + payload.nbytes


def test_store_lookup_load_round_trip(adapter, rng) -> None:
    keys = make_keys(4)
    payloads = [make_payload(rng, n) for n in (1, 4096, 5000, 65536)]
    r = store(adapter, list(zip(keys, payloads)))
    assert r.ok and r.value == [True] * 4, r

    absent = make_keys(1)[0]
    assert lookup(adapter, keys + [absent]) == 4
    assert lookup(adapter, [absent] + keys) == 0
    assert lookup(adapter, keys[:2] + [absent] + keys[2:]) == 2
    assert lookup(adapter, []) == 0
    unlock(adapter, keys)
    unlock(adapter, keys[:2])
    unlock(adapter, keys[:2])

    dests = [np.zeros_like(p) for p in payloads]
    assert load(adapter, keys, dests) == [True] * 4
    for got, want in zip(dests, payloads):
        assert np.array_equal(got, want)


def test_load_of_structured_arrays(adapter, rng) -> None:
    """Views of multi-dimensional, non-byte arrays go in and come back as the same bytes."""
    key = make_keys(1)[0]
    kv = rng.standard_normal((2, 3, 16, 64)).astype(np.float16)
    assert store(adapter, [(key, kv)]).value == [True]
    dest = np.zeros_like(kv)
    assert load(adapter, [key], [dest]) == [True]
    assert dest.tobytes() == kv.tobytes()


def test_load_of_absent_keys_is_false(adapter, rng) -> None:
    key = make_keys(1)[0]
    payload = make_payload(rng, 3000)
    store(adapter, [(key, payload)])
    absent = make_keys(2)
    dests = [np.zeros(3000, np.uint8) for _ in range(3)]
    assert load(adapter, [absent[0], key, absent[1]], dests) == [False, True, False]
    assert np.array_equal(dests[1], payload)
    assert load(adapter, [], []) == []


def test_overwrite_replaces_the_object(adapter, rng) -> None:
    key = make_keys(1)[0]
    first, second = make_payload(rng, 2048), make_payload(rng, 2048)
    store(adapter, [(key, first)])
    store(adapter, [(key, second)])
    dest = np.zeros(2048, np.uint8)
    assert load(adapter, [key], [dest]) == [True]
    assert np.array_equal(dest, second)


CORRUPT_AT = {
    "magic": lambda key, n: 0,
    "checksum": lambda key, n: HEADER_BYTES - 1,
    "key": lambda key, n: HEADER_BYTES + len(key) // 2,
    "payload_first": lambda key, n: HEADER_BYTES + len(key),
    "payload_last": lambda key, n: HEADER_BYTES + len(key) + n - 1,
}


@pytest.mark.parametrize("where", list(CORRUPT_AT))
def test_corrupt_object_is_a_counted_deleted_miss(adapter, rng, where) -> None:
    hook = getattr(adapter, "corrupt_for_test", None)
    assert hook is not None, f"{type(adapter).__name__} has no corrupt_for_test(key, offset) hook"
    keys = make_keys(2)
    payloads = [make_payload(rng, 10_000) for _ in keys]
    store(adapter, list(zip(keys, payloads)))
    before = adapter.usage()
    hook(keys[0], CORRUPT_AT[where](keys[0], 10_000))

    dests = [np.zeros(10_000, np.uint8) for _ in keys]
    assert load(adapter, keys, dests) == [False, True]  # a miss, never bytes; its neighbour is fine
    assert np.array_equal(dests[1], payloads[1])
    after = adapter.usage()
    assert after.corrupt == before.corrupt + 1
    assert after.loaded == before.loaded + 1
    assert after.healthy
    assert not present(adapter, keys[0])  # deleted
    assert after.objects == before.objects - 1

    assert load(adapter, keys[:1], dests[:1]) == [False]  # now simply absent: not counted again
    assert adapter.usage().corrupt == after.corrupt


def test_an_object_in_a_newer_format_is_a_counted_miss_left_in_place(adapter, rng) -> None:
    """Servers of two versions sharing a tier (a rolling upgrade): an object the newer one wrote was
    deleted as corrupt by every server not upgraded yet, taking it from the servers that read it."""
    if adapter.kind == "peer":
        pytest.skip("the peer tier's pages have no envelope (their directory records carry generation and checksum)")
    keys = make_keys(2)
    payloads = [make_payload(rng, 10_000) for _ in keys]
    store(adapter, list(zip(keys, payloads)))
    before = adapter.usage()
    adapter.corrupt_for_test(keys[0], 4, mask=VERSION ^ (VERSION + 1))  # the version field's low byte: the next version
    dests = [np.zeros(10_000, np.uint8) for _ in keys]
    assert load(adapter, keys, dests) == [False, True]
    assert np.array_equal(dests[1], payloads[1])
    after = adapter.usage()
    assert (after.newer_format, after.corrupt, after.healthy) == (before.newer_format + 1, before.corrupt, True)
    assert present(adapter, keys[0]), "a newer kvdepot's object was deleted"
    adapter.corrupt_for_test(keys[0], 4, mask=VERSION ^ (VERSION + 1))  # as its writer reads it: whole again
    assert load(adapter, keys[:1], dests[:1]) == [True] and np.array_equal(dests[0], payloads[0])


def test_completion_signals_the_eventfd_and_is_delivered_once(adapter, rng) -> None:
    key = make_keys(1)[0]
    poller = select.poll()
    poller.register(adapter.eventfd, select.POLLIN)
    task = adapter.submit_store([(key, memoryview(make_payload(rng, 4096)))])
    assert isinstance(task, int)
    assert poller.poll(10_000), "eventfd never became readable"
    results = drain(adapter)
    assert [(r.task_id, r.kind, r.ok, r.value) for r in results] == [(task, TaskKind.STORE, True, [True])]
    assert drain(adapter) == []
    assert poller.poll(0) == [], "eventfd still readable with nothing to deliver"


def test_submit_returns_ids_at_once_and_every_result_arrives_once(adapter, rng) -> None:
    keys = make_keys(50)
    payloads = [make_payload(rng, 1000 + 37 * i) for i in range(50)]
    ids = [adapter.submit_store([(k, memoryview(p))]) for k, p in zip(keys, payloads)]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == 50
    for task_id in reversed(ids):  # out of order: early results wait in the inbox
        r = wait(adapter, task_id)
        assert (r.task_id, r.kind, r.ok, r.value) == (task_id, TaskKind.STORE, True, [True])
    assert drain(adapter) == []
    assert lookup(adapter, keys) == 50
    unlock(adapter, keys)


def test_usage_reports_objects_and_bytes(adapter, rng) -> None:
    before = adapter.usage()
    assert isinstance(before, L2Usage)
    assert (before.name, before.kind, before.healthy) == (adapter.name, adapter.kind, True)
    keys = make_keys(6)
    payloads = [make_payload(rng, 3000 * (i + 1)) for i in range(6)]
    store(adapter, list(zip(keys, payloads)))
    mid = adapter.usage()
    assert mid.objects - before.objects == 6
    assert mid.stored - before.stored == 6
    payload_bytes = sum(p.nbytes for p in payloads)
    assert mid.used_bytes - before.used_bytes >= payload_bytes
    if adapter.kind in OWN_BOUND:
        envelopes = sum(envelope_bytes(k, p) for k, p in zip(keys, payloads))
        assert mid.used_bytes - before.used_bytes == envelopes
        assert mid.capacity_bytes > 0
    dests = [np.zeros_like(p) for p in payloads]
    assert load(adapter, keys, dests) == [True] * 6
    after = adapter.usage()
    assert after.loaded - mid.loaded == 6
    assert (after.corrupt, after.failures) == (before.corrupt, before.failures)


def test_many_objects_with_tasks_in_flight_are_bit_exact(adapter, rng) -> None:
    n, batch = 160, 16
    keys = make_keys(n)
    payloads = [make_payload(rng, int(s)) for s in rng.integers(1, 40_000, size=n)]
    store_ids = [
        adapter.submit_store([(k, memoryview(p)) for k, p in zip(keys[i : i + batch], payloads[i : i + batch])])
        for i in range(0, n, batch)
    ]
    for task_id in store_ids:
        r = wait(adapter, task_id)
        assert r.ok and r.value == [True] * batch, r
    assert lookup(adapter, keys) == n
    dests = [np.zeros_like(p) for p in payloads]
    load_ids = [
        adapter.submit_load(keys[i : i + batch], [memoryview(d) for d in dests[i : i + batch]])
        for i in range(0, n, batch)
    ]
    for task_id in load_ids:
        r = wait(adapter, task_id)
        assert r.ok and r.value == [True] * batch, r
    unlock(adapter, keys)
    for i, (got, want) in enumerate(zip(dests, payloads)):
        assert np.array_equal(got, want), f"object {i} differs"


def test_lookup_pins_and_unlock_releases(adapter, rng) -> None:
    keys = make_keys(3)
    store(adapter, [(k, make_payload(rng, 100)) for k in keys[:2]])
    assert lookup(adapter, keys) == 2  # only the leading present keys are pinned
    assert lookup(adapter, keys[:1]) == 1
    assert [adapter.is_pinned(k) for k in keys] == [True, True, False]
    unlock(adapter, keys[:2])
    assert [adapter.is_pinned(k) for k in keys] == [True, False, False]  # the second pin on keys[0] holds
    unlock(adapter, keys[:1])
    assert not any(adapter.is_pinned(k) for k in keys)
    unlock(adapter, keys)  # unlocking what is not locked is harmless
    assert not any(adapter.is_pinned(k) for k in keys)


# Only tiers with a size bound of their own run the size-bound tests: valkey and s3 are bounded by
# their backend's policy (maxmemory, bucket quotas), which kvdepot does not set; they are not generated
# for those kinds at all rather than skipped.
bounded_kinds = pytest.mark.parametrize("kind", sorted(OWN_BOUND))


def _bounded(make_adapter, objects: int, payload: int, key_len: int):
    """A started adapter that holds exactly ``objects`` envelopes of ``payload`` bytes."""
    envelope = HEADER_BYTES + key_len + payload
    adapter = make_adapter(capacity_bytes=objects * envelope)
    adapter.start()
    assert adapter.usage().capacity_bytes == objects * envelope
    return adapter


@bounded_kinds
def test_size_bound_evicts_oldest_unpinned_and_never_pinned(make_adapter, rng) -> None:
    size = 4000
    keys = make_keys(7)
    adapter = _bounded(make_adapter, 4, size, len(keys[0]))
    payloads = {k: make_payload(rng, size) for k in keys}
    for k in keys[:4]:  # one task each: a known write order
        assert store(adapter, [(k, payloads[k])]).value == [True]
    k0, k1, k2, k3, k4, k5, k6 = keys
    assert lookup(adapter, [k0]) == 1  # pinned: must survive although oldest
    assert load(adapter, [k1], [np.zeros(size, np.uint8)]) == [True]  # touched: now newest

    store(adapter, [(k4, payloads[k4])])
    assert [present(adapter, k) for k in keys[:5]] == [True, True, False, True, True]
    store(adapter, [(k5, payloads[k5])])
    assert [present(adapter, k) for k in keys[:6]] == [True, True, False, False, True, True]
    usage = adapter.usage()
    assert (usage.objects, usage.used_bytes) == (4, usage.capacity_bytes)

    unlock(adapter, [k0])  # unpinned: it is the oldest again, so it goes next
    store(adapter, [(k6, payloads[k6])])
    assert [present(adapter, k) for k in keys] == [False, True, False, False, True, True, True]
    for k in (k1, k4, k5, k6):
        dest = np.zeros(size, np.uint8)
        assert load(adapter, [k], [dest]) == [True]
        assert np.array_equal(dest, payloads[k])


@bounded_kinds
def test_store_that_cannot_fit_fails_and_shows_nothing(make_adapter, rng) -> None:
    size = 4000
    keys = make_keys(3)
    adapter = _bounded(make_adapter, 2, size, len(keys[0]))
    store(adapter, [(k, make_payload(rng, size)) for k in keys[:2]])
    assert lookup(adapter, keys[:2]) == 2  # everything pinned: nothing may be evicted
    before = adapter.usage()
    r = store(adapter, [(keys[2], make_payload(rng, size))])
    # The object is refused, the tier is not broken: the task succeeds, reporting that key unstored.
    assert r.ok and r.value == [False], r
    after = adapter.usage()
    assert after.healthy and after.failures == before.failures
    assert (after.objects, after.used_bytes) == (before.objects, before.used_bytes)
    assert after.stored == before.stored
    assert all(adapter.is_pinned(k) for k in keys[:2])


@bounded_kinds
def test_store_larger_than_the_tier_fails(make_adapter, rng) -> None:
    keys = make_keys(1)
    adapter = _bounded(make_adapter, 1, 4000, len(keys[0]))
    r = store(adapter, [(keys[0], make_payload(rng, 4001))])
    assert r.ok and r.value == [False], r
    assert adapter.usage().objects == 0
    assert adapter.usage().healthy  # one oversized object does not take the tier down
    other = make_keys(2)[1]
    assert store(adapter, [(other, make_payload(rng, 1000))]).value == [True]


def test_constructor_starts_no_thread(make_adapter) -> None:
    before = set(threading.enumerate())
    adapter = make_adapter()
    assert set(threading.enumerate()) == before
    assert adapter_threads(adapter) == []


def test_close_leaves_no_thread_behind(make_adapter, rng) -> None:
    adapter = make_adapter()
    before = set(threading.enumerate())
    adapter.start()
    keys = make_keys(8)
    ids = [adapter.submit_store([(k, memoryview(make_payload(rng, 2048)))]) for k in keys]
    wait(adapter, ids[0])
    adapter.close()
    assert adapter_threads(adapter) == []
    assert set(threading.enumerate()) <= before


def test_clear_removes_everything_of_this_tier_and_nothing_else(make_adapter, rng) -> None:
    """Two tiers on the same backend (another prefix or directory): clearing one leaves the other's
    objects whole, and the cleared one stores again afterwards."""
    mine, other = make_adapter(), make_adapter()
    mine.start()
    other.start()
    keys, other_keys = make_keys(5), make_keys(3)
    payloads = [make_payload(rng, 3000 + i) for i in range(5)]
    assert store(mine, list(zip(keys, payloads))).value == [True] * 5
    assert store(other, [(k, make_payload(rng, 100)) for k in other_keys]).value == [True] * 3
    r = wait(mine, mine.submit_clear())
    assert r.kind is TaskKind.CLEAR and r.ok and r.value == 5, r
    assert not any(present(mine, k) for k in keys)
    assert all(present(other, k) for k in other_keys)
    if mine.usage().objects or mine.kind in OWN_BOUND:
        assert mine.usage().objects == 0
    assert store(mine, [(keys[0], payloads[0])]).value == [True]
    dest = np.zeros_like(payloads[0])
    assert load(mine, [keys[0]], [dest]) == [True] and np.array_equal(dest, payloads[0])


def test_delete_removes_the_named_objects_and_says_how_many_were_there(adapter, rng) -> None:
    keys = make_keys(4)
    payloads = [make_payload(rng, 2000 + i) for i in range(4)]
    assert store(adapter, list(zip(keys, payloads))).value == [True] * 4
    absent = make_keys(1)[0]
    r = wait(adapter, adapter.submit_delete([keys[1], keys[3], absent]))
    assert r.kind is TaskKind.DELETE and r.ok and r.value == 2, r
    assert [present(adapter, k) for k in keys] == [True, False, True, False]
    assert wait(adapter, adapter.submit_delete([keys[1]])).value == 0  # gone already: not an error
    dest = np.zeros_like(payloads[0])
    assert load(adapter, [keys[0]], [dest]) == [True] and np.array_equal(dest, payloads[0])


def _started_local_tier(kind: str, tmp_path):
    """A small memory or fs tier with two workers (a held write leaves one free), started."""
    from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
    from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig

    if kind == "memory":
        tier = MemoryAdapter("m", MemoryConfig(size_gb=0.01, workers=2))
    else:
        tier = FsAdapter("f", FsConfig(path=str(tmp_path / "fs"), size_gb=0.01, workers=2))
    tier.start()
    return tier


def _hold_puts(tier) -> tuple[threading.Event, threading.Semaphore, Callable[[], None]]:
    """From now on every put of ``tier`` waits for ``gate`` (set it to let them through); ``entered`` is
    released once per put that reached the gate; ``restore`` puts the real put back."""
    gate, entered = threading.Event(), threading.Semaphore(0)
    real_put = tier._put

    def held_put(key, payload):
        entered.release()
        assert gate.wait(10)
        return real_put(key, payload)

    tier._put = held_put
    return gate, entered, lambda: setattr(tier, "_put", real_put)


@pytest.mark.parametrize("local_kind", ["memory", "fs"])
@pytest.mark.parametrize("when", ["before_the_write", "during_the_write"])
@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_delete_or_clear_after_a_store_was_submitted_is_not_undone_by_its_write(local_kind, when, how, tmp_path, rng) -> None:
    """An operator's DELETE of a prefix (or a tier clear) while the store controller's push of it is in
    flight: the delete found nothing yet, the write landed after it, and the deleted KV came back for
    every later lookup. Now the write does not happen, or deletes itself when it ends."""
    import time

    tier = _started_local_tier(local_kind, tmp_path)
    try:
        keys = make_keys(3)
        items = [(k, make_payload(rng, 4096)) for k in keys]
        gate, inside, restore = _hold_puts(tier)
        if when == "before_the_write":  # the pool's workers are busy: the store waits its turn
            blockers = [tier.submit_store([(k, make_payload(rng, 64))]) for k in make_keys(2)]
            assert inside.acquire(timeout=10)
            stored = tier.submit_store([(k, memoryview(p)) for k, p in items])
        else:
            stored = tier.submit_store([(k, memoryview(p)) for k, p in items])
            assert inside.acquire(timeout=10)  # its first write is under way
        end = tier.submit_delete(keys) if how == "delete" else tier.submit_clear()
        time.sleep(0.2)
        gate.set()
        wait(tier, end)
        r = wait(tier, stored)
        if when == "during_the_write":
            assert r.value == [False] * 3, r  # not stored: the first write deleted itself, the rest skipped
        assert [present(tier, k) for k in keys] == [False] * 3, "a deleted object came back with a write in flight"
        if when == "before_the_write":
            for b in blockers:
                wait(tier, b)
        restore()  # and the tier works on
        assert store(tier, items[:1]).value == [True] and present(tier, keys[0])
    finally:
        tier.close()


@pytest.mark.parametrize("local_kind", ["memory", "fs"])
def test_a_store_refused_for_room_leaves_the_copy_of_its_key_that_was_there(local_kind, tmp_path, rng) -> None:
    """A key stored again where only pinned objects could make room: the memory tier took the old copy
    out before it found no room, so a refused store lost the key (and announced no removal)."""
    tier = _started_local_tier(local_kind, tmp_path)
    try:
        a, b = make_keys(2)
        old = make_payload(rng, 4 << 20)
        assert store(tier, [(a, old), (b, make_payload(rng, 4 << 20))]).value == [True, True]
        assert lookup(tier, [b]) == 1  # b pinned: only a could make room, and a is the key stored again
        assert store(tier, [(a, make_payload(rng, 7 << 20))]).value == [False]
        unlock(tier, [b])
        dest = np.zeros_like(old)
        assert load(tier, [a], [dest]) == [True] and np.array_equal(dest, old), "the refused store lost the copy there"
    finally:
        tier.close()


@pytest.mark.parametrize("local_kind", ["memory", "fs"])
@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_delete_during_a_write_whose_reply_was_lost_still_removes_the_object(local_kind, how, tmp_path, rng) -> None:
    """A write that lands but fails on the way back (the reply to a Valkey commit lost to a reset, an
    S3 PUT whose answer timed out): the delete submitted meanwhile found nothing, and the failed store
    skipped the check that undoes a write a delete has voided, so the deleted object was back."""
    tier = _started_local_tier(local_kind, tmp_path)
    try:
        key, payload = make_keys(1)[0], make_payload(rng, 4096)
        gate, inside = threading.Event(), threading.Event()
        real_put = tier._put

        def put_then_lose_the_reply(k, data):
            inside.set()
            assert gate.wait(10)
            real_put(k, data)
            raise ConnectionError("connection reset by peer (reading the reply)")

        tier._put = put_then_lose_the_reply
        stored = tier.submit_store([(key, memoryview(payload))])
        assert inside.wait(10)
        end = tier.submit_delete([key]) if how == "delete" else tier.submit_clear()
        assert wait(tier, end).ok  # nothing there yet
        gate.set()
        assert wait(tier, stored).value == [False]
        tier._put = real_put
        # Asked of the backend itself: the failed write took the tier down for the tasks until it recovers.
        assert tier._contains([key]) == [False], "the deleted object is back (its failed write was not undone)"
    finally:
        tier.close()


@pytest.mark.parametrize("local_kind", ["memory", "fs"])
def test_a_store_submitted_after_a_delete_lands_though_an_earlier_write_is_still_in_flight(local_kind, tmp_path, rng) -> None:
    """The delete guard is per write, not per key: an engine that stores a key again after an operator
    deleted it gets it stored, although the push from before the delete (a slow S3 put) is still running.
    The old write deletes itself and the new one lands; a load never gets the deleted bytes."""
    tier = _started_local_tier(local_kind, tmp_path)
    try:
        keys = make_keys(3)
        old = [make_payload(rng, 4096) for _ in keys]
        new = [make_payload(rng, 4096) for _ in keys]
        gates = {"old": threading.Event(), "new": threading.Event()}
        inside = {"old": threading.Event(), "new": threading.Event()}
        which = {bytes(p[:64]): "old" for p in old} | {bytes(p[:64]): "new" for p in new}
        real_put = tier._put

        def held_put(key, payload):
            side = which[bytes(payload[:64])]
            inside[side].set()
            assert gates[side].wait(10)
            return real_put(key, payload)

        tier._put = held_put
        before = tier.submit_store([(k, memoryview(p)) for k, p in zip(keys, old)])
        assert inside["old"].wait(10)  # the push from before the delete is writing its first object
        assert wait(tier, tier.submit_delete(keys)).ok
        again = tier.submit_store([(k, memoryview(p)) for k, p in zip(keys, new)])
        assert inside["new"].wait(10), "the store submitted after the delete was skipped (the key stayed void)"
        gates["old"].set()
        assert wait(tier, before).value == [False] * 3  # voided: its first write deleted itself
        gates["new"].set()
        assert wait(tier, again).value == [True] * 3, "the store submitted after the delete was skipped"
        for key, payload in zip(keys, new):
            dest = np.zeros_like(payload)
            assert load(tier, [key], [dest]) == [True] and np.array_equal(dest, payload)
    finally:
        tier.close()


@pytest.mark.parametrize("local_kind", ["memory", "fs"])
@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_store_submitted_after_a_delete_or_clear_that_has_not_run_yet_lands(local_kind, how, tmp_path, rng) -> None:
    """The delete's cutoff is its submission, not its run: an engine stores a key after the operator's
    DELETE was accepted but while the tier's workers were still busy, so the delete runs later. That
    store was voided (the delete took its stamp when it ran), or landed and was deleted: a miss in L2
    until stored again. Now it lands, whatever order the two tasks run in."""
    tier = _started_local_tier(local_kind, tmp_path)
    try:
        keys = make_keys(3)
        new = [make_payload(rng, 4096) for _ in keys]
        gate, inside, restore = _hold_puts(tier)
        blockers = [tier.submit_store([(k, make_payload(rng, 64))]) for k in make_keys(2)]  # both workers
        assert inside.acquire(timeout=10) and inside.acquire(timeout=10)  # no worker is free: the delete waits
        end = tier.submit_delete(keys) if how == "delete" else tier.submit_clear()
        again = tier.submit_store([(k, memoryview(p)) for k, p in zip(keys, new)])
        restore()
        gate.set()
        assert wait(tier, end).ok
        assert wait(tier, again).value == [True] * 3, "the store submitted after the delete was voided"
        assert [present(tier, k) for k in keys] == [True] * 3, "the delete removed a store submitted after it"
        for key, payload in zip(keys, new):
            dest = np.zeros_like(payload)
            assert load(tier, [key], [dest]) == [True] and np.array_equal(dest, payload)
        for b in blockers:
            wait(tier, b)
    finally:
        tier.close()
