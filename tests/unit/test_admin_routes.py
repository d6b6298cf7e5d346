"""The admin API's endpoints come from the modules of ``kvdepot.admin.routes``: each module declares what
it needs of the server in a Protocol of its own, ``AdminBackend`` is their union, and a module added as a
file is served without any other change."""

from __future__ import annotations

import inspect
import sys
import typing

import pytest

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from kvdepot.admin import routes
from kvdepot.admin.backend import AdminBackend
from kvdepot.admin.guard import AdminGuard
from kvdepot.admin.http import build_app


def _protocol_members(proto: type) -> set[str]:
    return {name for name in proto.__dict__ if not name.startswith("_")}


def _paths(router) -> set[tuple[str, str]]:
    return {(method, r.path) for r in router.routes if isinstance(r, APIRoute) for method in r.methods}


def test_every_route_module_declares_what_it_needs_and_the_backend_is_their_union():
    modules = routes.route_modules()
    names = {m.__name__.rsplit(".", 1)[1] for m in modules}
    assert {"cache", "dashboard", "events", "health", "metrics", "quota", "root", "status"} <= names
    needed: set[str] = set()
    for module in modules:
        param = inspect.signature(module.routes).parameters["backend"].annotation
        proto = typing.get_type_hints(module.routes)["backend"] if isinstance(param, str) else param
        assert getattr(proto, "_is_protocol", False) and proto.__module__ == module.__name__, f"{module.__name__}: {proto!r}"
        needed |= _protocol_members(proto)
    assert needed == _protocol_members(AdminBackend), "AdminBackend must be exactly the union of the route modules' needs"


def test_the_app_serves_exactly_the_discovered_routers():
    app = build_app(object(), AdminGuard("127.0.0.1", 8080))
    discovered = set().union(*(_paths(r) for r in routes.routers(object())))
    assert _paths(app.router) == discovered
    for want in [("GET", "/"), ("GET", "/healthcheck"), ("GET", "/status"), ("GET", "/metrics"), ("POST", "/cache/clear"),
                 ("POST", "/clear-cache"), ("GET", "/quota"), ("PUT", "/quota/{cache_salt:path}"), ("GET", "/events/recent"),
                 ("GET", "/dashboard")]:  # fmt: skip
        assert want in discovered, want


PLUGIN = '''
from typing import Protocol
from fastapi import APIRouter

class Echo(Protocol):
    def echo(self) -> str: ...

def routes(backend: Echo) -> APIRouter:
    router = APIRouter()

    @router.get("/echo")
    def echo() -> dict:
        return {"echo": backend.echo()}

    return router
'''


def test_a_module_added_as_a_file_is_served(tmp_path, monkeypatch):
    (tmp_path / "zz_echo.py").write_text(PLUGIN)
    (tmp_path / "_helper.py").write_text("raise AssertionError('modules starting with _ are not routes')\n")
    monkeypatch.setattr(routes, "__path__", [*routes.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "kvdepot.admin.routes.zz_echo", raising=False)

    class Backend:
        def echo(self) -> str:
            return "hello"

    client = TestClient(build_app(Backend(), AdminGuard("127.0.0.1", 8080)), base_url="http://127.0.0.1:8080")
    assert client.get("/echo").json() == {"echo": "hello"}
    assert client.get("/echo", headers={"Host": "evil.example"}).status_code == 421, "an added route is guarded too"
    sys.modules.pop("kvdepot.admin.routes.zz_echo", None)


class _QuotaBackend:
    def __init__(self) -> None:
        self.set_calls: list[tuple[str, int | None]] = []

    def quotas(self):
        calls = self.set_calls

        class Q:
            def get(self, salt):
                return None

            def used(self, salt):
                return 0

            def pinned(self, salt):
                return 0

            def all(self):
                return []

            def set(self, salt, value):
                calls.append((salt, value))

        return Q()

    def largest_chunk_bytes(self) -> int:
        return 1 << 20


def test_a_quota_url_without_a_salt_is_refused_not_read_as_the_default_tenant():
    backend = _QuotaBackend()
    client = TestClient(build_app(backend, AdminGuard("127.0.0.1", 8080)), base_url="http://127.0.0.1:8080")
    for method in ("put", "get", "delete"):
        kwargs = {"json": {"quota_bytes": 0}} if method == "put" else {"headers": {"Content-Type": "application/json"}}
        r = getattr(client, method)("/quota/", **kwargs)
        assert r.status_code == 400 and "__default__" in r.json()["detail"], (method, r.text)
    assert backend.set_calls == []
    assert client.put("/quota/__default__", json={"quota_bytes": 5 << 20}).status_code == 200
    assert backend.set_calls == [("", 5 << 20)]


def test_the_healthcheck_answers_while_slow_calls_hold_every_thread_they_may_have():
    """Forty prefetches waiting on a slow tier used to hold every thread of the pool the endpoints
    share, and /healthcheck queued behind them (a liveness probe then restarts the server)."""
    import threading

    from kvdepot.admin.routes._slow import SLOW_CALL_THREADS

    release = threading.Event()
    started = threading.Semaphore(0)

    class Backend:
        def rpc_alive(self) -> bool:
            return True

        def degraded_reasons(self) -> list[str]:
            return []

        def clear(self, scope) -> dict:
            started.release()
            assert release.wait(60)
            return {"removed": 0, "tiers_removed": {}}

    client = TestClient(build_app(Backend(), AdminGuard("127.0.0.1", 8080)), base_url="http://127.0.0.1:8080")
    with client:
        callers = [threading.Thread(target=client.post, args=("/cache/clear",), kwargs={"json": {}}) for _ in range(45)]
        for t in callers:
            t.start()
        try:
            for _ in range(SLOW_CALL_THREADS):
                assert started.acquire(timeout=30), "the slow calls did not start"
            health: list[int] = []
            probe = threading.Thread(target=lambda: health.append(client.get("/healthcheck").status_code))
            probe.start()
            probe.join(30)
            assert health == [200], "the healthcheck queued behind the slow calls"
        finally:
            release.set()
            for t in callers:
                t.join(60)


@pytest.mark.parametrize(
    "method, path, body, field",
    [
        ("POST", "/cache/clear", b"NaN", None),  # Python's json reads NaN and Infinity, which JSON has not
        ("PUT", "/quota/t", b'{"quota_bytes": 1e400}', "quota_bytes"),  # read as inf
        ("POST", "/cache/pin", b'{"chunk_hashes": [], "ttl_s": Infinity}', "ttl_s"),
        ("POST", "/cache/pin", b'{"chunk_hashes": [], "ttl_s": NaN}', "ttl_s"),
        ("POST", "/cache/prefetch", b'{"token_ids": [], "wait_s": -Infinity}', "wait_s"),
        ("POST", "/cache/pins/7/extend", b'{"ttl_s": NaN}', "ttl_s"),
    ],
)
def test_a_body_with_a_number_json_cannot_write_is_refused_with_422_not_a_500(method, path, body, field):
    """The refusal echoes the value it refused, and a non-finite float cannot be written as JSON: the
    error reply itself raised, and a bad body was answered 500 Internal Server Error (with a traceback
    in the server's log) instead of saying which field was wrong."""
    client = TestClient(build_app(object(), AdminGuard("127.0.0.1", 8080)), base_url="http://127.0.0.1:8080",
                        raise_server_exceptions=False)  # fmt: skip
    r = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert errors and all(isinstance(e["msg"], str) for e in errors)
    if field is not None:
        assert any(e["loc"][-1] == field for e in errors), errors
