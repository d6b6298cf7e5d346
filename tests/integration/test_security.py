"""Security off loopback: a real ``kvdepot server`` bound to a non-loopback address of this machine.

It refuses to start there without authentication (CurveZMQ on the ZeroMQ port, a bearer token on the
admin port) unless ``--insecure``. With CurveZMQ (keys from ``kvdepot keygen``), an admitted client
stores and retrieves bytes that match; a client without keys, one whose key is not admitted and one
given the wrong server key are each refused with a clear error within their connect timeout, nothing
of theirs is stored, and the server goes on serving the admitted client. The connectors' settings
carry the keys to the socket. Mutating admin requests need the token; reads stay open.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.addresses import non_loopback_ipv4
from support.servers import CHUNK, LAYOUT, MODEL, SMALL_L1, assert_bytes_equal, make_kv, make_tokens, scrape_metric, wait_until

from kvdepot import ClientOptions, CurveClientKeys, KVClient
from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.connectors.common import ResilientClient
from kvdepot.connectors.sglang.settings import SGLangSettings
from kvdepot.connectors.vllm.config import ConnectorConfig
from kvdepot.errors import HandshakeRefused

ADDRESS = non_loopback_ipv4()
pytestmark = pytest.mark.skipif(not ADDRESS, reason="this machine has no non-loopback IPv4 address to bind a server to")

TOKEN = "s3cr3t-admin-token-for-the-test"
BASE = ["--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1, "--no-prefault"]


def _cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))  # fmt: skip


@dataclass(frozen=True)
class KeyDir:
    path: Path

    @property
    def server_secret(self) -> Path:
        return self.path / "server.key_secret"

    @property
    def server_public(self) -> Path:
        return self.path / "server.key"

    @property
    def client_secret(self) -> Path:
        return self.path / "client.key_secret"

    @property
    def clients(self) -> Path:
        return self.path / "clients"

    def client(self) -> CurveClientKeys:
        return CurveClientKeys.from_files(self.server_public, self.client_secret)


def _keygen(path: Path) -> KeyDir:
    r = _cli("keygen", str(path))
    assert r.returncode == 0, r.stderr
    keys = KeyDir(path)
    for f in (keys.server_secret, keys.server_public, keys.client_secret, keys.clients / "client.key"):
        assert f.is_file(), f"kvdepot keygen did not write {f}"
    assert keys.server_secret.stat().st_mode & 0o077 == 0, "a secret key file is readable by others"
    again = _cli("keygen", str(path))
    assert again.returncode == 1 and "never overwritten" in again.stderr, again.stderr
    return keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> KeyDir:
    return _keygen(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> KeyDir:
    """Another deployment's keys: a valid key pair the server has never admitted."""
    return _keygen(tmp_path_factory.mktemp("stranger"))


@pytest.fixture(scope="module", params=["clients-dir", "shared-client-key"])
def curve_server(request, keys, tmp_path_factory):
    """A server on ADDRESS with CurveZMQ (admitting a directory of client keys, or one shared client
    key file) and its admin port on ADDRESS too, with the token from the environment."""
    clients = keys.clients if request.param == "clients-dir" else keys.path / "client.key"
    log_dir = tmp_path_factory.mktemp("curve-server")
    proc = ServerProcess(
        args=[*BASE, "--curve-server-key", str(keys.server_secret), "--curve-clients", str(clients)],
        http_port=free_port(),
        host=ADDRESS,
        env={"KVDEPOT_ADMIN_TOKEN": TOKEN},
        log_path=str(log_dir / "server.log"),
        curve=keys.client(),
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, "the server must exit cleanly on SIGTERM"


def _client(url: str, *, curve: CurveClientKeys | None = None, **options) -> KVClient:
    options.setdefault("timeout_s", 10.0)
    return KVClient(url, MODEL, LAYOUT, options=ClientOptions(**options), curve=curve)


# --- refusing to start ---------------------------------------------------------------------------------


def test_a_server_off_loopback_refuses_to_start_without_authentication(tmp_path, keys):
    port = str(free_port())
    shm = ["--shm-dir", str(tmp_path)]
    r = _cli("server", "--host", ADDRESS, "--port", port, "--http-port", "0", *shm, env={"KVDEPOT_ADMIN_TOKEN": ""})
    assert r.returncode == 2, r.stderr
    assert f"--host {ADDRESS} is not loopback" in r.stderr and "--curve-server-key" in r.stderr and "--insecure" in r.stderr, r.stderr
    # ZeroMQ secured, the admin port on the same address without a token: refused too, naming the token.
    curve = ["--curve-server-key", str(keys.server_secret), "--curve-clients", str(keys.clients)]
    r = _cli("server", "--host", ADDRESS, "--port", port, "--http-port", str(free_port()), *curve, *shm, env={"KVDEPOT_ADMIN_TOKEN": ""})
    assert r.returncode == 2 and "--admin-token" in r.stderr and "KVDEPOT_ADMIN_TOKEN" in r.stderr, r.stderr
    # Half a Curve configuration, or a key file that is not one, is named too.
    r = _cli("server", "--host", ADDRESS, "--port", port, "--http-port", "0", "--curve-server-key", str(keys.server_secret), *shm)
    assert r.returncode == 2 and "--curve-clients" in r.stderr, r.stderr
    r = _cli("server", "--host", ADDRESS, "--port", port, "--http-port", "0", "--curve-server-key", str(keys.server_public),
             "--curve-clients", str(keys.clients), *shm)  # fmt: skip
    assert r.returncode == 2 and "--curve-server-key" in r.stderr and "no secret key" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == [], "an arena was reserved by a server that refused to start"


def test_insecure_serves_off_loopback_and_says_so(tmp_path, seed):
    proc = ServerProcess(args=[*BASE, "--insecure"], http_port=free_port(), host=ADDRESS, log_path=str(tmp_path / "server.log"))
    proc.start()
    try:
        with _client(proc.url) as c:
            t = make_tokens(2 * CHUNK, seed)
            assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 2 * CHUNK
        assert httpx.post(f"{proc.http_url}/cache/clear", json={}, timeout=10).status_code == 200  # no token asked
    finally:
        assert proc.stop() == 0
    assert "--insecure: serving off loopback without authentication" in (tmp_path / "server.log").read_text()


# --- CurveZMQ ------------------------------------------------------------------------------------------


def test_an_admitted_client_stores_and_retrieves_matching_bytes(curve_server, keys, seed):
    t = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with _client(curve_server.url, curve=keys.client(), transport="inline") as c:
        assert c.transport == "inline"  # the KV bytes themselves travel through the encrypted socket
        assert c.store(t, kv) == 4 * CHUNK
    with _client(curve_server.url, curve=keys.client(), transport="inline") as c:  # a fresh connection
        assert c.lookup(t) == 4 * CHUNK
        assert_bytes_equal(c.retrieve(t), kv)


def test_a_connection_closed_mid_handshake_is_counted_as_incomplete_not_as_a_key_problem(curve_server):
    """A TCP probe, or a client killed while it connects, ends the connection before the handshake:
    ZeroMQ reports that without detail. It is counted as ``incomplete`` (and logged at info), never as
    ``protocol``, the reason an operator reads as wrong or missing keys."""
    host, port = curve_server.url.removeprefix("tcp://").rsplit(":", 1)
    protocol = scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="protocol")
    incomplete = scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="incomplete")
    for _ in range(3):
        socket.create_connection((host, int(port)), timeout=5).close()
    wait_until(
        lambda: scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="incomplete") >= incomplete + 3,
        what="the three closed connections to be counted",
    )
    assert scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="protocol") == protocol
    assert curve_server.proc.poll() is None


def test_clients_without_admitted_keys_are_refused_clearly_and_the_server_goes_on(curve_server, keys, stranger, seed):
    good = _client(curve_server.url, curve=keys.client(), transport="inline")
    try:
        before = httpx.get(f"{curve_server.http_url}/status", timeout=10).json()
        refused = {
            "no keys": (None, "this client has none"),
            "a key the server does not admit": (
                CurveClientKeys.from_files(keys.server_public, stranger.client_secret),
                "not among those the server admits",
            ),
            "the wrong server key": (CurveClientKeys.from_files(stranger.server_public, keys.client_secret), "server's public key"),
        }
        for what, (curve, says) in refused.items():
            with pytest.raises(HandshakeRefused) as info:
                _client(curve_server.url, curve=curve, connect_timeout_s=2.0)
            message = str(info.value)
            assert "refused the handshake (CurveZMQ)" in message and says in message, f"{what}: {message}"
            assert curve_server.url in message
        # The admitted client, connected all along, is still served; nothing of the refused is there.
        t = make_tokens(3 * CHUNK, seed)
        kv = make_kv(LAYOUT, len(t), seed)
        assert good.store(t, kv) == 3 * CHUNK
        assert_bytes_equal(good.retrieve(t), kv)
        after = httpx.get(f"{curve_server.http_url}/status", timeout=10).json()
        assert after["l1"]["objects"] == before["l1"]["objects"] + 3, "only the admitted client's 3 chunks were stored"
        assert after["clients"] == before["clients"], "a refused client was registered"
        assert scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="auth") >= 1
        assert scrape_metric(curve_server.http_url, "kvdepot_handshake_failures_total", reason="protocol") >= 2
        assert curve_server.proc.poll() is None
    finally:
        good.close()


@pytest.mark.parametrize("settings_cls", [ConnectorConfig, SGLangSettings], ids=["vllm", "sglang"])
def test_the_connectors_settings_carry_the_keys_to_the_socket(curve_server, keys, settings_cls, seed):
    extra = {
        "url": curve_server.url,
        "transport": "inline",
        "curve_server_key": str(keys.server_public),
        "curve_client_key": str(keys.client_secret),
    }
    settings = settings_cls.from_extra(extra)
    assert settings.curve() == keys.client()
    rc = ResilientClient(settings, MODEL, LAYOUT, CHUNK)
    try:
        assert rc.options.curve == keys.client()
        client = rc.connected()
        assert client is not None, rc.tally.snapshot()
        t = make_tokens(2 * CHUNK, seed)
        kv = make_kv(LAYOUT, len(t), seed)
        assert client.store(t, kv) == 2 * CHUNK
        assert_bytes_equal(client.retrieve(t), kv)
    finally:
        rc.close()
    # Without the keys, the connector's connection is refused: a transport failure (counted), no crash.
    plain = ResilientClient(settings_cls.from_extra({"url": curve_server.url, "transport": "inline"}), MODEL, LAYOUT, CHUNK)
    try:
        assert plain.connected() is None
        assert plain.tally.snapshot() == {"connect/transport": 1}
    finally:
        plain.close()
    with pytest.raises(ValueError, match="curve_server_key"):
        settings_cls.from_extra({**extra, "curve_server_key": str(keys.path / "missing.key")})
    with pytest.raises(ValueError, match="curve_client_key"):
        settings_cls.from_extra({"url": curve_server.url, "curve_server_key": str(keys.server_public)})


# --- the admin port ------------------------------------------------------------------------------------


def test_mutating_admin_requests_need_the_token_reads_stay_open(curve_server):
    base = curve_server.http_url
    r = httpx.post(f"{base}/cache/clear", json={}, timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
    r = httpx.post(f"{base}/cache/clear", json={}, headers={"Authorization": "Bearer not-the-token"}, timeout=10)
    assert r.status_code == 403, r.text
    r = httpx.put(f"{base}/quota/tenant-a", json={"quota_bytes": 1 << 20}, headers={"Authorization": "Basic " + TOKEN}, timeout=10)
    assert r.status_code == 401, r.text
    r = httpx.post(f"{base}/cache/clear", json={}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    for path in ("/status", "/healthcheck", "/metrics"):
        assert httpx.get(f"{base}{path}", timeout=10).status_code == 200, path
    log = Path(curve_server.log_path).read_text(errors="replace")
    assert "admin API refused POST /cache/clear" in log
    assert TOKEN not in log and "not-the-token" not in log
