"""Operating a server: misconfigurations an operator meets end in one clear error at start (or in the
setup that was meant), never in a traceback or a server that starts and then refuses everyone.

- CurveZMQ key files: one unusable file among the admitted clients (``--curve-clients DIR``) is named
  at start; before, zmq.auth's loader gave up on the whole directory with a log line and every client
  was refused. A damaged secret key is named too, not a ZMQError traceback.
- The admin token: one read from a file ends in a newline no Authorization header can carry; it is the
  token without it (before, every mutating request was refused as a wrong token).
- Two of the server's own ports on one number are named as such at start, not as a port "in use (another
  process listens there)".
- A peer flooding the KV-events replay socket with malformed requests gets a few log lines, then a count.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import httpx
import pytest
from support.servers import CHUNK, LAYOUT, MODEL, SMALL_L1, make_kv, make_tokens

from kvdepot import ClientOptions, CurveClientKeys, KVClient
from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.config import HttpConfig, ObservabilityConfig, RpcConfig, ServerConfig
from kvdepot.errors import ConfigError, HandshakeRefused
from kvdepot.observability import kv_events
from kvdepot.observability.kv_events import END_OF_REPLAY, KVEventsPublisher
from kvdepot.rpc.security import CurveServerKeys, load_key_pair, write_key_files
from kvdepot.server.main import rpc_security


def _server_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdepot.cli", "server", "--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1,
                           "--no-prefault", *args], capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture
def keys(tmp_path):
    return write_key_files(tmp_path / "keys")


# --- CurveZMQ key files ----------------------------------------------------------------------------------


def test_one_unusable_client_key_file_is_named_at_start_not_a_server_that_refuses_everyone(keys):
    (keys["clients"] / "broken.key").write_text("# an empty certificate\n")
    with pytest.raises(ValueError, match="broken.key"):
        CurveServerKeys(keys["server_secret"], keys["clients"])
    rpc = RpcConfig(curve_server_key=str(keys["server_secret"]), curve_clients=str(keys["clients"]))
    with pytest.raises(ConfigError, match=r"--curve-clients: .*broken\.key"):
        rpc_security(rpc)


def test_a_damaged_secret_key_file_is_a_clear_error_not_a_traceback(keys, tmp_path):
    text = keys["server_secret"].read_text()
    public, secret = load_key_pair(keys["server_secret"])
    truncated = tmp_path / "truncated.key_secret"
    truncated.write_text(text.replace(secret.decode(), secret.decode()[:12]))
    mismatched = tmp_path / "mismatched.key_secret"  # another pair's secret under this public key
    _, other_secret = load_key_pair(keys["client_secret"])
    mismatched.write_text(text.replace(secret.decode(), other_secret.decode()))
    for bad, needle in ((truncated, "not a 40-character Z85"), (mismatched, "not the one of its secret key")):
        with pytest.raises(ValueError, match=needle):
            load_key_pair(bad)
    r = _server_cli("--port", str(free_port()), "--http-port", "0", "--shm-dir", str(tmp_path),
                    "--curve-server-key", str(truncated), "--curve-clients", str(keys["clients"]))  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--curve-server-key" in r.stderr and "truncated.key_secret" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("kvdepot-")], "an arena was reserved by a server that refused to start"


def test_a_directory_of_client_keys_still_admits_each_of_them_and_no_one_else(keys, tmp_path, seed):
    second = write_key_files(tmp_path / "second")
    (keys["clients"] / "second.key").write_bytes(second["client_public"].read_bytes())
    stranger = write_key_files(tmp_path / "stranger")
    proc = ServerProcess(
        args=["--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1, "--no-prefault", "--shm-dir", str(tmp_path),
              "--curve-server-key", str(keys["server_secret"]), "--curve-clients", str(keys["clients"])],  # fmt: skip
        http_port=0,
        log_path=str(tmp_path / "server.log"),
        curve=CurveClientKeys.from_files(keys["server_public"], keys["client_secret"]),
    )
    proc.start()
    try:
        tokens = make_tokens(2 * CHUNK, seed)
        for pair in (keys, second):
            curve = CurveClientKeys.from_files(keys["server_public"], pair["client_secret"])
            with KVClient(proc.url, MODEL, LAYOUT, options=ClientOptions(timeout_s=10.0, transport="inline"), curve=curve) as client:
                client.store(tokens, make_kv(LAYOUT, len(tokens), seed))
                assert client.lookup(tokens) == len(tokens)
        curve = CurveClientKeys.from_files(keys["server_public"], stranger["client_secret"])
        with pytest.raises(HandshakeRefused):
            KVClient(proc.url, MODEL, LAYOUT, options=ClientOptions(timeout_s=3.0, connect_timeout_s=3.0, transport="inline"), curve=curve)
    finally:
        assert proc.stop() == 0


# --- the admin token ---------------------------------------------------------------------------------------


def test_an_admin_token_read_from_a_file_with_its_newline_still_authorises(make_server):
    server = make_server("--admin-token", "tok-from-a-file\n")
    url = f"{server.http}/cache/clear"
    r = httpx.post(url, json={}, headers={"Authorization": "Bearer tok-from-a-file"}, timeout=10)
    assert r.status_code == 200, r.text
    r = httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 403, r.text
    assert httpx.post(url, json={}, timeout=10).status_code == 401


def test_a_blank_or_unsendable_admin_token_is_refused_at_start():
    # Blank: no token at all, so off loopback the server needs a real one (or --insecure).
    with pytest.raises(ConfigError, match="--admin-token"):
        ServerConfig(http=HttpConfig(host="0.0.0.0", admin_token=" \n"), insecure=False)
    with pytest.raises(ConfigError, match="printable ASCII") as info:
        HttpConfig(admin_token="pässwörd")
    assert "pässwörd" not in str(info.value)


# --- --http-allowed-hosts ----------------------------------------------------------------------------------


def test_allowed_hosts_written_as_a_url_shows_them_are_allowed(make_server):
    """A name with the port it is reached on, a bracketed IPv6 address or a whole URL was kept as typed,
    matched no Host header, and the server went on refusing (421) the name the operator had allowed."""
    server = make_server("--http-allowed-hosts", "kv.internal:8080,[fd00::1],http://other.example:9000")
    for host in (f"kv.internal:{server.http_port}", f"[fd00::1]:{server.http_port}", "other.example"):
        r = httpx.get(f"{server.http}/healthcheck", headers={"Host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)
    for host in ("http", "evil.example"):  # what the URL's pieces are not
        assert httpx.get(f"{server.http}/healthcheck", headers={"Host": host}, timeout=10).status_code == 421


# --- endpoints -------------------------------------------------------------------------------------------


def test_an_ipc_path_that_cannot_be_had_is_named_as_such(tmp_path):
    """An --ipc-path in a directory that does not exist was reported as ``--host 127.0.0.1: No such file
    or directory``: the operator looked at the wrong flag."""
    missing = tmp_path / "no-such-dir" / "s.ipc"
    r = _server_cli("--port", str(free_port()), "--http-port", "0", "--shm-dir", str(tmp_path), "--ipc-path", str(missing))
    assert r.returncode == 2, r.stderr
    assert "--ipc-path" in r.stderr and "no-such-dir" in r.stderr and "--host" not in r.stderr, r.stderr


def test_an_ipc_path_that_is_not_a_socket_is_refused_and_left_as_it_was(tmp_path):
    """The claim unlinked whatever was at --ipc-path ("a dead server's stale socket"): a regular file
    named there by mistake was deleted and the server started; a directory there ended in
    ``kvdepot server: [Errno 21] Is a directory`` (exit 1), naming no flag."""
    precious = tmp_path / "precious.txt"
    precious.write_text("an operator's data")
    directory = tmp_path / "a-directory"
    directory.mkdir()
    for path in (precious, directory):
        r = _server_cli("--port", str(free_port()), "--http-port", "0", "--shm-dir", str(tmp_path), "--ipc-path", str(path), timeout=20)
        assert r.returncode == 2, r.stderr
        assert "--ipc-path" in r.stderr and str(path) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert precious.read_text() == "an operator's data", "the server deleted the file at --ipc-path"
    assert directory.is_dir()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("kvdepot-")], "an arena was reserved by a server that refused to start"


def test_a_shm_dir_that_cannot_hold_the_arena_is_named_with_its_flag(tmp_path):
    """``--shm-dir /no/such/dir`` (or a file) ended in ``kvdepot server: [Errno 2] No such file or
    directory: '/no/such/dir'`` with exit 1: no flag named, and not the exit 2 of a bad configuration."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for shm_dir in (tmp_path / "no-such-dir", a_file):
        r = _server_cli("--port", str(free_port()), "--http-port", "0", "--shm-dir", str(shm_dir))
        assert r.returncode == 2, r.stderr
        assert "--shm-dir" in r.stderr and str(shm_dir) in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_two_tiers_under_one_name_are_refused_at_start(tmp_path):
    """``--l2 memory:name=a --l2 memory:name=a`` started: /status, the metrics' tier label, a clear's
    reply (tier name -> removed) and the KV events' medium then merged the two tiers into one."""
    r = _server_cli("--port", str(free_port()), "--http-port", "0", "--shm-dir", str(tmp_path),
                    "--l2", "memory:name=a,size_gb=0.01", "--l2", "memory:name=a,size_gb=0.01", timeout=20)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--l2" in r.stderr and "'a'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("kvdepot-")], "an arena was reserved by a server that refused to start"


# --- the server's own ports ------------------------------------------------------------------------------


def test_rpc_and_http_on_one_port_name_both_flags_not_another_process(tmp_path):
    """``--port 8080 --http-port 8080`` said "127.0.0.1:8080 is in use (another process listens there)":
    the operator looked for a process that was this server itself."""
    port = free_port()
    r = _server_cli("--port", str(port), "--http-port", str(port), "--shm-dir", str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "--port and --http-port" in r.stderr and str(port) in r.stderr, r.stderr
    assert "another process" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("kvdepot-")], "an arena was reserved by a server that refused to start"


def test_every_pair_of_the_servers_own_listeners_is_checked_and_distinct_addresses_are_not_a_collision():
    with pytest.raises(ConfigError, match="--port and --prometheus-port are both port 9100"):
        ServerConfig(rpc=RpcConfig(port=9100), http=HttpConfig(prometheus_port=9100))
    with pytest.raises(ConfigError, match="--http-port and --kv-events-endpoint are both port 8080"):
        ServerConfig(observability=ObservabilityConfig(kv_events_endpoint="tcp://127.0.0.1:8080"))
    with pytest.raises(ConfigError, match="--port and --kv-events-replay-endpoint"):
        ServerConfig(observability=ObservabilityConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint="tcp://*:5555"),
                     insecure=True)  # fmt: skip
    with pytest.raises(ConfigError, match="--port and --http-port"):  # --insecure skips the loopback rule, not this one
        ServerConfig(rpc=RpcConfig(host="0.0.0.0", port=8080), http=HttpConfig(host="127.0.0.1"), insecure=True)
    # Not one socket address: each binds.
    ServerConfig(rpc=RpcConfig(host="127.0.0.1", port=8080), http=HttpConfig(host="::1"))
    ServerConfig(rpc=RpcConfig(host="127.0.0.1", port=8080), http=HttpConfig(host="127.0.0.2"))
    ServerConfig(observability=ObservabilityConfig(kv_events_endpoint="tcp://127.0.0.1:8080", kv_events_connect=True))  # connects: no listener


# --- the KV-events replay socket's log -----------------------------------------------------------------------


class _FrozenClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _replay_request_answered(sock) -> None:
    """Send a well-formed request and read to its end marker: every request sent before it was handled."""
    sock.send_multipart([b"", (0).to_bytes(8, "big"), b"no-such-topic"])
    while True:
        assert sock.poll(10_000), "no reply from the replay socket"
        if sock.recv_multipart()[2] == END_OF_REPLAY:
            return


def test_a_flood_of_malformed_replay_requests_logs_a_few_lines_then_a_count(tmp_path, caplog):
    """Every malformed request was one warning: a peer that can reach the (unauthenticated) replay socket
    filled the log at the rate it could send."""
    import zmq

    flood = 200
    pub = KVEventsPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    clock = _FrozenClock()
    if hasattr(pub, "_malformed"):  # the interval is not what is tested: no line is due to time passing
        pub._malformed._clock = clock
    caplog.set_level(logging.WARNING, logger=kv_events.__name__)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind()
        pub.start()
        sock.connect(f"ipc://{tmp_path}/replay")
        for _ in range(flood):
            sock.send_multipart([b"", b"not 8 bytes"])
        _replay_request_answered(sock)

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == kv_events.__name__ and "malformed" in r.getMessage()]

        first = kv_events.MALFORMED_LOG_FIRST
        assert len(lines()) == first, f"{len(lines())} lines for {flood} malformed requests"
        clock.now += kv_events.MALFORMED_LOG_EVERY_S  # the interval passes: the count is logged, once
        for _ in range(2):  # the second is read after the loop went round once more past the first
            _replay_request_answered(sock)
        assert len(lines()) == first + 1, lines()
        assert f"ignored {flood - first} more" in lines()[-1] and f"{flood} in all" in lines()[-1], lines()[-1]
    finally:
        sock.close(linger=0)
        ctx.term()
        pub.close()
