"""Real ``kvdepot server`` processes for the tests, and the data and waiting helpers that go with them.

Every server is a child process started through ``kvdepot.bench.serverproc.ServerProcess`` (the one
launcher, shared with the demo and the benchmarks); tests talk to it over tcp://127.0.0.1 and ipc://,
and read its HTTP ``/status``. Servers are small (16-64 MiB of L1, chunks of 16 tokens unless a test
says otherwise) so the whole suite stays quick on two cores. ``RawPeer`` speaks the protocol by hand
(for malformed and hostile input). The fixtures are in ``plugin.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.identity import local_client_info

CHUNK = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32)  # 512 bytes a token, 8 KiB a chunk
MODEL = "itest-model"
SMALL_L1 = "0.0625"  # GiB: 64 MiB


# --- small helpers ----------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.05, what: str = "") -> object:
    """Poll ``predicate`` until it returns something truthy (bounded); fail the test otherwise."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what or predicate} (last value {last!r})")


def scrape_metric(http_url: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` at ``http_url`` whose labels include ``labels`` (0 when it is not there yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{http_url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def pause(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped. The kernel stops a process's
    threads one by one, as each next leaves the kernel: right after ``kill`` returns, a thread of a busy
    process may still answer one more request (a flake on a loaded machine otherwise)."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = []
            for t in tasks:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            return True  # gone: nothing of it runs
        return all(st in ("T", "t") for st in states)

    wait_until(all_stopped, timeout_s=timeout_s, interval_s=0.005, what=f"every thread of {pid} to stop")


def never(predicate: Callable[[], object], within_s: float, interval_s: float = 0.05, what: str = "") -> None:
    """A negative assertion: ``predicate`` (the thing that must not happen) stays false for ``within_s``,
    checked all along (the test fails the moment it happens, not after a blind sleep)."""
    deadline = time.monotonic() + within_s
    while True:
        got = predicate()
        if got:
            pytest.fail(f"{what or predicate} happened (value {got!r})")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)


def make_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int64)


def make_kv(layout: KVLayout, n_tokens: int, seed: int) -> np.ndarray:
    """Random KV ``[K, L, n, H, D]`` whose every bit pattern is random (NaNs and all): only a byte-exact
    round trip compares equal."""
    rng = np.random.default_rng(seed + 1_000_003)
    dt = layout.storage_dtype
    raw = rng.integers(0, 256, size=int(np.prod(layout.chunk_shape(n_tokens))) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(layout.chunk_shape(n_tokens))


def as_bits(a: np.ndarray) -> np.ndarray:
    """The same array with an unsigned-int dtype of the same width (NaN-safe exact comparison)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bytes_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert np.array_equal(as_bits(np.asarray(got)), as_bits(np.asarray(want))), "bytes differ"


# --- servers ----------------------------------------------------------------------------------------


@dataclass
class Server:
    """A running ``kvdepot server`` child process, with HTTP helpers."""

    proc: ServerProcess
    log_path: Path
    ipc_dir: str | None = None

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def ipc_url(self) -> str:
        return self.proc.ipc_url

    @property
    def port(self) -> int:
        return self.proc.port

    @property
    def http_port(self) -> int:
        return self.proc.http_port

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.proc.http_port}"

    def status(self) -> dict:
        r = httpx.get(f"{self.http}/status", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_status(self, pred, timeout_s: float = 30.0) -> dict:
        """The first /status for which ``pred`` holds (or the last one seen, after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the server's ``/metrics`` (0 when it is not there yet)."""
        return scrape_metric(self.http, name, **labels)

    def leases(self) -> int:
        return self.status()["leases"]

    def clear(self) -> dict:
        r = httpx.post(f"{self.http}/cache/clear", json={}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def alive(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None

    def client(self, url: str | None = None, *, model: str = MODEL, layout: KVLayout = LAYOUT, rank: int = 0, world_size: int = 1, **options) -> KVClient:
        """A connected client of this server; ``options`` are ClientOptions fields (timeout_s 10 s here)."""
        options.setdefault("timeout_s", 10.0)
        return KVClient(url or self.url, model, layout, rank=rank, world_size=world_size, options=ClientOptions(**options))

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        return self.proc.stop()

    def start_again(self) -> None:
        """A new server process with the very same options, ports and ipc path (after ``stop``)."""
        old = self.proc
        self.proc = ServerProcess(
            args=list(old.args), port=old.port, http_port=old.http_port, ipc_path=old.ipc_path, log_path=str(self.log_path)
        )
        self.proc.start()

    def restart(self) -> None:
        """Stop the server (it must exit cleanly on SIGTERM) and start it again on the same endpoints."""
        assert self.stop() == 0, "the server must exit cleanly on SIGTERM"
        self.start_again()


def start_server(
    log_dir: Path, name: str, args: list[str], http: bool = True, ipc: bool = True, port: int = 0, base: tuple[str, ...] | None = None
) -> Server:
    """A running server (``base`` options, by default the small test ones, then ``args``: later wins)."""
    ipc_dir = tempfile.mkdtemp(prefix="kvd-")  # short: ipc paths are limited to ~107 bytes
    log_path = log_dir / f"{name}.log"
    base_args = list(base) if base is not None else ["--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1]
    for attempt in range(3):
        proc = ServerProcess(
            args=[*base_args, *args],
            port=port,
            http_port=free_port() if http else 0,
            ipc_path=os.path.join(ipc_dir, "s.ipc") if ipc else None,
            log_path=str(log_path),
        )
        try:
            proc.start()
            return Server(proc, log_path, ipc_dir)
        except RuntimeError:
            # free_port() can race with another process taking the port before the server binds it:
            # try again on fresh ports (unless the caller pinned one); a real start-up bug fails 3 times.
            proc.stop()
            if port or attempt == 2 or "in use" not in log_path.read_text(errors="replace"):
                shutil.rmtree(ipc_dir, ignore_errors=True)
                raise
    raise AssertionError("unreachable")


def stop_server(server: Server) -> None:
    try:
        server.stop()
    finally:
        if server.ipc_dir:
            shutil.rmtree(server.ipc_dir, ignore_errors=True)


# --- raw protocol peers -----------------------------------------------------------------------------


class RawPeer:
    """A bare ZeroMQ DEALER speaking kvdepot's framing by hand (for malformed and hostile input)."""

    _enc = msgspec.msgpack.Encoder()

    def __init__(self, url: str, routing_id: bytes | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id or os.urandom(12))
        self.sock.connect(url)
        self._rid = 1000
        self.context_id = 0

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def next_id(self) -> int:
        self._rid += 1
        return self._rid

    def send_frames(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=True)

    def recv(self, timeout_s: float = 10.0) -> list[bytes]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply within {timeout_s}s")
        return self.sock.recv_multipart()

    def reply_header(self, frames: list[bytes]) -> m.ReplyHeader:
        return codec.decode_reply_header(frames[0])

    def roundtrip(self, frames: list, timeout_s: float = 10.0) -> tuple[m.ReplyHeader, list[bytes]]:
        self.send_frames(frames)
        reply = self.recv(timeout_s)
        assert len(reply) >= 2, f"a reply has header and body frames, got {len(reply)}"
        return self.reply_header(reply), reply

    def error_of(self, frames: list, timeout_s: float = 10.0) -> tuple[int, int, str]:
        """Send; expect an error reply; returns (status code, request id, message)."""
        header, reply = self.roundtrip(frames, timeout_s)
        assert header.status != 0, "expected an error reply, got a success"
        err = msgspec.msgpack.decode(reply[1], type=m.ErrorReply)
        assert err.code == header.status
        return header.status, header.request_id, err.message

    def request(self, body: msgspec.Struct, payload: list = (), timeout_s: float = 10.0, version: int | None = None):
        """A well-formed request (optionally with a chosen protocol version); returns (header, frames)."""
        rid = self.next_id()
        frames = codec.encode_request(rid, body)
        if version is not None:
            rtype = codec.request_type_of(body)
            frames[0] = self._enc.encode(m.RequestHeader(version, rid, int(rtype), 0))
        header, reply = self.roundtrip([*frames, *payload], timeout_s)
        assert header.request_id == rid
        return header, reply

    def call(self, body: msgspec.Struct, payload: list = (), timeout_s: float = 10.0):
        """A well-formed request; returns the typed reply or raises the server's KVDepotError."""
        header, reply = self.request(body, payload, timeout_s)
        return codec.decode_reply_body(codec.request_type_of(body), header, reply[1])

    def register(
        self, layout: KVLayout = LAYOUT, model: str = MODEL, chunk_size: int = 0, client: m.ClientInfo | None = None
    ) -> m.RegisterContextReply:
        """Register a context. ``client``: who this peer says it is; by default this process (so the
        server can watch it through a pidfd, as it watches a KVClient); ``m.ClientInfo()`` hides it."""
        reply = self.call(
            m.RegisterContextRequest(
                protocol_version=m.PROTOCOL_VERSION,
                model=model,
                layout=m.LayoutSpec(
                    num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype
                ),
                chunk_size=chunk_size,
                client=local_client_info() if client is None else client,
            )
        )
        self.context_id = reply.context_id
        return reply

    def ping(self, timeout_s: float = 10.0) -> bool:
        return self.call(m.PingRequest(), timeout_s=timeout_s).ok


def raw_header(version: int, request_id: int, rtype: int, timeout_ms: int = 0) -> bytes:
    return msgspec.msgpack.encode(m.RequestHeader(version, request_id, rtype, timeout_ms))


def encode_body(body: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(body)
