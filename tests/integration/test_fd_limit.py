"""A server that runs out of file descriptors (a low ``ulimit -n``, many connections) fails what needs a
new one, and nothing else: a request it took in is still answered, and every client it answered is
still watched. Real server processes started under ``prlimit --nofile``; the descriptors are used up
by real TCP connections to its port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import urllib.request

import pytest

from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.protocol import messages as m

from support.servers import CHUNK, LAYOUT, RawPeer, wait_until

NOFILE = 64
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
ROWS = LAYOUT.kv_factor * LAYOUT.num_layers


@pytest.fixture
def low_fd_server(tmp_path):
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    p = ServerProcess(
        args=["--chunk-size", str(CHUNK), "--l1-size-gb", "0.03125", "--workers", "1", "--client-timeout-s", "1", "--heartbeat-interval-s", "0.2"],
        http_port=free_port(),
        prefix=[prlimit, f"--nofile={NOFILE}:{NOFILE}"],
        log_path=str(tmp_path / "server.log"),
    )
    yield p.start()
    p.stop()


def status(server: ServerProcess) -> dict:
    with urllib.request.urlopen(server.http_url + "/status", timeout=5) as r:
        return json.loads(r.read())


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def use_up_descriptors(server: ServerProcess) -> list[socket.socket]:
    """TCP connections to the server's port until it holds all NOFILE descriptors it may have."""
    held = []
    for _ in range(NOFILE + 16):  # more than it can accept: the rest wait in its listen backlog
        held.append(socket.create_connection(("127.0.0.1", server.port)))
    wait_until(lambda: open_fds(server.proc.pid) >= NOFILE, timeout_s=10, what="the server to run out of descriptors")
    return held


def test_a_blocking_request_taken_in_at_the_fd_limit_is_answered_and_its_client_still_watched(low_fd_server):
    """A worker makes its socket to the loop at its first BLOCKING request. At the fd limit that failed
    after the handler had run: the store was done but its reply lost (the client timed out), and the
    request never ended, so a client that then went silent was never declared gone (its context kept)."""
    srv = low_fd_server
    peer = RawPeer(srv.url)
    held: list[socket.socket] = []
    try:
        assert peer.ping()  # connected before the descriptors run out
        held = use_up_descriptors(srv)
        ctx = peer.register(client=m.ClientInfo()).context_id  # no pid: the server watches it by its silence only
        keys = [os.urandom(32) for _ in range(2)]
        payload = [b"\1" * (CHUNK_BYTES // ROWS)] * (ROWS * len(keys))
        reply = peer.call(m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=1), payload, timeout_s=5.0)
        assert len(reply.statuses) == len(keys)
    finally:
        for s in held:
            s.close()
        peer.close()  # silent from here on: no goodbye
    wait_until(lambda: status(srv)["contexts"] == 0, timeout_s=10, what="the silent client to be declared gone")
