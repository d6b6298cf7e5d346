"""AdminGuard alone: every Host it must accept or refuse (421), and for mutating methods the
Content-Type (415) and Origin (403) rules, in the order the guard applies them. Headers are the
case-insensitive mapping the HTTP app hands it (starlette's ``Headers``)."""

from __future__ import annotations

import socket

import pytest
from starlette.datastructures import Headers

from kvdepot.admin.guard import AdminGuard, Refusal

PORT = 8080
JSON = "application/json"


def headers(host: str | None = "localhost:8080", ctype: str | None = None, origin: str | None = None) -> Headers:
    h = {}
    if host is not None:
        h["Host"] = host
    if ctype is not None:
        h["Content-Type"] = ctype
    if origin is not None:
        h["Origin"] = origin
    return Headers(headers=h)


def refused_host(value: str) -> Refusal:
    return Refusal(421, f"Host {value!r} does not name this server; add it with --http-allowed-hosts")


@pytest.fixture
def loopback() -> AdminGuard:
    return AdminGuard("127.0.0.1", PORT)


# --- Host ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8080",
        "LocalHost:8080",  # names are case-insensitive
        "127.0.0.1",
        "127.0.0.1:8080",
        "[::1]",
        "[::1]:8080",
        "localhost:",  # an empty port is still a valid authority
        "localhost:9999",  # the Host's port is not the guard's business (the Origin's is)
    ],
)
def test_loopback_names_are_accepted(loopback, host):
    assert loopback.check("GET", headers(host)) is None


@pytest.mark.parametrize("name", [socket.gethostname(), socket.getfqdn()])
def test_this_machines_names_are_accepted(loopback, name):
    assert loopback.check("GET", headers(f"{name}:{PORT}")) is None
    assert loopback.check("GET", headers(name.upper())) is None


def test_the_bound_address_is_accepted_and_other_addresses_are_not():
    guard = AdminGuard("10.1.2.3", PORT)
    assert guard.check("GET", headers("10.1.2.3:8080")) is None
    assert guard.check("GET", headers("10.1.2.4:8080")) == refused_host("10.1.2.4:8080")
    named = AdminGuard("KV.internal", PORT)
    assert named.check("GET", headers("kv.internal:8080")) is None


def test_allowed_hosts_are_accepted_in_any_case():
    guard = AdminGuard("127.0.0.1", PORT, allowed_hosts=("KV.Example.com", "", "other.example"))
    assert guard.check("GET", headers("kv.example.com:8080")) is None
    assert guard.check("GET", headers("kv.EXAMPLE.com")) is None
    assert guard.check("GET", headers("other.example")) is None
    assert guard.check("GET", headers("sub.kv.example.com")) == refused_host("sub.kv.example.com")
    assert guard.check("GET", headers("")) == refused_host("")  # an empty allowed name allows nothing


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_a_wildcard_bind_accepts_ip_literals_but_not_other_names(bind):
    guard = AdminGuard(bind, PORT)
    for host in ("10.0.0.5:8080", "192.168.1.1", "[fe80::1]:8080", "[2001:db8::7]", "0.0.0.0:8080"):
        assert guard.check("GET", headers(host)) is None, host
    assert guard.check("GET", headers("evil.example:8080")) == refused_host("evil.example:8080")
    assert guard.wildcard is True
    assert not {"0.0.0.0", "::", ""} & guard.names


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",  # a DNS-rebinding page sends its own name
        "evil.example:8080",
        "localhost.evil.example",
        "127.0.0.1.nip.io:8080",
        "10.0.0.5:8080",  # an IP literal other than the bound one, when not bound to a wildcard
        "0.0.0.0:8080",
        "::1",  # an IPv6 literal without brackets is not a host
        "localhost:abc",  # a port that is not a number
        "localhost:99999",  # or out of range
        "",
    ],
)
def test_other_hosts_are_refused_with_421(loopback, host):
    assert loopback.check("GET", headers(host)) == refused_host(host)
    assert loopback.check("POST", headers(host, JSON)) == refused_host(host)  # before anything else


def test_a_request_without_a_host_is_refused(loopback):
    assert loopback.check("GET", headers(None)) == refused_host("")


def test_the_names_are_what_the_module_promises():
    guard = AdminGuard("127.0.0.1", PORT, allowed_hosts=("Extra.Example",))
    expected = {"localhost", "127.0.0.1", "::1", "extra.example", socket.gethostname().lower(), socket.getfqdn().lower()}
    assert guard.names == frozenset(expected)
    assert (guard.port, guard.wildcard) == (PORT, False)


# --- reads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "get"])
def test_reads_need_neither_json_nor_an_own_origin(loopback, method):
    assert loopback.check(method, headers()) is None
    assert loopback.check(method, headers(ctype="text/plain", origin="http://evil.example")) is None


# --- mutating requests: Content-Type -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "post", "Delete"])
@pytest.mark.parametrize("ctype", [JSON, "application/json; charset=utf-8", "Application/JSON", " application/json "])
def test_a_mutating_request_with_json_passes(loopback, method, ctype):
    assert loopback.check(method, headers(ctype=ctype)) is None


@pytest.mark.parametrize(
    "ctype, shown",
    [
        ("text/plain", "'text/plain'"),  # what a page may send cross-origin without a preflight
        ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),
        ("multipart/form-data; boundary=x", "'multipart/form-data'"),
        ("application/jsonp", "'application/jsonp'"),
        ("application/json-patch+json", "'application/json-patch+json'"),
        ("", "'none'"),
        (None, "'none'"),
    ],
)
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_a_mutating_request_without_json_is_refused_with_415(loopback, method, ctype, shown):
    assert loopback.check(method, headers(ctype=ctype)) == Refusal(415, f"{method} needs Content-Type: application/json (got {shown})")


def test_the_content_type_is_checked_before_the_origin(loopback):
    refusal = loopback.check("POST", headers(ctype="text/plain", origin="http://evil.example"))
    assert refusal is not None and refusal.status == 415


# --- mutating requests: Origin -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:8080",
        "http://127.0.0.1:8080",
        "http://[::1]:8080",
        "https://localhost:8080",
        "HTTP://LOCALHOST:8080",
        f"http://{socket.gethostname()}:8080",
    ],
)
def test_a_mutating_request_from_this_server_itself_passes(loopback, origin):
    assert loopback.check("POST", headers(ctype=JSON, origin=origin)) is None


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example:8080",
        "http://localhost:3000",  # another local service's page
        "http://localhost",  # port 80, not this server's
        "https://localhost",  # port 443
        "null",  # an opaque origin (sandboxed frame, file://)
        "file://",
        "chrome-extension://abcdef",
        "http://localhost:99999",
        "http://10.0.0.5:8080",  # an IP literal is not this server unless bound to a wildcard
        "",
    ],
)
def test_a_mutating_request_from_another_origin_is_refused_with_403(loopback, origin):
    assert loopback.check("DELETE", headers(ctype=JSON, origin=origin)) == Refusal(
        403, f"cross-origin DELETE from {origin!r} is not allowed"
    )


def test_an_origin_without_a_port_names_its_schemes_default():
    assert AdminGuard("127.0.0.1", 80).check("POST", headers("localhost", JSON, "http://localhost")) is None
    assert AdminGuard("127.0.0.1", 443).check("POST", headers("localhost", JSON, "https://localhost")) is None
    assert AdminGuard("127.0.0.1", 443).check("POST", headers("localhost", JSON, "http://localhost")).status == 403


def test_origins_follow_the_same_names_as_hosts():
    wildcard = AdminGuard("0.0.0.0", PORT)
    assert wildcard.check("POST", headers("10.0.0.5:8080", JSON, "http://10.0.0.5:8080")) is None
    allowed = AdminGuard("127.0.0.1", PORT, allowed_hosts=("kv.example.com",))
    assert allowed.check("POST", headers("kv.example.com:8080", JSON, "https://KV.example.com:8080")) is None
    assert allowed.check("POST", headers("kv.example.com:8080", JSON, "https://kv.example.org:8080")).status == 403


# --- the admin token (bearer) ----------------------------------------------------------------------------

TOKEN = "tok-3f9a"


def with_auth(authorization: str | None, ctype: str | None = JSON) -> Headers:
    h = {"Host": "localhost:8080"}
    if ctype is not None:
        h["Content-Type"] = ctype
    if authorization is not None:
        h["Authorization"] = authorization
    return Headers(headers=h)


@pytest.fixture
def tokened() -> AdminGuard:
    return AdminGuard("127.0.0.1", PORT, admin_token=TOKEN)


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer   ", f"Basic {TOKEN}", TOKEN])
def test_a_mutating_request_without_a_bearer_token_is_refused_with_401(tokened, method, authorization):
    refusal = tokened.check(method, with_auth(authorization))
    assert refusal is not None and refusal.status == 401
    assert refusal.headers["WWW-Authenticate"].startswith("Bearer")
    assert TOKEN not in refusal.reason


@pytest.mark.parametrize("wrong", ["tok-3f9b", "tok-3f9", "tok-3f9aa", "TOK-3F9A", "x"])
def test_a_wrong_token_is_refused_with_403(tokened, wrong):
    refusal = tokened.check("POST", with_auth(f"Bearer {wrong}"))
    assert refusal is not None and refusal.status == 403
    assert TOKEN not in refusal.reason and wrong not in refusal.reason


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN} "])
def test_the_right_token_passes(tokened, authorization):
    assert tokened.check("DELETE", with_auth(authorization)) is None


def test_the_token_comes_before_the_content_type_and_reads_need_none(tokened):
    assert tokened.check("POST", with_auth(None, ctype="text/plain")).status == 401
    assert tokened.check("POST", with_auth(f"Bearer {TOKEN}", ctype="text/plain")).status == 415
    for method in ("GET", "HEAD", "OPTIONS"):
        assert tokened.check(method, with_auth(None, ctype=None)) is None
    assert tokened.check("GET", Headers(headers={"Host": "evil.example"})).status == 421  # the Host check still comes first


def test_without_a_token_no_authorization_is_asked(loopback):
    assert loopback.check("POST", with_auth(None)) is None
    assert TOKEN not in repr(AdminGuard("127.0.0.1", PORT, admin_token=TOKEN))


def test_refusals_are_logged_at_most_once_a_minute_with_a_count(caplog):
    import logging

    from kvdepot.admin.http import RefusalLog

    now = [100.0]
    refusals = RefusalLog(60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvdepot.admin.http"):
        for _ in range(600):
            refusals.refused("POST", "/cache/clear", "bad token")
        refusals.refused("PUT", "/quota/a", "bad token")  # another path has its own minute
        for i in range(100):  # ... up to a few dozen paths; the rest share one
            refusals.refused("GET", f"/x{i}", "bad host")
        now[0] += 61
        refusals.refused("POST", "/cache/clear", "bad token")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == ["admin API refused POST /cache/clear: bad token", "admin API refused PUT /quota/a: bad token"]
    assert len(lines) == 2 + (RefusalLog.MAX_PATHS - 2) + 1 + 1
    assert lines[-1] == "admin API refused POST /cache/clear: bad token (599 more refused since the last one logged)"


def test_a_host_or_origin_that_is_no_url_is_refused_not_an_error():
    g = AdminGuard("127.0.0.1", 8080)
    assert g.check("GET", {"host": "[::1"}).status == 421
    refusal = g.check("POST", {"host": "127.0.0.1:8080", "content-type": "application/json", "origin": "http://[zz"})
    assert refusal is not None and refusal.status == 403


def test_the_prometheus_port_lets_go_of_a_connection_that_sends_half_a_request(monkeypatch):
    """An idle connection used to hold one thread of the server for ever."""
    from kvdepot.admin import prometheus

    monkeypatch.setattr(prometheus, "IDLE_TIMEOUT_S", 0.5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = prometheus.PrometheusServer(lambda: b"x 1\n", "127.0.0.1", port)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
            conn.sendall(b"GET /metr")
            assert conn.recv(1024) == b""  # closed by the server, not left waiting
        with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
            assert b"200" in conn.recv(1024).split(b"\r\n", 1)[0]
    finally:
        server.close()


def test_refusals_under_made_up_methods_stay_bounded_and_rate_limited(caplog):
    """The method is the client's own token (uvicorn's h11 parser takes any): past the cap on paths, one
    entry per made-up method grew without bound, and each logged a warning (the flood the log exists
    to stop, which also pushed every real warning out of /events/recent)."""
    import logging

    from kvdepot.admin.http import RefusalLog

    refusals = RefusalLog(every_s=60.0, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="kvdepot.admin.http"):
        for i in range(2000):
            refusals.refused(f"X{i}", "/status", "Host 'evil' does not name this server")
    assert len(refusals._by_path) <= RefusalLog.MAX_PATHS + 1, f"{len(refusals._by_path)} entries kept"
    assert len(caplog.records) <= RefusalLog.MAX_PATHS + 1, f"{len(caplog.records)} warnings within one minute"


def test_the_admin_port_lets_go_of_a_connection_that_never_sends_a_whole_request(monkeypatch):
    """uvicorn times out an idle connection only after it answered a request on it: one that sends
    nothing, or half a request head, was kept for ever, each holding a descriptor of the server's
    process. Off loopback (with a token, as required) any stranger could open them until the server ran
    out of descriptors for its clients, its arena and its tiers."""
    from kvdepot.admin import http
    from kvdepot.bench.serverproc import free_port
    from kvdepot.config import HttpConfig

    monkeypatch.setattr(http, "REQUEST_HEAD_TIMEOUT_S", 0.5, raising=False)
    port = free_port()
    server = http.HttpServer(object(), HttpConfig(host="127.0.0.1", port=port))
    server.start()
    try:
        for sent in (b"", b"GET /stat"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                conn.sendall(sent)
                try:
                    got = conn.recv(1024)
                except TimeoutError:
                    got = None
                assert got == b"", f"a connection that sent {sent!r} is still held 10 s later"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:  # a whole request is answered
            conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
            assert b"200" in conn.recv(1024).split(b"\r\n", 1)[0]
    finally:
        server.close()
