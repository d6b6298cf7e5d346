"""``--otlp-endpoint``: a real server exports a span per request over OTLP/HTTP to a collector (here a
stdlib HTTP server in the test that decodes the protobuf bodies with OpenTelemetry's own message
classes); a collector that is not there costs log lines, never a request; without OpenTelemetry
installed the flag is a clear error and a server without it never imports it."""

from __future__ import annotations

import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from support.servers import CHUNK, LAYOUT, MODEL, make_kv, make_tokens, wait_until
from support.tiers import wait_store_idle

from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.errors import ErrorCode, KVDepotError

SRC = Path(__file__).resolve().parents[2] / "src"
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def _pick(span: dict, *names: str) -> tuple:
    """The span's ``kvdepot.NAME`` attributes, in order."""
    return tuple(span["attrs"].get(f"kvdepot.{n}") for n in names)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector:
    """An OTLP/HTTP traces receiver: every span it is sent, flattened to a dict."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.posts = 0
        lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                got = []
                for rs in request.resource_spans:
                    resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append({
                                "name": s.name, "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "attrs": {a.key: _value(a.value) for a in s.attributes}, "status": s.status.code,
                                "span_id": s.span_id, "parent": s.parent_span_id, "trace_id": s.trace_id,
                                "resource": resource, "path": self.path, "type": self.headers["Content-Type"],
                            })  # fmt: skip
                with lock:
                    collector.spans.extend(got)
                    collector.posts += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def named(self, name: str, **attrs) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name and all(s["attrs"].get(k) == v for k, v in attrs.items())]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_a_server_exports_a_span_per_request_with_its_attributes(make_server, collector, seed):
    srv = make_server("--otlp-endpoint", collector.url, "--otlp-service-name", "kvdepot-itest", "--l2", "memory:name=mem,size_gb=0.01")
    stored, other = make_tokens(2 * CHUNK, seed), make_tokens(3 * CHUNK, seed + 1)
    with srv.client() as c:
        assert c.store(stored, make_kv(LAYOUT, len(stored), seed)) == 2 * CHUNK
        assert c.lookup(stored) == 2 * CHUNK
        assert c.lookup(other, cache_salt="tenant-b") == 0  # a miss: the server asks L2 too
        assert c.retrieve(stored).shape[2] == 2 * CHUNK
        with pytest.raises(KVDepotError) as unknown:
            c.query_prefetch_status("no-such-session")
        assert unknown.value.code is ErrorCode.UNKNOWN_SESSION
        # The batch processor exports while the server runs (every few seconds, not only at shutdown).
        hit = {"kvdepot.model": MODEL, "kvdepot.chunks": 2, "kvdepot.chunks_found": 2}
        wait_until(lambda: collector.named("kvdepot/LOOKUP", **hit), timeout_s=60, what="a LOOKUP span")
        # Pushed to the tier, then gone from L1: the next lookup prefetches both chunks from L2.
        wait_store_idle(srv)
        assert httpx.post(f"{srv.http}/cache/clear", json={"scope": "l1"}, timeout=30).json()["removed"] == 2
        assert c.lookup(stored) == 2 * CHUNK
    assert srv.stop() == 0  # at once: close flushes what is queued (that last lookup's spans among it)

    spans = collector.spans
    assert {s["path"] for s in spans} == {"/v1/traces"} and {s["type"] for s in spans} == {"application/x-protobuf"}
    assert {s["resource"]["service.name"] for s in spans} == {"kvdepot-itest"}
    for s in spans:
        assert 0 < s["start"] <= s["end"], s

    [store] = collector.named("kvdepot/STORE_INLINE") or collector.named("kvdepot/PREPARE_STORE")
    assert _pick(store, "op", "model", "chunks", "chunks_found", "tokens", "bytes", "outcome") == (
        "store", MODEL, 2, 2, 2 * CHUNK, 2 * CHUNK_BYTES, "ok"
    )
    assert "kvdepot.cache_salt" not in store["attrs"]

    # One span per engine lookup (its RequestDone makes no second one); the client's probes on the way
    # to a retrieve are LOOKUPs too, traced from their RequestDone alone.
    lookups = collector.named("kvdepot/LOOKUP", **{"kvdepot.op": "lookup"})
    assert len(lookups) == 3, [s["attrs"] for s in collector.named("kvdepot/LOOKUP")]
    first_hit, miss, prefetched = sorted(lookups, key=lambda s: s["start"])
    assert _pick(first_hit, "chunks_found", "tokens_found") == (2, 2 * CHUNK)
    assert miss["attrs"]["kvdepot.cache_salt"] == "tenant-b"
    assert _pick(miss, "chunks", "chunks_found", "bytes") == (3, 0, 0)
    assert prefetched["attrs"]["kvdepot.chunks_found"] == 2 and prefetched["status"] != STATUS_ERROR

    # The L2 part of a lookup is its child, ending with it.
    children = {s["parent"]: s for s in collector.named("kvdepot/L2_PREFETCH")}
    child = children[prefetched["span_id"]]
    assert child["trace_id"] == prefetched["trace_id"]
    assert prefetched["start"] <= child["start"] <= child["end"] == prefetched["end"]
    assert _pick(child, "chunks", "chunks_found", "bytes") == (2, 2, 2 * CHUNK_BYTES)
    assert children[miss["span_id"]]["attrs"]["kvdepot.chunks_found"] == 0  # the miss asked L2 and found nothing
    assert first_hit["span_id"] not in children  # all in L1: no prefetch

    [retrieve] = collector.named("kvdepot/RETRIEVE_INLINE") or collector.named("kvdepot/PREPARE_RETRIEVE")
    assert _pick(retrieve, "op", "chunks_found", "bytes") == ("retrieve", 2, 2 * CHUNK_BYTES)

    [failed] = collector.named("kvdepot/QUERY_PREFETCH_STATUS", **{"kvdepot.outcome": "UNKNOWN_SESSION"})
    assert failed["status"] == STATUS_ERROR
    assert collector.named("kvdepot/REGISTER_CONTEXT", **{"kvdepot.outcome": "ok"}), "every request type is traced"


def test_sampling_ratio_zero_exports_nothing(make_server, collector, seed):
    srv = make_server("--otlp-endpoint", collector.url, "--otlp-sample-ratio", "0")
    with srv.client() as c:
        t = make_tokens(2 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 2 * CHUNK
        assert c.lookup(t) == 2 * CHUNK
    assert srv.stop() == 0
    assert collector.spans == []


@pytest.fixture(params=["refuses", "hangs"])
def dead_collector(request):
    """A collector URL where nothing listens, or where a socket accepts connections and never answers."""
    if request.param == "refuses":
        yield f"http://127.0.0.1:{free_port()}/v1/traces"
        return
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:  # the kernel accepts; nobody reads
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"


def test_a_collector_that_is_not_there_costs_log_lines_never_a_request(make_server, dead_collector, seed):
    srv = make_server("--otlp-endpoint", dead_collector)
    t = make_tokens(2 * CHUNK, seed)
    with srv.client() as c:
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 2 * CHUNK
        wait_until(lambda: "export" in srv.log_text().lower() and "span" in srv.log_text().lower(), timeout_s=60,
                   what="the failed export in the server's log")  # fmt: skip
        for i in range(20):  # still serving, request after request
            assert c.lookup(t) == 2 * CHUNK
            assert c.retrieve(t).shape[2] == 2 * CHUNK
    assert srv.status()["l1"]["objects"] == 2
    assert srv.stop() == 0, "the server must still exit cleanly (its last flush fails, within its bound)"


# --- without OpenTelemetry ---------------------------------------------------------------------------


@pytest.fixture
def no_opentelemetry(tmp_path) -> dict[str, str]:
    """The environment of a Python in which OpenTelemetry cannot be imported (as if not installed)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['opentelemetry'] = None  # import opentelemetry... fails\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(SRC), os.environ.get("PYTHONPATH", "")])}


def test_without_opentelemetry_the_flag_is_a_clear_error(tmp_path, no_opentelemetry):
    proc = ServerProcess(args=["--otlp-endpoint", "http://127.0.0.1:4318/v1/traces", "--l1-size-gb", "0.0625"],
                         env=no_opentelemetry, log_path=str(tmp_path / "s.log"))  # fmt: skip
    code, why = proc.start_or_explain()
    assert code == 2
    assert "--otlp-endpoint needs OpenTelemetry" in why and "pip install kvdepot[otel]" in why, why


def test_without_the_flag_a_server_never_imports_opentelemetry(tmp_path, no_opentelemetry):
    proc = ServerProcess(args=["--l1-size-gb", "0.0625", "--chunk-size", str(CHUNK)], http_port=free_port(),
                         env=no_opentelemetry, log_path=str(tmp_path / "s.log"))  # fmt: skip
    proc.start()
    try:
        from kvdepot import KVClient

        with KVClient(proc.url, MODEL, LAYOUT) as c:
            t = make_tokens(2 * CHUNK, 7)
            assert c.store(t, make_kv(LAYOUT, len(t), 7)) == 2 * CHUNK and c.lookup(t) == 2 * CHUNK
    finally:
        assert proc.stop() == 0
    assert "opentelemetry" not in (tmp_path / "s.log").read_text()
