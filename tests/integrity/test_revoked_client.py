"""A revoked client never writes into, or reads from, another client's object.

A worker paused inside a zero-copy block (SIGSTOP here; in life a GC pause, a debugger, a stalled VM)
for longer than ``--client-timeout-s`` is declared gone and its leases end. But it still maps the arena
and holds views of its slots: the server must keep that space in quarantine (counted as used, shown in
``/status``) until the process is gone, and the worker's next request must say LEASE_REVOKED, why and
when. Each test runs with the server watching the worker through a pidfd, and through its liveness lock
only (as for a worker in another PID namespace, whose pid the server cannot see).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvdepot.errors import BadRequest, ErrorCode
from kvdepot.protocol import messages as m

from support.servers import CHUNK, LAYOUT, MODEL, RawPeer, make_tokens, pause, wait_until

WORKER = Path(__file__).with_name("_paused_worker.py")
SERVER_ARGS = ["--client-timeout-s", "1", "--heartbeat-interval-s", "0.2", "--lease-ttl-s", "600"]
N = 6
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


class PausedWorker:
    def __init__(self, url: str, mode: str, tokens, value: int, pid0: bool, log: Path) -> None:
        args = {
            "url": url,
            "mode": mode,
            "tokens": [int(t) for t in tokens],
            "value": value,
            "pid0": pid0,
            "layout": [LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim],
            "model": MODEL,
        }
        self.err = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(10)
            pytest.fail(f"worker exited ({self.proc.returncode}) early; see {self.err.name}")
        return json.loads(text)

    def stop(self) -> None:
        pause(self.proc.pid)

    def resume_and_go(self) -> dict:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.line()

    def finish(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.err.close()


@pytest.fixture
def spawn(tmp_path):
    workers: list[PausedWorker] = []

    def start(*args, **kw) -> PausedWorker:
        w = PausedWorker(*args, **kw, log=tmp_path / f"worker{len(workers)}.log")
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.finish()


def fill(value: float, n_tokens: int) -> np.ndarray:
    return np.full(LAYOUT.chunk_shape(n_tokens), value, dtype=np.float16)


def revoked_entry(status: dict) -> dict | None:
    for c in status["quarantine"]["clients"]:
        if c["state"] == "revoked":
            return c
    return None


@pytest.mark.parametrize("watch", ["pidfd", "lock"])
def test_a_paused_writer_never_writes_into_the_next_owner_of_its_slots(make_server, spawn, watch, seed):
    srv = make_server(*SERVER_ARGS)
    tokens = make_tokens(N * CHUNK, seed)
    writer = spawn(srv.url, "store", tokens, value=9, pid0=watch == "lock")
    assert writer.line() == {"ready": True, "transport": "shm", "n": N}
    writer.stop()  # inside prepare_store, slots in hand
    wait_until(lambda: srv.status()["contexts"] == 0, what="the paused writer to be declared gone")
    # Its contexts go first, its leases next, and then it is counted (on the server's loop thread).
    wait_until(lambda: srv.metric("kvdepot_leases_ended_client_gone_total", how="revoked") >= 1, what="the revocation to be counted")
    assert srv.metric("kvdepot_clients_gone_total", how="revoked") == 1 and srv.metric("kvdepot_clients_gone_total", how="exited") == 0
    assert srv.metric("kvdepot_leases_ended_client_gone_total", how="revoked") == 1
    assert srv.status()["clients_gone"] == {"exited": 0, "revoked": 1}  # what the soak's check reads

    with srv.client() as other:  # the keys are free again: another client stores its own bytes
        assert other.store(tokens, fill(5, len(tokens))) == N * CHUNK
        assert (other.retrieve(tokens) == 5).all()
        paused = srv.status()  # checked below, after the bytes

        result = writer.resume_and_go()  # it writes 9s into its old slots, then commits
        got = other.retrieve(tokens)
        assert got.shape[2] == N * CHUNK
        assert (got == 5).all(), "the revoked writer's bytes reached another client's object"

        # It was told, at its first request after the revocation, why and when.
        assert result.get("error") == "LeaseRevoked" and result.get("code") == ErrorCode.LEASE_REVOKED, result
        assert "declared gone" in result["message"] and "heartbeat" in result["message"]
        # While it was paused its slots were held back (used, shown with its pid), not handed out.
        held = revoked_entry(paused)
        assert held is not None, paused.get("quarantine")
        assert held["pid"] == (writer.proc.pid if watch == "pidfd" else 0)  # a hidden pid shows as 0
        assert held["leases"] == 1 and held["bytes"] == N * CHUNK_BYTES
        assert "heartbeat" in held["why"]
        assert paused["quarantine"]["bytes"] == N * CHUNK_BYTES
        assert paused["l1"]["objects"] == N and paused["l1"]["used_bytes"] == 2 * N * CHUNK_BYTES
        # Its late commit told the server its block is over: that space is free again.
        wait_until(lambda: srv.status()["quarantine"]["leases"] == 0, what="the writer's quarantine to end")
        assert srv.status()["l1"]["used_bytes"] == N * CHUNK_BYTES
    writer.finish()


@pytest.mark.parametrize("watch", ["pidfd", "lock"])
def test_a_paused_reader_keeps_its_bytes_until_its_process_is_gone(make_server, spawn, watch, seed):
    # 2 MiB of L1: filling it forces eviction, which must not touch the paused reader's pinned slots.
    srv = make_server(*SERVER_ARGS, "--l1-size-gb", str(2 / 1024))
    tokens = make_tokens(N * CHUNK, seed)
    with srv.client() as other:
        assert other.store(tokens, fill(5, len(tokens))) == N * CHUNK
    reader = spawn(srv.url, "retrieve", tokens, value=5, pid0=watch == "lock")
    assert reader.line() == {"ready": True, "transport": "shm", "n": N}
    reader.stop()  # inside prepare_retrieve, views in hand
    wait_until(lambda: srv.status()["contexts"] == 0, what="the paused reader to be declared gone")

    with srv.client() as other:
        srv.clear()
        capacity_chunks = srv.status()["l1"]["capacity_bytes"] // CHUNK_BYTES
        for i in range(3):  # three times L1's size of other prompts: everything evictable goes
            filler = make_tokens(capacity_chunks * CHUNK, seed + 100 + i)
            other.store(filler, fill(7, len(filler)))
        assert other.lookup(tokens) == 0  # cleared: invisible to everyone else
        paused = srv.status()

    result = reader.resume_and_go()
    assert result["intact"] is True, "the paused reader's views were overwritten while it could read them"
    # Its read was sound (the pins were kept), so the block ends without an error: the release goes
    # behind, and its reply, read at the worker's next exchange (its goodbye), tells it that it was
    # declared gone, in its log.
    assert result == {"intact": True, "result": "ok"}, result
    held = revoked_entry(paused)
    assert held is not None and held["leases"] == 1 and held["bytes"] == N * CHUNK_BYTES
    # Its release ended the quarantine: the process still runs, and nothing stays pinned.
    wait_until(lambda: srv.status()["quarantine"]["leases"] == 0, what="the reader's release to end its quarantine")
    assert reader.proc.poll() is None
    reader.finish()
    log = reader.err.name
    text = Path(log).read_text()
    assert "declared gone" in text and "the release of lease" in text, text


def test_a_killed_paused_writer_gives_its_slots_back(make_server, spawn, seed):
    srv = make_server(*SERVER_ARGS)
    tokens = make_tokens(N * CHUNK, seed)
    writer = spawn(srv.url, "store", tokens, value=9, pid0=True)  # watched by its lock only
    assert writer.line()["transport"] == "shm"
    writer.stop()
    wait_until(lambda: revoked_entry(srv.status()), what="the paused writer to be revoked")
    writer.proc.kill()
    writer.proc.wait(10)
    wait_until(lambda: srv.status()["quarantine"]["leases"] == 0, what="the dead writer's quarantine to end")
    status = srv.status()
    assert status["l1"]["used_bytes"] == 0 and status["l1"]["objects"] == 0


def test_arena_offsets_go_only_to_clients_the_server_can_watch(server, seed):
    """A client with no pidfd and no liveness lock could never be proven gone: it gets no slots."""
    hashes = [bytes([i]) * 32 for i in range(3)]
    with RawPeer(server.url) as blind:
        blind.register(client=m.ClientInfo())  # no pid, no lock
        with pytest.raises(BadRequest, match="can watch"):
            blind.call(m.PrepareStoreRequest(context_id=blind.context_id, keys=hashes))
        with pytest.raises(BadRequest, match="can watch"):
            blind.call(m.PrepareRetrieveRequest(context_id=blind.context_id, keys=hashes))
        assert blind.call(m.LookupRequest(context_id=blind.context_id, keys=hashes)).hits == 0  # the rest works
