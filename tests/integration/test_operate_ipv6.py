"""A server on IPv6 loopback: ``kvdepot server --host ::1`` could not start (``cannot listen on
tcp://::1:PORT: No such device``: no bracketed endpoint, no ZMQ_IPV6), and a client could not reach
``tcp://[::1]:PORT``. Here a real server process serves RPC, the admin API and the Prometheus port on
``::1``, and a real client pings it and stores and reads back a chunk."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
from support.addresses import has_ipv6_loopback
from support.servers import CHUNK, LAYOUT, MODEL, SMALL_L1, assert_bytes_equal, make_kv, make_tokens

from kvdepot import ClientOptions, KVClient
from kvdepot.errors import KVDepotError
from kvdepot.rpc.channel import RpcChannel

START_TIMEOUT_S = 60.0


pytestmark = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine's loopback has no IPv6 address")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct IPv6-loopback ports nothing listens on right now."""
    socks = [socket.socket(socket.AF_INET6, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("::1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_for_ping(proc: subprocess.Popen, url: str) -> None:
    """Until the server answers PING on ``url`` (its own ``ServerProcess`` helper pings over IPv4)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        channel = RpcChannel(url).open()
        try:
            if channel.ping(timeout_s=0.5):
                return
        except KVDepotError:
            pass
        finally:
            channel.close()
    pytest.fail(f"no PING reply from {url}")


@pytest.fixture
def ipv6_server(tmp_path):
    port, http_port, prom_port = _free_ports(3)
    args = ["--host", "::1", "--port", str(port), "--http-port", str(http_port), "--prometheus-port", str(prom_port),
            "--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1, "--no-prefault", "--shm-dir", str(tmp_path)]  # fmt: skip
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.cli", "server", *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_for_ping(proc, f"tcp://[::1]:{port}")
        except BaseException:
            log.seek(0)
            print(log.read())
            raise
        yield {"url": f"tcp://[::1]:{port}", "http": f"http://[::1]:{http_port}", "prometheus": f"http://[::1]:{prom_port}"}
    finally:
        if proc.poll() is None:  # one that exited at start failed above already
            proc.terminate()
            assert proc.wait(timeout=30) == 0
        log.close()


def test_a_server_on_ipv6_loopback_serves_a_client_and_its_http_ports(ipv6_server, seed):
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with KVClient(ipv6_server["url"], MODEL, LAYOUT, options=ClientOptions(timeout_s=10.0, transport="inline")) as client:
        assert client.store(tokens, kv) == len(tokens)
        assert client.lookup(tokens) == len(tokens)
        assert_bytes_equal(client.retrieve(tokens), kv)
    r = httpx.get(f"{ipv6_server['http']}/status", timeout=10)
    assert r.status_code == 200, r.text
    assert ipv6_server["url"] in r.text, "/status does not name the bracketed endpoint it serves"
    assert httpx.get(f"{ipv6_server['http']}/healthcheck", timeout=10).status_code == 200
    r = httpx.get(f"{ipv6_server['prometheus']}/metrics", timeout=10)
    assert r.status_code == 200 and b"kvdepot_" in r.content, r.text[:200]


def test_kvdepot_status_reads_a_server_whose_http_host_is_ipv6(ipv6_server):
    """``kvdepot status --http-host ::1`` (the value the server itself took) built ``http://::1:PORT``
    and failed with "Port could not be cast to integer value"; only ``[::1]`` or ``--url`` worked."""
    port = ipv6_server["http"].rsplit(":", 1)[1]
    for host in ("::1", "[::1]"):
        r = subprocess.run([sys.executable, "-m", "kvdepot.cli", "status", "--http-host", host, "--http-port", port],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, (host, r.stderr)
        assert ipv6_server["url"] in r.stdout, (host, r.stdout)
