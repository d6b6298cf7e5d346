"""The server-driven path's parts that need no server (server/modules/blocks.py): a registered cache's
state machine, and ``CopyWatcher``: a copy's finish (its locks' release) runs once the copy is done, in
any order, and a copy that never ends holds up nobody else's finish."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvdepot.errors import IllegalTransition, UnknownKVCache
from kvdepot.gpu.mover import DuplexMover
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.server.modules.blocks import CacheState, CopyWatcher, RegisteredCache
from kvdepot.types import ClientId


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
