"""A GPU store whose worker's ready event never fires must not hold the server's BLOCKING workers: its
wait is bounded by its deadline and a cap well under the old 120 s, and the stores after it on the same
cache (which would queue behind it on the cache's save stream) are refused at once, holding no worker,
until its copy ends. Neither it nor they are a turn of the agent session they name (they stored
nothing). The mover's copy is faked (``Stuck``): on a CPU a save is done at once, and a
host-memory cache takes no CUDA event."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvdepot.errors import KVDepotTimeout
from kvdepot.gpu.mover import DuplexMover
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.server.modules import blocks
from kvdepot.server.modules.blocks import BlockTransferModule, CopyWatcher, RegisteredCache
from kvdepot.types import ClientId, SlotStatus

CHUNK_BYTES = 2 * 2 * 4 * 1 * 8 * 4  # [K=2, L=2, T=4, H=1, D=8] float32, one block a chunk


class Stuck:
    """A copy whose ready event fires only when the test says; ``wait`` records the patience it was given
    and answers at once (the test checks the bound, never how long anything took)."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.patience: list[float] = []

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        self.patience.append(math.inf if timeout_s is None else timeout_s)
        return self.ended.is_set()


class Storage:
    """What a store asks of storage: every chunk gets a slot (lease 1, 2, ...), and what was aborted,
    committed and which agent-session turns were taken is recorded."""

    def __init__(self) -> None:
        self.aborted: list[int] = []
        self.committed: list[int] = []
        self.turns: list[str] = []
        self._leases = iter(range(1, 1000))

    def reserve(self, keys, size, owner, salt, protect=(), toucher=None):
        statuses = [SlotStatus.ALLOCATED] * len(keys)
        return SimpleNamespace(lease_id=next(self._leases), statuses=statuses, offsets=[i * size for i in range(len(keys))])

    def commit(self, lease, owner) -> int:
        self.committed.append(lease)
        return 1

    def abort(self, lease, owner) -> None:
        self.aborted.append(lease)

    def touch_agent_session(self, salt, name, keys) -> None:
        self.turns.append(name)


def setup() -> tuple[BlockTransferModule, RegisteredCache]:
    cache = DevicePagedCache([torch.zeros(2, 4, 4, 1, 8) for _ in range(2)], "kv_first", 4)
    rc = RegisteredCache(1, ClientId(b"c"), 1, [SimpleNamespace(device_index=None, close=lambda: None)], cache,
                         DuplexMover(cache, 1, 1 << 20), [], "host_file")  # fmt: skip
    module = BlockTransferModule.__new__(BlockTransferModule)
    module.storage = Storage()
    module._caches, module._caches_lock = {rc.id: rc}, threading.Lock()
    module._watcher = CopyWatcher()
    module._arena = torch.ones(4 * CHUNK_BYTES, dtype=torch.uint8)
    return module, rc


def test_a_store_whose_ready_event_never_fires_is_bounded_and_the_stores_behind_it_wait_for_nothing(monkeypatch):
    module, rc = setup()
    stuck = Stuck()
    saves: list[int] = []

    def save(*args, **kwargs):
        saves.append(1)
        return stuck

    monkeypatch.setattr(rc.mover, "save", save)
    no_deadline = SimpleNamespace(client=ClientId(b"c"), body=SimpleNamespace(ready_event=b""), deadline=math.inf)

    def store(lease: int) -> None:
        module._copy_out(no_deadline, rc, rc.cache.check_ids([[0]], 1), [0], [0], CHUNK_BYTES, lease)

    with pytest.raises(KVDepotTimeout, match="ready event"):
        store(1)
    assert stuck.patience == [blocks.STORE_PATIENCE_S] and blocks.STORE_PATIENCE_S <= 10.0  # not 120 s of a worker
    assert module.storage.aborted == [] and rc.busy == 1  # its slots stay reserved while its copy may land
    for lease in (2, 3):  # they would queue behind it: refused at once, no save, no wait
        with pytest.raises(KVDepotTimeout, match="still waiting for its ready event"):
            store(lease)
    assert (len(saves), len(stuck.patience), module.storage.aborted, rc.busy) == (1, 1, [2, 3], 1)

    stuck.ended.set()  # the event fires at last: its reservation goes, and stores are let in again
    deadline = time.monotonic() + 5
    while (module.storage.aborted, rc.busy) != ([2, 3, 1], 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (module.storage.aborted, rc.busy, rc.stalled) == ([2, 3, 1], 0, None)
    store(4)
    assert (len(saves), module.storage.aborted, rc.busy) == (2, [2, 3, 1], 0)
    module._watcher.close()


def test_a_store_waits_no_longer_than_its_own_deadline(monkeypatch):
    module, rc = setup()
    stuck = Stuck()
    stuck.ended.set()
    monkeypatch.setattr(rc.mover, "save", lambda *a, **k: stuck)
    call = SimpleNamespace(client=ClientId(b"c"), body=SimpleNamespace(ready_event=b""), deadline=time.monotonic() + 3.0)
    module._copy_out(call, rc, rc.cache.check_ids([[0]], 1), [0], [0], CHUNK_BYTES, 1)
    assert len(stuck.patience) == 1 and stuck.patience[0] <= 3.0
    module._watcher.close()


def module_with_context(monkeypatch, stuck: Stuck) -> tuple[BlockTransferModule, RegisteredCache]:
    """``setup()`` with what ``store`` reads beyond the copy: the caller's context (id 1, the cache's) and
    the server's bookkeeping, which records nothing here; every save is ``stuck``."""
    module, rc = setup()
    context = SimpleNamespace(id=1, chunk_bytes=CHUNK_BYTES, spec=SimpleNamespace(model="m"), keys=lambda hashes, salt: list(hashes))
    module.ctx = SimpleNamespace(
        storage=module.storage, digest_size=16, context_of=lambda context_id, client: context, chunk_tokens=lambda *a: None,
        abort_quietly=module.storage.abort, metrics=SimpleNamespace(stored=lambda *a: None), chunk_request_done=lambda *a: None,
    )  # fmt: skip
    monkeypatch.setattr(rc.mover, "save", lambda *a, **k: stuck)
    return module, rc


def store_call(session: str) -> SimpleNamespace:
    body = SimpleNamespace(context_id=1, cache_id=1, keys=[b"h" * 16], first=0, block_ids=[[0]], ready_event=b"", token_ids=[],
                           cache_salt="", agent_session=session)  # fmt: skip
    return SimpleNamespace(client=ClientId(b"c"), body=body, deadline=math.inf)


def test_a_store_that_timed_out_on_its_ready_event_is_no_agent_session_turn(monkeypatch):
    """It reserved its slots, then its copy never ended: it stored nothing, so, like a refused store, it
    neither opens nor renews the session it names (it used to, having been counted at its reservation).
    Nor does a store refused behind it; a store whose copy ends is a turn, as before."""
    stuck = Stuck()
    module, rc = module_with_context(monkeypatch, stuck)
    with pytest.raises(KVDepotTimeout, match="ready event"):
        module.store(store_call("conv"))
    assert (module.storage.turns, module.storage.committed) == ([], [])
    with pytest.raises(KVDepotTimeout, match="still waiting for its ready event"):  # refused behind it
        module.store(store_call("conv"))
    assert (module.storage.turns, module.storage.committed, module.storage.aborted) == ([], [], [2])

    stuck.ended.set()  # the copy ends at last: its slots go, and a store is let in again
    deadline = time.monotonic() + 5
    while (module.storage.aborted, rc.busy) != ([2, 1], 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (module.storage.aborted, rc.busy, rc.stalled) == ([2, 1], 0, None)
    reply = module.store(store_call("conv"))
    assert reply.body.statuses == [int(SlotStatus.ALLOCATED)]
    assert (module.storage.turns, module.storage.committed) == (["conv"], [3])
    module._watcher.close()
