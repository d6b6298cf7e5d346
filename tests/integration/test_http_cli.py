"""The HTTP API and the ``kvdepot`` command."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

import kvdepot
from kvdepot.bench.serverproc import free_port
from kvdepot.protocol import codec
from kvdepot.protocol.messages import PingRequest

from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens

PY = sys.executable


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvdepot.cli", *args], capture_output=True, text=True, timeout=timeout)


# --- HTTP ---------------------------------------------------------------------------------------------


def test_healthcheck(make_server):
    srv = make_server()
    r = httpx.get(f"{srv.http}/healthcheck", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_status_document(make_server, seed):
    srv = make_server()
    st = srv.status()
    for key in ("version", "chunk_size", "l1", "leases", "contexts", "sessions", "tiers"):
        assert key in st, key
    for key in ("capacity_bytes", "used_bytes", "objects"):
        assert key in st["l1"], key
    assert st["version"] == kvdepot.__version__
    assert st["chunk_size"] == CHUNK
    assert st["l1"]["capacity_bytes"] == 64 << 20
    assert (st["l1"]["used_bytes"], st["l1"]["objects"], st["leases"], st["contexts"], st["sessions"]) == (0, 0, 0, 0, 0)
    assert st["tiers"] == []

    with srv.client() as a, srv.client(srv.ipc_url, transport="inline") as b:
        ta, tb = make_tokens(5 * CHUNK, seed), make_tokens(3 * CHUNK + 2, seed + 1)
        assert a.store(ta, make_kv(LAYOUT, len(ta), seed)) == 5 * CHUNK
        assert b.store(tb, make_kv(LAYOUT, len(tb), seed)) == 3 * CHUNK
        assert a.lookup_chunks(a.hashes(ta), session_id="q") == 5
        st = srv.status()
        assert st["l1"]["objects"] == 8
        assert st["l1"]["used_bytes"] == 8 * LAYOUT.chunk_bytes(CHUNK)
        assert st["contexts"] == 2
        assert st["sessions"] == 1
        assert st["leases"] == 1
        a.end_session("q")
        with a.prepare_store(make_tokens(2 * CHUNK, seed + 2)):
            st = srv.status()
            assert st["leases"] == 1
            assert st["l1"]["objects"] == 10 and st["l1"]["used_bytes"] == 10 * LAYOUT.chunk_bytes(CHUNK)
    st = srv.status()
    assert (st["leases"], st["contexts"], st["sessions"], st["l1"]["objects"]) == (0, 0, 0, 10)


def test_cache_clear(make_server, seed):
    srv = make_server()
    with srv.client() as c:
        prompts = [make_tokens((2 + i) * CHUNK, seed + i) for i in range(3)]
        for i, t in enumerate(prompts):
            assert c.store(t, make_kv(LAYOUT, len(t), i)) == len(t)
        r = httpx.post(f"{srv.http}/cache/clear", json={}, timeout=10)
        assert r.status_code == 200
        assert r.json() == {"removed": 2 + 3 + 4, "tiers_removed": {}}
        for t in prompts:
            assert c.lookup(t) == 0
            assert c.retrieve(t).shape[2] == 0
        st = srv.status()
        assert st["l1"]["objects"] == 0 and st["l1"]["used_bytes"] == 0
        # And L1 works normally afterwards.
        kv = make_kv(LAYOUT, len(prompts[0]), 9)
        assert c.store(prompts[0], kv) == len(prompts[0])
        assert_bytes_equal(c.retrieve(prompts[0]), kv)
        assert httpx.post(f"{srv.http}/cache/clear", json={}, timeout=10).json() == {"removed": 2, "tiers_removed": {}}
        assert httpx.post(f"{srv.http}/cache/clear", json={"scope": "l1"}, timeout=10).json()["removed"] == 0
        assert httpx.post(f"{srv.http}/cache/clear", json={"scope": "l2"}, timeout=10).status_code == 422


def test_client_clear_is_the_same_operation(make_server, seed):
    srv = make_server()
    with srv.client() as c:
        t = make_tokens(4 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 4 * CHUNK
        assert c.clear() == 4
        assert c.lookup(t) == 0


def test_http_off_with_port_zero(make_server):
    srv = make_server(http=False)
    with srv.client() as c:
        assert c.ping()
    assert srv.http_port == 0


# --- CLI ----------------------------------------------------------------------------------------------


def _help_blocks(text: str) -> dict[str, str]:
    """Option string -> its help block (the lines from the option to the next option)."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_server_help_shows_every_option_with_its_default():
    r = _cli("server", "--help")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    blocks = _help_blocks(text)
    from kvdepot.cli import build_parser

    server_parser = build_parser()._subparsers._group_actions[0].choices["server"]
    options = [a for a in server_parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10
    for action in options:
        opt = action.option_strings[-1]
        assert opt in blocks, f"{opt} is missing from --help"
        if action.nargs == 0 or (isinstance(action, argparse._AppendAction) and not action.default):
            continue  # a flag, or a repeatable option that is empty unless given: no value to default
        assert "(default:" in blocks[opt], f"{opt} shows no default: {blocks[opt]!r}"
    expected = {
        "--host": "127.0.0.1",
        "--port": "5555",
        "--http-port": "8080",
        "--chunk-size": "256",
        "--hash-algorithm": "sha256",
        "--eviction-policy": "lru",
        "--l1-size-gb": "2.0",
        "--lease-ttl-s": "60.0",
    }
    for opt, default in expected.items():
        assert f"(default: {default})" in blocks[opt], (opt, blocks[opt])
    for choice in ("sha256", "blake3", "xxh3_128"):
        assert choice in blocks["--hash-algorithm"]
    assert "--ipc-path" in blocks


def test_server_help_states_each_default_once_and_unambiguously():
    blocks = _help_blocks(_cli("server", "--help").stdout)
    for opt, block in blocks.items():
        assert block.count("(default:") <= 1, f"{opt}: {block!r}"
    assert "(default: True)" not in blocks["--no-prefault"]


def test_server_help_has_the_l2_option():
    blocks = _help_blocks(_cli("server", "--help").stdout)
    assert "--l2" in blocks
    for kind in ("fs", "memory"):
        assert kind in blocks["--l2"]


def test_server_help_has_the_contract_eviction_policies():
    blocks = _help_blocks(_cli("server", "--help").stdout)
    for policy in ("lru", "isolated_lru", "noop"):
        assert policy in blocks["--eviction-policy"]


def _start_and_classify(args: list[str], timeout_s: float = 30.0) -> tuple[int | None, str]:
    """Run ``kvdepot server ARGS`` on a free port; (exit code, output) if it exits, (None, output) if it
    came up and answered PING instead (then it is stopped)."""
    port = free_port()
    proc = subprocess.Popen(
        [PY, "-m", "kvdepot.cli", "server", "--port", str(port), "--http-port", "0", "--no-prefault", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return proc.returncode, proc.stdout.read()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            s.send_multipart(codec.encode_request(1, PingRequest()))
            answered = s.poll(200)
            s.close()
            if answered:
                return None, ""
        raise AssertionError(f"kvdepot server {args} neither exited nor answered within {timeout_s}s")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--l1-size-gb", "-1"], "--l1-size-gb"),
        (["--l1-size-gb", "0"], "--l1-size-gb"),
        (["--port", "abc"], "--port"),
        (["--hash-algorithm", "md5"], "--hash-algorithm"),
        (["--eviction-policy", "fifo"], "--eviction-policy"),
        (["--low-watermark", "0.9", "--high-watermark", "0.5"], "--low-watermark"),
        (["--max-frame-mib", "0"], "--max-frame-mib"),
        (["--chunk-size", "0"], "--chunk-size"),
        (["--lease-ttl-s", "0"], "--lease-ttl-s"),
        (["--workers", "0"], "--workers"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-option"], "unrecognized arguments"),
        (["--heartbeat-interval-s", "-1"], "--heartbeat-interval-s"),
        (["--client-timeout-s", "0"], "--client-timeout-s"),
        (["--client-timeout-s", "0.5", "--heartbeat-interval-s", "1"], "--client-timeout-s"),
        (["--http-port", "70000"], "--http-port"),
    ],
)
def test_invalid_option_values_exit_with_a_clear_message(args, needle):
    rc, out = _start_and_classify(args)
    assert rc is not None, f"kvdepot server {args} started instead of refusing"
    assert rc == 2, out
    assert needle in out
    assert "Traceback" not in out


def test_no_endpoint_is_refused():
    r = _cli("server", "--port", "0", "--http-port", "0", timeout=30)
    assert r.returncode == 2
    assert "no endpoint" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "option, value",
    [("--l1-size-gb", "nan"), ("--l1-size-gb", "inf"), ("--lease-ttl-s", "nan"), ("--client-timeout-s", "inf")],
)
def test_non_finite_values_are_refused(option, value):
    rc, out = _start_and_classify([option, value])
    assert rc == 2, f"rc={rc}: {out[-500:]}"
    assert option in out and "Traceback" not in out


def _occupied_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("which", ["rpc", "http", "both"])
def test_a_port_in_use_is_a_configuration_error_named_before_any_memory_is_reserved(tmp_path, which):
    """Exit 2 with one line naming the flag and the port (both, when both are taken), and leave no
    arena behind. The L1 asked for is larger than the machine could ever give: were the arena reserved
    before the ports were bound, the error would be about --l1-size-gb instead."""
    rpc_blocker, rpc_port = _occupied_port()
    http_blocker, http_port = _occupied_port()
    with rpc_blocker, http_blocker:
        ports = {
            "rpc": [rpc_port, free_port()],
            "http": [free_port(), http_port],
            "both": [rpc_port, http_port],
        }[which]
        args = ["--port", str(ports[0]), "--http-port", str(ports[1]), "--l1-size-gb", "1000000", "--l1-over-memory"]
        cmd = [PY, "-m", "kvdepot.cli", "server", *args, "--shm-dir", str(tmp_path)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("the server neither started nor exited (hung)")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    if which in ("rpc", "both"):
        assert f"--port {rpc_port}:" in lines[0] and "is in use" in lines[0]
    if which in ("http", "both"):
        assert f"--http-port {http_port}:" in lines[0]
    assert "--l1-size-gb" not in lines[0], "the arena was reserved before the ports were bound"
    assert os.listdir(tmp_path) == [], "the arena segment was left behind"


def test_an_address_that_cannot_be_listened_on_is_named(tmp_path):
    r = _cli("server", "--host", "192.0.2.1", "--insecure", "--http-port", "0", "--shm-dir", str(tmp_path), timeout=30)  # TEST-NET-1
    assert r.returncode == 2 and "--host 192.0.2.1:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_status_command_prints_the_servers_json(make_server, seed):
    srv = make_server()
    with srv.client() as c:
        t = make_tokens(3 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 3 * CHUNK
    r = _cli("status", "--http-port", str(srv.http_port), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["version"] == kvdepot.__version__
    assert doc["chunk_size"] == CHUNK
    assert doc["l1"]["objects"] == 3
    assert doc["l1"]["capacity_bytes"] == 64 << 20
    assert doc["leases"] == 0
    # The installed console script says the same.
    script = Path(PY).parent / "kvdepot"
    if script.exists():
        r2 = subprocess.run([str(script), "status", "--http-port", str(srv.http_port), "--json"], capture_output=True, text=True, timeout=60)
        assert r2.returncode == 0
        assert json.loads(r2.stdout)["l1"]["objects"] == 3


def test_status_command_summarises_hits_for_people(make_server, seed):
    srv = make_server()
    t = make_tokens(4 * CHUNK, seed)
    with srv.client(model="llama-test") as c:
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 4 * CHUNK
        assert c.lookup(t) == 4 * CHUNK
        assert c.lookup(make_tokens(4 * CHUNK, seed + 1)) == 0
    r = _cli("status", "--url", srv.http)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"HTTP {srv.http}" in out
    assert f"hit rate 50.0% ({4 * CHUNK:,} found: l1 {4 * CHUNK:,}; {4 * CHUNK:,} missed)" in out, out
    assert "llama-test: 2 lookups, hit rate 50.0%" in out
    assert "stored 4 chunks" in out and "4 objects" in out


def test_status_command_without_a_server():
    r = _cli("status", "--http-port", str(free_port()))
    assert r.returncode == 1
    assert "cannot connect" in r.stderr and "Connection refused" in r.stderr, r.stderr


def test_status_command_pointed_at_the_zeromq_port_says_so_at_once(make_server):
    """kvdepot's ZeroMQ port answers a connection with ZeroMQ's greeting and then waits: the command
    recognises it, well within its one-second probe, instead of waiting out the /status timeout."""
    srv = make_server()
    r = _cli("status", "--http-port", str(srv.port), "--timeout-s", "60", timeout=30)
    assert r.returncode == 1
    assert "is a ZeroMQ endpoint (kvdepot's --port), not its HTTP API" in r.stderr, r.stderr


def test_status_help_documents_every_flag():
    r = _cli("status", "--help")
    assert r.returncode == 0
    for flag in ("--http-host", "--http-port", "--url", "--timeout-s", "--json"):
        assert flag in r.stdout
    assert "(default: 127.0.0.1)" in r.stdout and "(default: 8080)" in r.stdout


def test_status_command_prints_no_terminal_control_from_clients(make_server, seed):
    """Model names and ``cache_salt`` values are any string a client (or, through vLLM's ``cache_salt``,
    an engine's user) chooses, and the summary printed them raw: an escape sequence in one cleared the
    operator's screen, retitled the terminal, or rewrote the lines above it (a carriage return). They
    are shown escaped, and still tell tenants apart."""
    srv = make_server()
    model = "llama\x1b]0;owned\x07"
    salt = "t\r  tenant     ok: 0 B\x1b[2K\x1b[1A\u202e"
    t = make_tokens(2 * CHUNK, seed)
    with srv.client(model=model) as c:
        assert c.store(t, make_kv(LAYOUT, len(t), seed), cache_salt=salt) == 2 * CHUNK
        assert c.lookup(t, cache_salt=salt) == 2 * CHUNK
    srv.wait_status(lambda st: st["tenants"])
    r = _cli("status", "--url", srv.http)
    assert r.returncode == 0, r.stderr
    control = sorted({hex(ord(ch)) for ch in r.stdout if ch != "\n" and not ch.isprintable()})
    assert not control, f"the summary writes control characters to the terminal: {control}\n{r.stdout!r}"
    assert "llama\\x1b]0;owned\\x07: 1 lookups" in r.stdout, r.stdout
    assert "tenant     t\\r  tenant     ok: 0 B\\x1b[2K\\x1b[1A\\u202e: " in r.stdout, r.stdout
