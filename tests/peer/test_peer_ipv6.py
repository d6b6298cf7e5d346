"""A peer cluster on IPv6 loopback, as an IPv6-only cluster network runs one.

Before, a node on ``::1`` could not start: its data port was an AF_INET socket, its control endpoint
``tcp://::1:PORT`` was unbracketed, its id ``::1:PORT`` was no address another node could connect to,
and ``discovery=[::1]:PORT`` and a hint ``[::1]:PORT`` were split at the wrong colon. Here real nodes
(a ``PeerStore`` process, a ``kvdepot peer`` process, a kvdepot server with ``--l2 'peer:...'``) join
over ``::1``, share pages both ways byte for byte, and a bracketed router hint is asked first.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys

import httpx
import pytest
from support.addresses import free_port6, has_ipv6_loopback
from support.peer_cluster import NodeProcess, check_pages, keys, page_bytes, wait_for
from support.servers import SMALL_L1

from kvdepot.bench.serverproc import ServerProcess
from kvdepot.peer import PeerStore

SIZE = 32 << 10
SECRET = "ipv6-cluster-secret"
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0}
FAST_FLAGS = ["--heartbeat-interval-s", "0.3", "--member-ttl-s", "1.5", "--control-timeout-s", "0.5"]


pytestmark = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine's loopback has no IPv6 address")


@pytest.fixture
def head():
    node = NodeProcess(host="::1", secret=SECRET, pool_size_mb=16).start()
    yield node
    node.stop()


def test_two_nodes_on_ipv6_share_pages_both_ways_and_a_bracketed_hint_is_asked_first(head):
    assert head.node_id.startswith("[::1]:"), head.node_id  # bracketed: "::1:PORT" names no address
    metrics_port = free_port6()
    with PeerStore(discovery=head.node_id, host="[::1]", secret=SECRET, port=0, data_port=0, pool_size_mb=16, metrics_port=metrics_port,
                   **FAST) as local:  # fmt: skip
        assert local.node_id.startswith("[::1]:") and local.node.info.host == "::1"
        wait_for(lambda: len(local.status()["members"]) == 2 and len(head.command("status")["members"]) == 2, 15, "both nodes to see 2 members")
        assert sorted(head.command("status")["members"]) == sorted([head.node_id, local.node_id])
        assert head.command(f"set h 8 {SIZE}") == {"stored": 8}
        assert local.batch_set(keys("l", 8), [page_bytes(k, SIZE) for k in keys("l", 8)]) == [True] * 8
        # A router's hint in bracketed form names the head: its own pages are asked of it first.
        assert local.batch_exists(keys("h", 8), hint=head.node_id) == 8
        assert local.node.metrics.summary()["hints"] == {"found": 8, "missing": 0}
        buf = bytearray(SIZE)
        assert local.get_into("h3", buf, hint=head.node_id) and bytes(buf) == page_bytes("h3", SIZE)
        assert check_pages(local, "h", 8, SIZE) == {"hit": 8, "miss": 0, "wrong": 0}  # head -> local, over [::1]
        assert head.command(f"check l 8 {SIZE}") == {"hit": 8, "miss": 0, "wrong": 0}  # local -> head
        r = httpx.get(f"http://[::1]:{metrics_port}/summary", timeout=10)  # the metrics port listens on ::1 too
        assert r.status_code == 200 and r.json()["hints"] == local.node.metrics.summary()["hints"], r.text[:200]


def _peer_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvdepot.cli", "peer", *args]


def _first_line(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "kvdepot peer said nothing"
    return proc.stdout.readline().strip()


def _status(node: str) -> dict:
    out = subprocess.run(_peer_cli("status", "--node", node, "--json", "--secret", SECRET), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _status_with(node: str, members: int) -> dict | None:
    doc = _status(node)
    return doc if len(doc["members"]) == members else None


def test_kvdepot_peer_on_a_bracketed_host_and_a_server_joining_it_through_its_l2_spec(tmp_path):
    port, server_peer_port = free_port6(), free_port6()
    head_id = f"[::1]:{port}"
    cmd = _peer_cli("--host", "[::1]", "--port", str(port), "--data-port", "0", "--metrics-port", "0", "--secret", SECRET, *FAST_FLAGS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert _first_line(proc).startswith(f"kvdepot peer node {head_id} (data port ")
        spec = (f"peer:discovery={head_id},host=::1,port={server_peer_port},data_port=0,metrics_port=0,pool_size_mb=8,secret={SECRET},"
                "heartbeat_interval_s=0.3,member_ttl_s=1.5,control_timeout_s=0.5")  # fmt: skip
        server = ServerProcess(host="::1", args=["--l2", spec, "--l1-size-gb", SMALL_L1, "--no-prefault", "--shm-dir", str(tmp_path)],
                               log_path=str(tmp_path / "server.log"))  # fmt: skip
        with server:  # started, and answering PING on tcp://[::1]:PORT
            assert server.url == f"tcp://[::1]:{server.port}"
            joined = wait_for(lambda: _status_with(head_id, members=2), 30, "the server's node to join")
            assert sorted(m["id"] for m in joined["members"]) == sorted([head_id, f"[::1]:{server_peer_port}"])
            assert joined["node"] == head_id and joined["masters"][0] == head_id
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
