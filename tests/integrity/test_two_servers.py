"""One server per arena and per socket.

A second server that shares ``/dev/shm`` from another PID namespace (containers do) cannot see the first
one's pid; it must still never delete the first one's live arena: liveness is the owner's lock, not a
pid. A second server on the same ``--ipc-path`` must refuse to start rather than take the endpoint from
a live one; the socket file goes at a clean exit, and a dead server's stale one is replaced.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from kvdepot import KVClient
from kvdepot.bench.serverproc import ServerProcess, free_port

from support.servers import CHUNK, LAYOUT, MODEL, assert_bytes_equal, make_kv, make_tokens

# Runs the command after it with SIGHUP at its default: a suite run under ``nohup`` hands its processes
# SIGHUP ignored, and a server started so rightly keeps ignoring it.
HANGUP_DEFAULT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="kvd-arena-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers(tmp_path):
    started: list[ServerProcess] = []

    def start(*args: str, prefix: list[str] = (), ipc_path: str | None = None) -> ServerProcess:
        p = ServerProcess(
            args=["--chunk-size", str(CHUNK), "--l1-size-gb", "0.03125", *args],
            http_port=0,
            ipc_path=ipc_path,
            log_path=str(tmp_path / f"server{len(started)}.log"),
            prefix=list(prefix),
        )
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.stop(signal.SIGKILL if p.prefix else signal.SIGTERM)


def pid_namespace_prefix() -> list[str]:
    """``unshare --pid --fork``: the child runs in a new PID namespace (needs root)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here (needs root): {probe.stderr.strip()}")
    return [unshare, "--pid", "--fork", "--kill-child"]


def arenas(shm_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if n.startswith("kvdepot-"))


def test_a_server_in_another_pid_namespace_never_deletes_a_live_arena(servers, shm_dir, seed):
    first = servers("--shm-dir", shm_dir)
    [arena] = arenas(shm_dir)
    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with KVClient(first.url, MODEL, LAYOUT) as c:
        assert c.transport == "shm"
        assert c.store(tokens, kv) == 4 * CHUNK

        # It cannot see the first server's pid (pid namespaces), so a pid check calls the arena stale.
        second = servers("--shm-dir", shm_dir, prefix=pid_namespace_prefix())
        assert arena in arenas(shm_dir), "the second server deleted the first one's live arena"
        assert len(arenas(shm_dir)) == 2

        assert_bytes_equal(c.retrieve(tokens), kv)
    with KVClient(first.url, MODEL, LAYOUT) as late:  # a new client of the first server still maps it
        assert late.transport == "shm"
        assert_bytes_equal(late.retrieve(tokens), kv)
    with KVClient(second.url, MODEL, LAYOUT) as c2:
        assert c2.transport == "shm" and c2.lookup(tokens) == 0


def test_a_dead_servers_arena_is_swept_by_the_next(servers, shm_dir):
    first = servers("--shm-dir", shm_dir)
    [stale] = arenas(shm_dir)
    first.stop(signal.SIGKILL)  # no clean-up: its arena stays, and nobody holds its lock any more
    assert arenas(shm_dir) == [stale]
    servers("--shm-dir", shm_dir)
    assert stale not in arenas(shm_dir) and len(arenas(shm_dir)) == 1


def test_a_second_server_on_a_live_ipc_path_refuses_to_start(servers, tmp_path, seed):
    ipc = str(tmp_path / "kv.ipc")
    first = servers(ipc_path=ipc)
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with KVClient(f"ipc://{ipc}", MODEL, LAYOUT) as c:
        assert c.store(tokens, kv) == 2 * CHUNK
        r = subprocess.run(
            [sys.executable, "-m", "kvdepot.cli", "server", "--port", str(free_port()), "--http-port", "0",
             "--ipc-path", ipc, "--l1-size-gb", "0.03125"],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == 2, r.stderr  # a configuration error naming the flag, before any memory is reserved
        assert f"another kvdepot server is serving ipc://{ipc}" in r.stderr
        # The first one still owns the endpoint: the same client, and a new one, reach it.
        assert_bytes_equal(c.retrieve(tokens), kv)
    with KVClient(f"ipc://{ipc}", MODEL, LAYOUT) as c:
        assert_bytes_equal(c.retrieve(tokens), kv)
    assert first.stop(signal.SIGTERM) == 0
    assert not os.path.exists(ipc), "the socket file outlived a clean exit"


def test_a_dead_servers_ipc_socket_is_taken_over(servers, tmp_path):
    ipc = str(tmp_path / "kv.ipc")
    first = servers(ipc_path=ipc)
    first.stop(signal.SIGKILL)
    assert os.path.exists(ipc)  # stale: nobody serves it
    servers(ipc_path=ipc)
    with KVClient(f"ipc://{ipc}", MODEL, LAYOUT) as c:
        assert c.ping()


def test_a_hang_up_stops_the_server_cleanly_unless_it_runs_under_nohup(servers, shm_dir, tmp_path):
    """SIGHUP (the terminal of a foreground server closed: an ssh session dropped) killed the server
    outright, leaving its arena (L1's size, in RAM) in /dev/shm and its socket file until a next server
    swept them. It must stop as on SIGTERM; under ``nohup`` (SIGHUP ignored) it must keep serving."""
    nohup = shutil.which("nohup")
    if nohup is None:
        pytest.skip("nohup (coreutils) is not installed")
    ipc = str(tmp_path / "kv.ipc")
    hung_up = servers("--shm-dir", shm_dir, ipc_path=ipc, prefix=HANGUP_DEFAULT)  # as from a terminal, even where the suite runs under nohup
    assert len(arenas(shm_dir)) == 1 and os.path.exists(ipc)
    assert hung_up.stop(signal.SIGHUP) == 0, "SIGHUP did not stop the server cleanly"
    assert arenas(shm_dir) == [], "the arena outlived a hang-up"
    assert not os.path.exists(ipc), "the socket file outlived a hang-up"

    kept = servers("--shm-dir", shm_dir, ipc_path=ipc, prefix=[nohup])
    kept.proc.send_signal(signal.SIGHUP)
    with KVClient(f"ipc://{ipc}", MODEL, LAYOUT) as c:  # still serving
        assert c.ping()
    assert kept.proc.poll() is None
    assert kept.stop(signal.SIGTERM) == 0 and arenas(shm_dir) == []


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    return int(line.split()[3])


def test_a_server_raises_its_open_files_limit_to_the_hard_one(servers):
    """Every client, peer channel and tier connection takes a descriptor; at a distribution's default
    soft limit (1,024 under a far higher hard one) libzmq's listener spins a core and new clients hang."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    srv = servers(prefix=[prlimit, "--nofile=256:4096"])
    assert _soft_nofile(srv.proc.pid) == 4096


def test_kvdepot_peer_stops_cleanly_on_a_hang_up_and_raises_its_open_files_limit(tmp_path):
    """``kvdepot peer`` as ``kvdepot serve``: a closed terminal (SIGHUP) killed the node outright, so the
    others waited out its TTL; it must leave as on SIGTERM (exit 0)."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    cmd = [prlimit, "--nofile=256:4096", sys.executable, "-m", "kvdepot.cli", "peer", "--port", str(free_port()), "--data-port", "0",
           "--metrics-port", "0", "--secret", "hang-up"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("kvdepot peer node ")
        assert _soft_nofile(proc.pid) == 4096
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0, "SIGHUP did not stop the node cleanly"
    finally:
        proc.kill()
        proc.wait()
