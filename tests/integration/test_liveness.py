"""Leases end when their holder dies, goes silent, or runs past the TTL (ARCHITECTURE.md §5): a crashed
writer's space comes back and the same tokens can be stored; a crashed reader never pins memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot.errors import ErrorCode, LeaseExpired
from kvdepot.protocol import messages as m
from kvdepot.types import SlotStatus

from support.servers import CHUNK, LAYOUT, MODEL, assert_bytes_equal, make_kv, make_tokens, wait_until

WORKER = Path(__file__).with_name("_worker.py")

# Only one mechanism may free the lease in each scenario: the others are set far out of reach.
CLIENT_TIMEOUT_S = 1.0  # the heartbeat servers' --client-timeout-s
SERVER_ARGS = {
    "pidfd": ["--client-timeout-s", "600", "--lease-ttl-s", "600"],
    "heartbeat": ["--client-timeout-s", str(CLIENT_TIMEOUT_S), "--heartbeat-interval-s", "0.2", "--lease-ttl-s", "600"],
}


class Worker:
    def __init__(self, url: str, mode: str, tokens, pid0: bool, log_path: Path) -> None:
        args = {
            "url": url,
            "mode": mode,
            "tokens": [int(t) for t in tokens],
            "pid0": pid0,
            "layout": [LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim],
            "model": MODEL,
        }
        self.stderr = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(args)], stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )

    def wait_ready(self) -> dict:
        line = self.proc.stdout.readline()  # the worker prints exactly one line, then blocks
        if not line:
            self.proc.wait(10)
            pytest.fail(f"worker exited ({self.proc.returncode}) before it was ready; see {self.stderr.name}")
        return json.loads(line)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(10) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
        self.stderr.close()


@pytest.fixture
def spawn(tmp_path):
    workers: list[Worker] = []

    def start(url, mode, tokens, pid0=False) -> Worker:
        w = Worker(url, mode, tokens, pid0, tmp_path / f"worker{len(workers)}.log")
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


@pytest.mark.parametrize("how", ["pidfd", "heartbeat"])
@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
def test_killed_writer_gives_its_space_back(make_server, spawn, how, endpoint, seed):
    srv = make_server(*SERVER_ARGS[how])
    url = srv.url if endpoint == "tcp" else srv.ipc_url
    n = 6
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)

    worker = spawn(url, "store", tokens, pid0=(how == "heartbeat"))
    info = worker.wait_ready()
    assert info == {"ready": True, "transport": "shm", "slots": n}
    during = srv.status()
    assert during["leases"] == 1
    assert during["l1"]["writing"] == n
    assert during["l1"]["used_bytes"] == n * LAYOUT.chunk_bytes(CHUNK)
    assert during["contexts"] == 1

    worker.kill()
    wait_until(lambda: srv.status()["leases"] == 0, what=f"the dead writer's lease to end ({how})")
    after = srv.status()
    assert after["l1"]["objects"] == 0
    assert after["l1"]["used_bytes"] == 0
    assert after["contexts"] == 0, "the dead client's context must be dropped"
    if how == "pidfd":  # the server saw the process exit (without a pidfd it can only declare it gone)
        # (counted just after the leases end, on the server's loop thread: the last count to move is waited for)
        wait_until(lambda: srv.metric("kvdepot_leases_ended_client_gone_total", how="exited") >= 1, what="the dead writer counted as gone")
        assert srv.metric("kvdepot_clients_gone_total", how="exited") == 1
        assert srv.metric("kvdepot_leases_ended_client_gone_total", how="exited") == 1

    with srv.client(url) as c:
        assert c.lookup(tokens) == 0  # the zeros it wrote never became visible
        with c.prepare_store(tokens) as slots:
            assert slots.statuses == [SlotStatus.ALLOCATED] * n
            for i, slot in enumerate(slots):
                slot[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup(tokens) == n * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv)
    assert srv.status()["leases"] == 0


@pytest.mark.parametrize("how", ["pidfd", "heartbeat"])
def test_killed_reader_does_not_pin_memory(make_server, spawn, how, seed):
    srv = make_server(*SERVER_ARGS[how])
    n = 4
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client() as c:
        assert c.store(tokens, kv) == n * CHUNK

    worker = spawn(srv.ipc_url, "retrieve", tokens, pid0=(how == "heartbeat"))
    assert worker.wait_ready() == {"ready": True, "transport": "shm", "views": n}
    during = srv.status()
    assert during["leases"] == 1
    assert during["l1"]["read_locked"] == n
    # A locked object survives a clear (it is only doomed) ...
    assert srv.clear()["removed"] == 0
    assert srv.status()["l1"]["objects"] == n

    worker.kill()
    wait_until(lambda: srv.status()["leases"] == 0, what=f"the dead reader's lease to end ({how})")
    after = srv.status()
    assert after["l1"]["read_locked"] == 0
    # ... and goes as soon as the dead reader's lock does: nothing stays pinned.
    assert after["l1"]["objects"] == 0
    assert after["l1"]["used_bytes"] == 0
    with srv.client() as c:
        assert c.lookup(tokens) == 0
        assert c.store(tokens, kv) == n * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv)


def test_killed_reader_without_clear_leaves_data_evictable(make_server, spawn, seed):
    srv = make_server(*SERVER_ARGS["pidfd"])
    n = 3
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client() as c:
        assert c.store(tokens, kv) == n * CHUNK
        worker = spawn(srv.url, "retrieve", tokens)
        assert worker.wait_ready()["views"] == n
        assert srv.status()["l1"]["read_locked"] == n
        worker.kill()
        wait_until(lambda: srv.status()["leases"] == 0, what="the dead reader's lease to end")
        assert srv.status()["l1"]["read_locked"] == 0
        assert_bytes_equal(c.retrieve(tokens), kv)  # the data itself is intact
        assert srv.clear()["removed"] == n  # and unlocked


def test_a_client_that_unregisters_with_space_in_quarantine_stays_watched(make_server, seed):
    """Its write lease expired into quarantine (it may still write those slots); then it unregisters its
    last context and goes on running. The server used to stop watching it, and the next quarantine
    check, finding no record, freed slots the client could still write into another client's objects."""
    srv = make_server("--lease-ttl-s", "1")
    n = 3
    tokens = make_tokens(n * CHUNK, seed)
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    c = srv.client()
    try:
        reply = c.link.request(m.PrepareStoreRequest(context_id=0, keys=c.hashes(tokens)))
        assert reply.statuses == [int(SlotStatus.ALLOCATED)] * n
        wait_until(lambda: srv.status()["quarantine"]["leases"] == 1, what="the abandoned write lease to go to quarantine")
        assert c.link.request(m.UnregisterContextRequest(context_id=0)).ok  # this process runs on
        time.sleep(1.0)  # ten housekeeping rounds
        status = srv.status()
        assert status["contexts"] == 0
        assert status["quarantine"]["leases"] == 1 and status["l1"]["used_bytes"] == n * chunk_bytes, status["quarantine"]
        with srv.client() as other:
            offsets = other.link.request(m.PrepareStoreRequest(context_id=0, keys=other.hashes(make_tokens(n * CHUNK, seed + 1)))).offsets
            assert not set(offsets) & set(reply.offsets), "slots the unregistered client may still write were handed out"
    finally:
        c.close()


def test_lease_ttl_ends_an_abandoned_store_but_keeps_its_slots_from_reuse(make_server, seed):
    """A live client that never commits: the TTL ends the lease (its objects vanish and the keys are
    free again), but the client still maps those slots and could write into them, so their space is
    quarantined until the client finishes the lease (or its process exits), never handed out earlier."""
    srv = make_server("--lease-ttl-s", "1")
    n = 5
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    with srv.client() as c:
        hashes = c.hashes(tokens)
        reply = c.link.request(m.PrepareStoreRequest(context_id=0, keys=hashes))
        assert reply.lease_id != 0
        assert reply.statuses == [int(SlotStatus.ALLOCATED)] * n
        assert c.lookup(tokens) == 0  # WRITING objects are invisible
        # The client stays alive (it heart-beats) but never commits: the TTL ends the lease.
        wait_until(lambda: srv.status()["leases"] == 0, what="the abandoned write lease to expire")
        status = srv.status()
        assert status["expired_leases"] >= 1
        assert status["l1"]["objects"] == 0
        assert status["quarantine"]["leases"] == 1 and status["quarantine"]["bytes"] == n * chunk_bytes
        assert status["l1"]["used_bytes"] == n * chunk_bytes, "the slots it may still write are not reused"
        [held] = status["quarantine"]["clients"]
        assert held["pid"] == os.getpid() and held["bytes"] == n * chunk_bytes
        assert status["contexts"] == 1, "the client itself is still alive"
        assert c.ping()

        assert c.store(tokens, kv) == n * CHUNK  # the keys are free: stored in other slots
        assert_bytes_equal(c.retrieve(tokens), kv)
        new_offsets = set(c.link.request(m.PrepareRetrieveRequest(context_id=0, keys=hashes)).offsets)
        assert not new_offsets & set(reply.offsets), "a quarantined slot was handed out again"

        with pytest.raises(LeaseExpired, match="expired at .*TTL 1 s") as exc_info:
            c.link.finish(m.CommitStoreRequest(context_id=c.context_id, lease_id=reply.lease_id))
        assert exc_info.value.code == ErrorCode.LEASE_EXPIRED
        # The late commit published nothing, and its slots are back.
        assert_bytes_equal(c.retrieve(tokens), kv)
        wait_until(lambda: srv.status()["quarantine"]["leases"] == 0, what="the quarantine to end")
        assert srv.status()["l1"]["objects"] == n


def test_a_read_held_past_the_ttl_keeps_its_pins_while_the_reader_runs(make_server, seed):
    """The TTL ends a read lease a live reader holds too long, but the reader still maps those bytes:
    they stay pinned (not evictable, not freed by a clear) until it lets go, so what it read is sound
    and its release succeeds. Then nothing stays pinned."""
    srv = make_server("--lease-ttl-s", "1")
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(heartbeat=False) as c:  # no heartbeat: nothing renews the lease (as if it leaked)
        assert c.store(tokens, kv) == 2 * CHUNK
        with c.prepare_retrieve(tokens) as views:
            assert len(views) == 2
            wait_until(lambda: srv.status()["leases"] == 0, what="the read lease to expire")
            assert srv.status()["quarantine"]["leases"] == 1
            assert srv.clear()["removed"] == 0  # still pinned: doomed, not freed
            assert_bytes_equal(np.concatenate(views, axis=2), kv)  # the bytes never changed under us
        status = srv.status()
        assert status["quarantine"]["leases"] == 0
        assert status["l1"]["read_locked"] == 0
        assert status["l1"]["objects"] == 0, "the doomed objects went with the last pin"


def test_a_heart_beating_idle_client_keeps_its_leases(make_server, seed):
    """The other side of the missed-heartbeat rule: an idle client that heart-beats is not 'gone'."""
    srv = make_server(*SERVER_ARGS["heartbeat"])
    n = 3
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client() as c:
        ctx = c.context_id
        with c.prepare_store(tokens) as slots:
            for i, slot in enumerate(slots):
                slot[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
            time.sleep(2.5 * CLIENT_TIMEOUT_S)  # idle for 2.5 client timeouts; only the heartbeat speaks for it
            assert srv.status()["leases"] == 1
        assert c.context_id == ctx, "the client was never declared gone, so it never re-registered"
        assert_bytes_equal(c.retrieve(tokens), kv)
