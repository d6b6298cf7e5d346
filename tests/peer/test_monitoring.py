"""A node's metrics port: Prometheus counters that move with what the node does, and its HTML page."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support.peer_cluster import page_bytes, wait_for

from kvdepot.bench.serverproc import free_port
from kvdepot.peer import PeerStore

FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "secret": "metrics-test"}


def samples(port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_and_the_page_follow_what_the_node_does():
    port = free_port()
    with PeerStore(port=0, data_port=0, pool_size_mb=1, metrics_port=port, **FAST) as owner, \
         PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=4, metrics_port=0, **FAST) as reader:  # fmt: skip
        wait_for(lambda: len(reader.status()["members"]) == 2 and len(owner.status()["members"]) == 2, 10, "two members")
        names = [f"m{i}" for i in range(24)]  # 1.5 MiB into a 1 MiB pool: evictions
        # The pool keeps the last 16: the call's own later pages evicted its first 8, which it reports not held.
        assert owner.batch_set(names, [page_bytes(n, 64 << 10) for n in names]) == [False] * 8 + [True] * 16
        got = reader.batch_get(names[-8:])
        assert all(g is not None for g in got)
        owner.get("not-there")
        # The owner counts a page served once its last byte is handed to the socket, on its connection's
        # thread: the reader may hold every byte first. Wait for that count, then read them all at once.
        wait_for(lambda: samples(port)[("kvdepot_peer_served_pages_total", ())] >= 8, 10, "the owner to count the pages it served")
        s = samples(port)
        assert s[("kvdepot_peer_writes_total", (("outcome", "stored"),))] == 24
        assert s[("kvdepot_peer_write_bytes_total", ())] == 24 * (64 << 10)
        assert s[("kvdepot_peer_evictions_total", ())] >= 8
        assert s[("kvdepot_peer_served_pages_total", ())] == 8  # the reader's pages came from this pool
        assert s[("kvdepot_peer_pool_capacity_bytes", ())] == 1 << 20
        assert s[("kvdepot_peer_members", ())] == 2
        assert s[("kvdepot_peer_lookups_total", (("result", "missing"),))] >= 1
        assert s[("kvdepot_peer_write_latency_seconds", (("quantile", "0.99"),))] > 0
        assert s[("kvdepot_peer_write_seconds_count", ())] == 1
        assert s[("kvdepot_peer_publish_owed", ())] == 0 and s[("kvdepot_peer_publish_repaid_total", ())] == 0  # no owner missed one
        assert s[("kvdepot_peer_unpublish_owed", ())] == 0 and s[("kvdepot_peer_unpublish_dropped_total", ())] == 0
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert owner.node_id in page.text and "hit rate" in page.text and "write latency" in page.text and "publishes owed" in page.text
        assert "<script" not in page.text and "http://" not in page.text.replace("http-equiv", "")  # self-contained
        assert "stored 24" in page.text and "{" not in page.text.split("<body>")[1], "counts shown as Python dicts"
        summary = httpx.get(f"http://127.0.0.1:{port}/summary", timeout=5).json()
        assert summary["writes"]["stored"] == 24 and summary["state"]["pool_pages"] <= 16


def test_a_taken_metrics_port_is_a_warning_not_a_failure(caplog):
    port = free_port()
    with PeerStore(port=0, data_port=0, pool_size_mb=1, metrics_port=port, **FAST) as first, \
         PeerStore(port=0, data_port=0, pool_size_mb=1, metrics_port=port, **FAST) as second:  # fmt: skip
        assert second.set("k", b"v" * 100) and second.get("k") == b"v" * 100
        assert "no metrics port" in caplog.text
        assert first.node._metrics_server.port == port


def test_the_metrics_port_lets_go_of_a_connection_that_sends_half_a_request(monkeypatch):
    """The metrics port listens on the node's own address (off loopback in a cluster), with no secret:
    a stranger's connection that sends nothing, or half a request, held one thread and one descriptor
    of the node's process for ever (the server's --prometheus-port closes such a one after 10 s)."""
    import socket

    from kvdepot.observability.metrics import PeerMetrics
    from kvdepot.peer import monitor

    monkeypatch.setattr(monitor, "IDLE_TIMEOUT_S", 0.5, raising=False)
    server = monitor.MetricsServer(PeerMetrics(lambda: {}), "127.0.0.1", 0, True, "127.0.0.1:1")
    assert server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b"GET /metr")
            try:
                got = conn.recv(1024)
            except TimeoutError:
                got = None
            assert got == b"", "the metrics port still holds a connection that sent half a request 10 s ago"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:  # and it still serves
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert b"200" in conn.recv(1024).split(b"\r\n", 1)[0]
    finally:
        server.close()
