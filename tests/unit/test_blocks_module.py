"""The server-driven path's parts that need no server (server/modules/blocks.py): a registered cache's
state machine, and ``CopyWatcher``: a copy's finish (its locks' release) runs once the copy is done, in
any order, and a copy that never ends holds up nobody else's finish. With the module's collaborators
faked: a store whose copy raises part way keeps its slots reserved until what it queued has landed, and
a retrieve past its deadline writes no further block and frees its locks.

On the CPU a mover's copies are synchronous, so "what it queued" is faked here (``Copy``); on a GPU the
mover's ``settled`` and a load stopped at its deadline run in tests/gpu/test_cuda_paths.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvdepot.errors import IllegalTransition, KVDepotTimeout, UnknownKVCache
from kvdepot.gpu.mover import DuplexMover
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.server.modules import blocks
from kvdepot.server.modules.blocks import BlockTransferModule, CacheState, CopyWatcher, RegisteredCache
from kvdepot.storage.l1 import ReadLock
from kvdepot.types import ClientId, LeaseId


class Memory:
    """A registered memory that records being let go (the interface OpenedMemory has: device_index, close)."""

    device_index = None

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def registered() -> tuple[RegisteredCache, Memory]:
    cache = DevicePagedCache([torch.zeros(2, 4, 4, 1, 8) for _ in range(2)], "kv_first", 4)
    mem = Memory()
    return RegisteredCache(1, ClientId(b"c"), 1, [mem], cache, DuplexMover(cache, 1, 1 << 20), [], "host_file"), mem


def test_a_registered_cache_closes_after_its_last_copy_and_refuses_new_ones():
    rc, mem = registered()
    rc.begin()
    rc.begin()
    rc.close()  # OPEN -> CLOSING: two copies still run
    assert rc.state is CacheState.CLOSING and mem.closed == 0
    with pytest.raises(UnknownKVCache, match="closing"):
        rc.begin()
    rc.end()
    assert rc.state is CacheState.CLOSING and mem.closed == 0
    rc.end()  # the last one: CLOSED, its memory let go once
    assert rc.state is CacheState.CLOSED and mem.closed == 1 and rc.mover.cache.views == []
    rc.close()
    assert mem.closed == 1
    with pytest.raises(IllegalTransition):
        rc.end()
    with pytest.raises(UnknownKVCache, match="closed"):
        rc.begin()


def test_an_idle_cache_closes_at_once():
    rc, mem = registered()
    rc.close()
    assert rc.state is CacheState.CLOSED and mem.closed == 1


class Copy:
    """A completion whose end the test decides (the interface ``Completion`` has: done, wait)."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ended.wait(timeout_s)


def test_finishes_run_when_their_copies_end_and_a_stuck_one_blocks_nobody():
    watcher = CopyWatcher()
    finished: list[str] = []
    stuck, quick, done_now = Copy(), Copy(), Copy()
    done_now.ended.set()
    watcher.after(stuck, lambda: finished.append("stuck"))
    watcher.after(quick, lambda: finished.append("quick"))
    watcher.after(done_now, lambda: finished.append("done now"))
    assert finished == ["done now"]  # already over: finished at once, on the caller's thread
    quick.ended.set()
    deadline = time.monotonic() + 5
    while finished != ["done now", "quick"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert finished == ["done now", "quick"]  # the stuck copy, handed over first, did not hold it up
    threading.Timer(0.2, stuck.ended.set).start()
    watcher.close()  # waits for every copy still running before it returns
    assert finished == ["done now", "quick", "stuck"]


CHUNK_BYTES = 2 * 2 * 4 * 1 * 8 * 4  # a chunk of registered(): [K=2, L=2, T=4, H=1, D=8] float32, one block


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert condition()


class Storage:
    """The storage calls a store's copy makes: an abort of its reservation."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, lease, owner) -> None:
        self.aborted.append(lease)


def module_for(rc: RegisteredCache) -> BlockTransferModule:
    """The module with only what a store's copy and a retrieve touch: its caches, watcher and arena."""
    module = BlockTransferModule.__new__(BlockTransferModule)
    module.storage = Storage()
    module._caches, module._caches_lock = {rc.id: rc}, threading.Lock()
    module._watcher = CopyWatcher()
    module._arena = torch.ones(4 * CHUNK_BYTES, dtype=torch.uint8)
    return module


def test_a_store_whose_copy_raises_part_way_frees_its_slots_once_its_queued_copies_land(monkeypatch):
    """A save that raised after queueing some of its DMA into the reserved slots: aborting them at once
    would hand them to another writer while that DMA still lands."""
    rc, _ = registered()
    module = module_for(rc)
    queued = Copy()

    def save(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(rc.mover, "save", save)
    monkeypatch.setattr(rc.mover.saver, "settled", lambda: queued, raising=False)
    call = SimpleNamespace(client=ClientId(b"c"), body=SimpleNamespace(ready_event=b""), deadline=time.monotonic() + 30)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        module._copy_out(call, rc, rc.cache.check_ids([[0, 1]], 2), [0, 1], [0, CHUNK_BYTES], CHUNK_BYTES, 7)
    time.sleep(0.05)
    assert module.storage.aborted == [] and rc.busy == 1  # reserved while the queued copies may land
    queued.ended.set()
    wait_for(lambda: module.storage.aborted == [7] and rc.busy == 0)
    module._watcher.close()


def test_a_store_refused_before_any_copy_aborts_at_once(monkeypatch):
    rc, _ = registered()
    module = module_for(rc)
    monkeypatch.setattr(rc.mover.saver, "settled", lambda: pytest.fail("nothing was queued to wait for"), raising=False)
    call = SimpleNamespace(client=ClientId(b"c"), body=SimpleNamespace(ready_event=b"\x01" * 64), deadline=time.monotonic() + 30)
    with pytest.raises(Exception, match="host-memory cache takes no CUDA events"):
        module._copy_out(call, rc, rc.cache.check_ids([[0]], 1), [0], [0], CHUNK_BYTES, 8)
    assert module.storage.aborted == [8] and rc.busy == 0


def test_a_retrieve_past_its_deadline_writes_no_further_block_and_frees_its_locks(monkeypatch):
    """The worker gave up on the load at its deadline (its blocks are recomputed, or handed to another
    request): the server stops before the next chunk rather than scatter into them."""
    rc, _ = registered()
    module = module_for(rc)
    context = SimpleNamespace(id=1, chunk_bytes=CHUNK_BYTES, spec=SimpleNamespace(model="m"))
    released: list[int] = []
    module.ctx = SimpleNamespace(
        release_quietly=lambda lease, owner: released.append(lease),
        metrics=SimpleNamespace(retrieved=lambda *args: None),
        chunk_request_done=lambda *args: None,
    )
    monkeypatch.setattr(blocks, "context_and_keys", lambda ctx, call: (context, ["k0", "k1", "k2"]))
    offsets = [0, CHUNK_BYTES, 2 * CHUNK_BYTES]
    monkeypatch.setattr(blocks, "lock_for_retrieve", lambda ctx, call, toucher: (context, ReadLock(LeaseId(9), offsets, CHUNK_BYTES)))
    monkeypatch.setattr(blocks, "count_short_retrieve", lambda *args: None)
    scatter, scattered = rc.cache.scatter, []

    def slow_scatter(*args, **kwargs):  # the first chunk's copy outlasts the call's deadline
        scatter(*args, **kwargs)
        scattered.append(True)
        if len(scattered) == 1:
            time.sleep(1.2)

    monkeypatch.setattr(rc.cache, "scatter", slow_scatter)
    body = SimpleNamespace(cache_id=1, keys=["k0", "k1", "k2"], start=0, limit=0, block_ids=[[0, 1, 2]], skip_first_n_tokens=0, ready_event=b"")
    call = SimpleNamespace(client=ClientId(b"c"), body=body, deadline=time.monotonic() + 1.0)
    with pytest.raises(KVDepotTimeout, match="after 1 of its 3 chunks"):
        module.retrieve(call)
    layers = rc.cache.views
    assert all(bool(t[:, 0].bool().all()) and not t[:, 1:3].any() for t in layers), "only the first block is written"
    wait_for(lambda: released == [9] and rc.busy == 0)
    module._watcher.close()
