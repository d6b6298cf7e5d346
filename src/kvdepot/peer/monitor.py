"""A node's metrics port: ``/metrics`` (Prometheus text), ``/`` (a self-contained HTML page that refreshes
itself: no CDN, no script from anywhere else) and ``/summary`` (the page's numbers as JSON).

A small stdlib HTTP server on its own thread: a node runs inside engine processes (SGLang), where an
event loop of our own would be a guest too many. GET only; it reveals sizes and rates, never keys.
A port that cannot be bound is a warning: a node serves pages without its metrics.
"""

from __future__ import annotations

import html
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvdepot.config import host_port
from kvdepot.observability.metrics import PeerMetrics
from kvdepot.peer.addresses import listen_family

log = logging.getLogger(__name__)

# A connection that sends nothing (or half a request) gives its thread and descriptor back after this
# long: the port listens on the node's address with no secret, and a stranger's idle connections held
# one thread of the node's process each, for ever.
IDLE_TIMEOUT_S = 10.0


def _http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """The stdlib server binds AF_INET unless told otherwise: an IPv6 host needs its own family."""
    server_class = type("MetricsHTTPServer", (ThreadingHTTPServer,), {"address_family": listen_family(host)})
    return server_class((host, port), handler)


class MetricsServer:
    def __init__(self, metrics: PeerMetrics, host: str, port: int, dashboard: bool, node_id: str) -> None:
        self._metrics = metrics
        self._dashboard = dashboard
        self._node_id = node_id
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._host, self._port = host, port
        self.port = 0

    def start(self) -> bool:
        try:
            self._server = _http_server(self._host, self._port, self._handler())
        except OSError as exc:
            log.warning("peer %s: no metrics port (%s: %s); the node serves without it", self._node_id, host_port(self._host, self._port), exc)
            return False
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvdepot-peer-metrics", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4", outer._metrics.text())
                elif path == "/summary":
                    self._send(200, "application/json", json.dumps(outer._metrics.summary()).encode())
                elif path == "/" and outer._dashboard:
                    self._send(200, "text/html; charset=utf-8", outer.page().encode())
                else:
                    self._send(404, "text/plain", b"not found\n")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not news
                pass

        return Handler

    def page(self) -> str:
        s = self._metrics.summary()
        st = s["state"]

        def mib(v: float) -> str:
            return f"{v / 2**20:,.1f} MiB"

        def ms(v: float) -> str:
            return f"{v * 1e3:.2f} ms"

        def counts(d: dict) -> str:
            return ", ".join(f"{k} {int(v):,}" for k, v in d.items()) or "none"

        rows = [
            ("members", f"{int(st.get('members', 0))}"),
            ("pool", f"{mib(st.get('pool_used_bytes', 0))} of {mib(st.get('pool_capacity_bytes', 0))}, {int(st.get('pool_pages', 0))} pages"),
            ("disk", f"{mib(st.get('disk_used_bytes', 0))}, {int(st.get('disk_pages', 0))} pages"),
            ("directory shard", f"{int(st.get('directory_records', 0))} records"),
            ("publishes owed / sent again", f"{int(st.get('publish_owed', 0))} / {int(st.get('publish_repaid', 0))}"),
            ("reads", f"{counts(s['reads'])} (hit rate {s['read_hit_rate']:.1%}), {mib(s['read_bytes'])}"),
            ("writes", f"{counts(s['writes'])}, {mib(s['write_bytes'])}"),
            ("lookups", f"{counts(s['lookups'])}; {int(s['local_lookups']):,} in this node's own shard, "
                        f"{int(s['remembered_locations']):,} remembered"),
            ("pull or recompute", counts(s["pull_decisions"])),
            ("evictions / promotes", f"{int(st.get('evictions', 0))} / {int(st.get('promotes', 0))}"),
            ("served to readers", f"{int(st.get('served_pages', 0))} pages, {mib(st.get('served_bytes', 0))}"),
            ("read latency", " ".join(f"{k} {ms(v)}" for k, v in s["read_latency_s"].items() if k != "n")),
            ("write latency", " ".join(f"{k} {ms(v)}" for k, v in s["write_latency_s"].items() if k != "n")),
        ]
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
        return (
            "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>"
            f"<title>kvdepot peer {html.escape(self._node_id)}</title>"
            "<style>body{font:14px system-ui,sans-serif;margin:2em}th{text-align:left;padding-right:2em}"
            "td,th{padding:.3em 0;border-bottom:1px solid #ddd}</style></head><body>"
            f"<h1>kvdepot peer node {html.escape(self._node_id)}</h1><table>{body}</table>"
            "<p>Refreshes every 2 s. Prometheus: <a href='/metrics'>/metrics</a>; JSON: <a href='/summary'>/summary</a>.</p>"
            "</body></html>"
        )
