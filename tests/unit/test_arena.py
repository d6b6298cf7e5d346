"""The arena's own guarantees, in one process: capacity checks, ownership locks, liveness locks, and a
prefault whose failure is reported as one. (The same guarantees across real processes and a real tmpfs
are in tests/integrity/.)"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdepot.errors import IllegalTransition
from kvdepot.client.staging import StagingPool
from kvdepot.shm import segment as arena_mod
from kvdepot.shm import (
    ArenaCapacityError,
    Prefaulter,
    PrefaultState,
    SharedArena,
    check_capacity,
    liveness_offset,
    remove_stale_segments,
)

SIZE = (1 << 20) + 4096


@pytest.fixture
def shm_dir(tmp_path):
    return str(tmp_path)


def test_capacity_check_names_the_free_space_and_the_flags(shm_dir, monkeypatch):
    monkeypatch.setattr(arena_mod, "shm_free_bytes", lambda d: 1 << 30)
    monkeypatch.setattr(arena_mod, "available_memory_bytes", lambda: 2 << 30)
    with pytest.raises(ArenaCapacityError, match=r"1\.00 GiB free.*--l1-size-gb"):
        check_capacity(3 << 29, shm_dir)
    monkeypatch.setattr(arena_mod, "shm_free_bytes", lambda d: 8 << 30)
    with pytest.raises(ArenaCapacityError, match=r"2\.00 GiB of memory.*--l1-over-memory"):
        check_capacity(3 << 30, shm_dir)
    check_capacity(3 << 30, shm_dir, allow_over_memory=True)  # the operator said so
    check_capacity(1 << 30, shm_dir)


def test_an_arena_is_reserved_and_owned_and_a_dead_ones_is_swept(shm_dir):
    a = SharedArena.create(SIZE, shm_dir=shm_dir)
    assert os.stat(a.path).st_blocks * 512 >= SIZE  # every page allocated up front
    assert remove_stale_segments(shm_dir) == []  # we hold its lock
    name = os.path.basename(a.path)
    a.buffer = np.empty(0, np.uint8)
    a.mm.close()  # (a mapping keeps the file description, and so the lock, alive)
    assert remove_stale_segments(shm_dir) == []
    os.close(a.fd)  # as if the owner died: the lock goes with its last reference
    a.fd = -1
    assert remove_stale_segments(shm_dir) == [name]


def test_the_sweep_takes_only_arenas_never_a_workers_host_cache_file(shm_dir):
    """A worker's host cache file (``kvdepot-kvcache-*``, in the server's shm directory) is held by no
    lock while the worker lives: a restarting server's sweep took it for a dead arena and deleted it,
    and the worker's cache could never be registered again (every request on it a BAD_REQUEST)."""
    for name in ("kvdepot-kvcache-4242-0123456789ab", "kvdepot-notes", "kvdepot-77-0123456789abX"):
        with open(os.path.join(shm_dir, name), "wb") as f:
            f.write(b"x" * 4096)
    dead = "kvdepot-4242-0123456789ab"  # an arena's name, and no lock on it
    with open(os.path.join(shm_dir, dead), "wb") as f:
        f.write(b"x" * 4096)
    assert remove_stale_segments(shm_dir) == [dead]
    assert sorted(os.listdir(shm_dir)) == ["kvdepot-77-0123456789abX", "kvdepot-kvcache-4242-0123456789ab", "kvdepot-notes"]


def test_liveness_lock_is_seen_while_held_and_refused_twice(shm_dir):
    owner = SharedArena.create(SIZE, shm_dir=shm_dir)
    off = liveness_offset(owner.size, b"client-1")
    assert off >= owner.size and not owner.lock_held(off)
    w1 = SharedArena.attach(owner.path, owner.size, owner.nonce)
    w1.hold_liveness_lock(off)
    assert owner.lock_held(off) and not owner.lock_held(off + 1)
    w2 = SharedArena.attach(owner.path, owner.size, owner.nonce)
    with pytest.raises(OSError, match="liveness lock"):
        w2.hold_liveness_lock(off)
    with pytest.raises(ValueError):
        w2.hold_liveness_lock(5)  # inside the data: never
    w1.close()
    assert not owner.lock_held(off)
    w2.close()
    owner.close()


def test_a_prefault_that_fails_says_failed_not_finished(shm_dir):
    a = SharedArena.create(SIZE, shm_dir=shm_dir)
    p = Prefaulter(a, step_bytes=4096)
    a.buffer = np.empty(0, np.uint8)
    a.mm.close()  # the mapping is gone: populate cannot work
    p.start()
    assert p.wait(10)
    assert p.state is PrefaultState.FAILED and not p.finished and p.error
    with pytest.raises(IllegalTransition):
        p.start()
    os.close(a.fd)
    os.unlink(a.path)


def test_a_prefault_that_works_says_done(shm_dir):
    a = SharedArena.create(SIZE, shm_dir=shm_dir)
    p = Prefaulter(a, step_bytes=1 << 18)
    p.start()
    assert p.wait(10) and p.state in (PrefaultState.DONE, PrefaultState.UNSUPPORTED)
    assert p.finished == (p.state is PrefaultState.DONE)
    a.close()


def test_staging_buffers_are_never_shared_while_held():
    pool = StagingPool(max_cached_bytes=1 << 20, max_buffers=2)
    a, b = pool.acquire(1000), pool.acquire(1000)
    assert not np.shares_memory(a, b)
    pool.release(a)
    c = pool.acquire(500)
    assert c is a  # reused once given back (the smallest that fits)
    assert not np.shares_memory(c, b)
    for buf in (b, c, pool.acquire(2000)):
        pool.release(buf)
    assert pool.cached_bytes <= 1 << 20 and len(pool._free) <= 2
    huge = pool.acquire(2 << 20)
    pool.release(huge)  # over the budget alone: not kept
    assert all(size <= 1 << 20 for size, _, _ in pool._free)
