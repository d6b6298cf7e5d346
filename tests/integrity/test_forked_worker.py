"""A worker that forks and dies never keeps its arena space held through its child.

A worker's liveness lock is an OFD lock, which belongs to an open file description, and a ``fork()``
child shares its parent's descriptions: without care, a worker that forks a helper (SGLang and many
launchers do) and dies leaves its lock held for as long as the helper lives, and the server keeps the
dead worker's leases in quarantine all that time. Here real workers really fork (no mocks): the lock
must go with the worker, stay while the worker lives, and the child must not be able to use the arena.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from kvdepot.shm import HEADER_BYTES, SharedArena, liveness_offset

from support.servers import CHUNK, LAYOUT, MODEL, make_tokens

SIZE = (1 << 20) + HEADER_BYTES
DEADLINE_S = 10.0

# argv: path size nonce-hex lock-offset mode. Attaches, takes the lock, says so; on "fork" forks a child
# that reports its arena and then (mode "sleep") sleeps, or (mode "poke") reads, closes and writes
# through a view taken before the fork. The worker exits when its stdin says "exit" or closes.
ARENA_WORKER = r"""
import json, os, sys, time
from kvdepot.shm import HEADER_BYTES, SharedArena
def say(obj):  # one write(): the worker and its child share this pipe
    os.write(1, (json.dumps(obj) + "\n").encode())
path, size, nonce, offset, mode = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
arena = SharedArena.attach(path, size, nonce)
arena.hold_liveness_lock(offset)
view = arena.view(HEADER_BYTES, 16)  # taken before the fork
say({"locked": os.getpid()})
assert sys.stdin.readline().strip() == "fork"
pid = os.fork()
if pid == 0:
    report = {"child": os.getpid()}
    try:
        report.update(forked=arena.forked, fd=arena.fd, liveness_lock=arena.liveness_lock)
    except AttributeError as exc:
        report["error"] = str(exc)
    try:
        arena.buffer
        report["buffer"] = "usable"
    except OSError as exc:
        report["buffer"] = str(exc)
    if mode == "sleep":
        say(report)
        time.sleep(60)
        os._exit(0)
    report["read"] = int(view[0])  # reading a view from before the fork is still valid memory
    arena.close()  # safe in the child (the view keeps the mapping)
    report["closed"] = True
    say(report)
    view[0] = 77  # must not reach the shared arena: nothing watches this process
    os._exit(0)
say({"worker": os.getpid(), "child": pid})
if mode == "poke":
    _, status = os.waitpid(pid, 0)
    say({"child_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                      "child_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1})
sys.stdin.readline()
"""

# argv: json {url, model, layout, tokens}. A KVClient on the shm transport watched only by its liveness lock (no pid, as
# for a worker in another PID namespace), inside prepare_store (a lease, writable slots), forks a child
# that sleeps, says both pids, then blocks until it is killed.
LEASE_WORKER = r"""
import json, os, sys, time
import numpy as np
import kvdepot.client.registration as registration
from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.protocol import messages
def say(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())
args = json.loads(sys.argv[1])
assert "local_client_info" in vars(registration)  # where a registration looks it up
registration.local_client_info = lambda: messages.ClientInfo()  # no pidfd: only the lock tells
c = KVClient(args["url"], args["model"], KVLayout(*args["layout"]), options=ClientOptions(transport="shm", timeout_s=10.0))
with c.prepare_store(np.asarray(args["tokens"], dtype=np.int64)) as slots:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    say({"transport": c.transport, "n": sum(s is not None for s in slots), "child": pid})
    sys.stdin.readline()
"""


# argv: json {url, model, layout, tokens, transport}. A connected KVClient stores, then forks: the child
# uses the parent's client (a lookup, then close), saying what happened and how long it took; the
# parent waits for the child, then looks up again through its own client.
FORKED_CLIENT_WORKER = r"""
import json, os, sys, time
import numpy as np
from kvdepot import ClientOptions, KVClient, KVLayout
def say(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())
args = json.loads(sys.argv[1])
tokens = np.asarray(args["tokens"], dtype=np.int64)
c = KVClient(args["url"], args["model"], KVLayout(*args["layout"]), options=ClientOptions(transport=args["transport"], timeout_s=2.0))
kv = np.ones((2, c.layout.num_layers, len(tokens), c.layout.num_kv_heads, c.layout.head_dim), dtype=c.layout.dtype)
assert c.store(tokens, kv) == len(tokens)
pid = os.fork()
if pid == 0:
    report, start = {"in_child": os.getpid()}, time.monotonic()
    try:
        report["lookup"] = c.lookup(tokens)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["lookup_s"] = time.monotonic() - start
    c.close()
    report["closed_s"] = time.monotonic() - start
    say(report)
    os._exit(0)
say({"worker": os.getpid(), "child": pid, "transport": c.transport})
os.waitpid(pid, 0)
say({"parent_lookup": c.lookup(tokens)})
sys.stdin.readline()
c.close()
"""


def alive(pid: int) -> bool:
    """Running (a zombie is not: an orphan's reaper in a container may be slow)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state not in ("Z", "X")


def poll(predicate, what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class Procs:
    """Worker processes and their forked children, all killed at teardown."""

    def __init__(self) -> None:
        self.workers: list[subprocess.Popen] = []
        self.children: list[int] = []
        self._pending: dict[int, bytes] = {}

    def start(self, *argv: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.workers.append(p)
        self._pending[p.pid] = b""
        return p

    def say(self, p: subprocess.Popen, text: str) -> None:
        p.stdin.write(text.encode() + b"\n")

    def line(self, p: subprocess.Popen) -> dict:
        """The next line the worker or its child wrote (a deadline, not a hang, if none comes)."""
        fd = p.stdout.fileno()
        deadline = time.monotonic() + DEADLINE_S
        while b"\n" not in self._pending[p.pid]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                pytest.fail(f"no line from worker {p.pid} (or its child) within {DEADLINE_S}s (exit {p.poll()})")
            data = os.read(fd, 65536)
            if not data:
                pytest.fail(f"worker {p.pid} ended early (exit {p.poll()})")
            self._pending[p.pid] += data
        text, self._pending[p.pid] = self._pending[p.pid].split(b"\n", 1)
        out = json.loads(text)
        if "child" in out:
            self.children.append(out["child"])
        return out

    def kill_all(self) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for stream in (p.stdin, p.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.kill_all()


@pytest.fixture
def owner(tmp_path):
    arena = SharedArena.create(SIZE, shm_dir=str(tmp_path))
    yield arena
    arena.close()


def start_arena_worker(procs: Procs, owner: SharedArena, offset: int, mode: str) -> subprocess.Popen:
    return procs.start(ARENA_WORKER, owner.path, str(owner.size), owner.nonce.hex(), str(offset), mode)


def test_the_lock_goes_with_the_worker_not_with_its_forked_child(owner, procs):
    offset = liveness_offset(owner.size, b"forking-worker")
    worker = start_arena_worker(procs, owner, offset, "sleep")
    assert "locked" in procs.line(worker)
    assert owner.lock_held(offset)

    procs.say(worker, "fork")
    lines = [procs.line(worker), procs.line(worker)]  # the worker's and the child's, in either order
    child = next(x for x in lines if "buffer" in x)
    assert next(x for x in lines if "worker" in x)["child"] == child["child"]
    # The child has run its at-fork hook (it reported): the worker, still alive, still holds its lock.
    assert owner.lock_held(offset), "the child released the worker's lock (F_UNLCK on a shared description?)"

    procs.say(worker, "exit")
    worker.wait(DEADLINE_S)
    poll(lambda: not owner.lock_held(offset), "the dead worker's liveness lock to be released")
    assert alive(child["child"]), "the child must still be running for this to prove anything"


def test_a_forked_child_cannot_write_into_the_arena(owner, procs):
    offset = liveness_offset(owner.size, b"poking-worker")
    owner.buffer[HEADER_BYTES] = 5
    worker = start_arena_worker(procs, owner, offset, "poke")
    assert "locked" in procs.line(worker)
    procs.say(worker, "fork")
    lines = [procs.line(worker) for _ in range(3)]
    child = next(x for x in lines if "buffer" in x)
    ended = next(x for x in lines if "child_signal" in x)
    # The child knows it is not watched: no lock, no descriptor, and no new views...
    assert child.get("forked") is True and child.get("fd") == -1 and child.get("liveness_lock") == -1, child
    assert "fork()" in child["buffer"] and "KVClient" in child["buffer"], child
    # ...and views taken before the fork can be read but not written.
    assert child["read"] == 5 and child["closed"] is True  # reads stay valid memory; close() is safe
    assert ended["child_signal"] == signal.SIGSEGV, f"the forked child's write was not stopped: {ended}"
    assert owner.buffer[HEADER_BYTES] == 5, "a forked child wrote into the shared arena"
    assert owner.lock_held(offset)  # the worker lives on, watched


def test_a_killed_worker_with_a_forked_child_leaves_nothing_held(make_server, procs, seed):
    srv = make_server("--client-timeout-s", "1", "--heartbeat-interval-s", "0.2", "--lease-ttl-s", "600")
    n = 4
    args = {
        "url": srv.url,
        "model": MODEL,
        "layout": [LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim],
        "tokens": [int(t) for t in make_tokens(n * CHUNK, seed)],
    }
    worker = procs.start(LEASE_WORKER, json.dumps(args))
    ready = procs.line(worker)
    assert ready["transport"] == "shm" and ready["n"] == n, ready
    assert srv.status()["leases"] == 1

    worker.kill()  # SIGKILL, inside prepare_store, with its forked child still running
    worker.wait(DEADLINE_S)
    st = srv.wait_status(
        lambda s: s["leases"] == 0 and s["contexts"] == 0 and s["quarantine"]["leases"] == 0, timeout_s=DEADLINE_S
    )
    assert alive(ready["child"]), "the child must still be running for this to prove anything"
    assert st["leases"] == 0 and st["contexts"] == 0, st
    assert st["quarantine"] == {"leases": 0, "bytes": 0, "clients": []}, "the dead worker's space stayed quarantined"
    assert st["l1"]["used_bytes"] == 0 and st["l1"]["objects"] == 0


def test_a_worker_arena_closed_under_live_views_keeps_its_lock_until_they_go(owner):
    """The lock has a file description of its own (so that a child's mapping cannot hold it): closing
    the arena while views are alive must still keep it until the mapping goes, as before."""
    offset = liveness_offset(owner.size, b"closing-worker")
    worker = SharedArena.attach(owner.path, owner.size, owner.nonce)
    worker.hold_liveness_lock(offset)
    view = worker.view(HEADER_BYTES, 16)
    worker.close()
    assert owner.lock_held(offset), "the lock went while a view could still write into the arena"
    del view, worker  # the last reference to the mapping: it goes, and the lock with it
    poll(lambda: gc.collect() is not None and not owner.lock_held(offset), "the lock to go with the mapping")


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_forked_child_using_its_parents_client_gets_a_clear_error_not_a_hang(make_server, procs, transport, seed):
    """ZeroMQ sockets do not survive fork(): in the child, libzmq answers every wait with EINTR, which
    pyzmq retries forever, so a request spun at 100% CPU past any timeout. The child must be told at once
    (and may close its copy), and the parent's context must stay the parent's."""
    srv = make_server()
    n = 2
    args = {
        "url": srv.url,
        "model": MODEL,
        "layout": [LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim],
        "tokens": [int(t) for t in make_tokens(n * CHUNK, seed)],
        "transport": transport,
    }
    worker = procs.start(FORKED_CLIENT_WORKER, json.dumps(args))
    lines = [procs.line(worker), procs.line(worker)]  # the worker's and the child's, in either order
    assert next(x for x in lines if "worker" in x)["transport"] == transport
    child = next(x for x in lines if "in_child" in x)
    assert "lookup" not in child, f"a forked child used its parent's connection: {child}"
    assert "fork()" in child["error"] and "KVClient" in child["error"], child
    assert child["closed_s"] < 5.0, child  # close() in the child neither waits for a reply nor hangs
    assert procs.line(worker) == {"parent_lookup": n * CHUNK}  # the parent's client is unharmed
    assert srv.status()["contexts"] == 1, "the child's close() ended the parent's context"
