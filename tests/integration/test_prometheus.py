"""``--prometheus-port`` (the same registry on a port of its own) and the Grafana dashboard shipped in
``deploy/grafana/``, whose every query must name metrics a live server exports."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support.servers import CHUNK, LAYOUT, make_kv, make_tokens, wait_until

from kvdepot.bench.serverproc import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvdepot.json"


def _samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has, from a Prometheus exposition."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def _value(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_the_prometheus_port_serves_the_same_registry(make_server, seed):
    port = free_port()
    srv = make_server("--prometheus-port", str(port))
    url = f"http://127.0.0.1:{port}/metrics"
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = r.text
    with srv.client() as c:
        t = make_tokens(3 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 3 * CHUNK
        assert c.lookup(t) == 3 * CHUNK
    wait_until(lambda: srv.metric("kvdepot_disconnects_total", kind="goodbye") >= 1, what="the client's goodbye")  # then all is quiet
    after = httpx.get(url, timeout=10).text
    assert _value(after, "kvdepot_stored_chunks_total") - _value(before, "kvdepot_stored_chunks_total") == 3
    assert _value(after, "kvdepot_hit_tokens_total") - _value(before, "kvdepot_hit_tokens_total") == 3 * CHUNK
    admin = httpx.get(f"{srv.http}/metrics", timeout=10).text
    assert set(_samples(after)) == set(_samples(admin)), "one registry behind both ports"
    assert _value(admin, "kvdepot_stored_chunks_total") == _value(after, "kvdepot_stored_chunks_total")
    # Only /metrics, and only for this server's own names (DNS rebinding).
    assert httpx.get(f"http://127.0.0.1:{port}/status", timeout=10).status_code == 404
    assert httpx.get(url, headers={"Host": f"rebind.example:{port}"}, timeout=10).status_code == 421
    assert srv.alive()


def test_prometheus_is_off_by_default(make_server):
    srv = make_server()
    assert "--prometheus-port" not in " ".join(srv.proc.args)
    assert srv.status()["version"]  # and the server runs as before


def _server_exit(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvdepot.cli", "server", "--port", str(free_port()), "--http-port", str(free_port()), "--no-prefault"]
    return subprocess.run([*cmd, "--l1-size-gb", "0.0625", *args], capture_output=True, text=True, timeout=30)


def test_a_taken_prometheus_port_is_named():
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        r = _server_exit("--prometheus-port", str(port))
    assert r.returncode == 2 and f"--prometheus-port {port}:" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bad_prometheus_ports_are_refused():
    r = _server_exit("--prometheus-port", "70000")
    assert r.returncode == 2 and "--prometheus-port" in r.stderr, r.stderr
    port = str(free_port())
    r = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "server", "--port", str(free_port()), "--http-port", port, "--prometheus-port", port],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 2 and "--prometheus-port must differ from --http-port" in r.stderr, r.stderr


# --- the Grafana dashboard ------------------------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "vector", "by", "without",
    "or", "and", "unless", "on", "ignoring", "group_left", "group_right", "bool", "label_values", "offset",
}  # fmt: skip


def _exprs(dashboard: dict) -> list[str]:
    found = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return found


def _names_and_groupings(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, labels grouped by) of a PromQL expression; fails on an identifier it cannot place."""
    groupings = {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for label in group.split(",")}
    bare = re.sub(r'"[^"]*"', "", expr)  # strings
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # label matchers, ranges
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"label_values\(([^,]*),[^)]*\)", r"\1", bare)  # Grafana's variable query
    names = set()
    for ident in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare):
        if ident in PROMQL_WORDS:
            continue
        assert ident.startswith("kvdepot_"), f"{ident!r} in {expr!r} is not a kvdepot metric"
        names.add(ident)
    return names, groupings


def test_the_grafana_dashboard_names_only_metrics_a_live_server_exports(make_server, seed):
    dashboard = json.loads(DASHBOARD.read_text())
    srv = make_server("--l2", "memory:name=mem,size_gb=0.01")
    with srv.client() as c:  # so the labelled series exist (a counter has no sample before its first label)
        t = make_tokens(2 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 2 * CHUNK
        assert c.lookup(t) == 2 * CHUNK and c.lookup(make_tokens(2 * CHUNK, seed + 1)) == 0
        assert c.retrieve(t).shape[2] == 2 * CHUNK
    wait_until(lambda: srv.metric("kvdepot_disconnects_total", kind="goodbye") >= 1, what="the client's goodbye")
    # What the event bus feeds arrives on its drain thread's next tick: the tier's write and the lookups.
    wait_until(lambda: srv.metric("kvdepot_l2_task_seconds_count", tier="mem", task="store", outcome="ok") >= 1, what="the tier's write, timed")
    wait_until(lambda: srv.metric("kvdepot_request_seconds_count", type="LOOKUP", outcome="ok") >= 2, what="the lookups, timed")
    exported = _samples(httpx.get(f"{srv.http}/metrics", timeout=10).text)
    exprs = _exprs(dashboard)
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        names, groupings = _names_and_groupings(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert name in exported, f"the dashboard queries {name}, which kvdepot does not export ({expr})"
        labels = {k for name in names for labelset in exported[name] for k in labelset}
        assert groupings <= labels, f"{expr!r} groups by {groupings - labels}, a label none of {names} has"
        used |= names
    # The dashboard covers each area: hits, requests, errors, transfers, L1, leases, tiers.
    for needle in ("kvdepot_hit_tokens_total", "kvdepot_requests_total", "kvdepot_error_replies_total", "kvdepot_stored_bytes_total",
                   "kvdepot_l1_used_bytes", "kvdepot_l1_leases", "kvdepot_l2_healthy"):  # fmt: skip
        assert needle in used, needle
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]) and all(p["targets"] for p in panels)


def test_the_checker_catches_a_metric_that_does_not_exist():
    names, groupings = _names_and_groupings('sum by (tier) (rate(kvdepot_no_such_total{instance=~"$instance"}[5m]))')
    assert names == {"kvdepot_no_such_total"} and groupings == {"tier"}
