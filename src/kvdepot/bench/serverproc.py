"""Running a real ``kvdepot server`` process for the demo, the benchmarks and the tests."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from kvdepot.config import host_port, tcp_endpoint


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> str:
    """Poll ``url`` until it answers 200; '' then, else why not (the process exited, or the time ran
    out), for the caller to raise its own error with its own log."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return ""
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    return f"not healthy at {url} within {timeout_s:g} s"


# Ports this process handed out lately: a caller often asks for several before it binds any of them, and
# the kernel may offer a port again as soon as the probing socket closes.
_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=512)


def free_port(avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A loopback TCP port nothing listens on right now (and not one of ``avoid``, nor one this process
    handed out lately)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid and port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port


@dataclass
class ServerProcess:
    """``kvdepot server`` in a child process; ``start`` waits until it answers PING."""

    args: list[str] = field(default_factory=list)
    port: int = 0
    http_port: int = 0
    ipc_path: str | None = None
    env: dict[str, str] | None = None
    log_path: str | None = None
    prefix: list[str] = field(default_factory=list)  # e.g. ["unshare", "--pid", "--fork"], ["ip", "netns", "exec", NS]
    host: str = "127.0.0.1"  # --host, and where start() looks for it
    curve: object = None  # a CurveClientKeys for a server started with --curve-server-key (start() pings with it)
    scratch_dir: str | None = None  # a folder of its own (socket, log): removed on a clean exit from ``with``
    proc: subprocess.Popen | None = None
    _log: object = None

    @property
    def url(self) -> str:
        return tcp_endpoint(self.host, self.port)  # tcp://[::1]:PORT for an IPv6 host

    @property
    def http_url(self) -> str:
        return f"http://{host_port(self.host, self.http_port)}"

    @property
    def ipc_url(self) -> str:
        assert self.ipc_path
        return f"ipc://{self.ipc_path}"

    def start(self, timeout_s: float = 30.0) -> ServerProcess:
        import zmq

        # Not the HTTP port: two free_port() calls can return the same number, which the server refuses.
        self.port = self.port or free_port(avoid={self.http_port})
        cmd = [*self.prefix, sys.executable, "-m", "kvdepot.cli", "server", "--port", str(self.port), "--http-port", str(self.http_port)]
        if self.host != "127.0.0.1":
            cmd += ["--host", self.host]
        if self.ipc_path:
            cmd += ["--ipc-path", self.ipc_path]
        cmd += self.args
        out = self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if self.log_path else subprocess.DEVNULL, env=env)
        # Wait for a PING reply (the server binds before it answers).
        from kvdepot.protocol import codec
        from kvdepot.protocol.messages import PingRequest
        from kvdepot.rpc.endpoints import enable_ipv6

        ctx = zmq.Context.instance()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvdepot server exited with {self.proc.returncode} (see {self.log_path})")
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            enable_ipv6(s, self.url)  # ZeroMQ refuses an IPv6 address without ZMQ_IPV6
            if self.curve is not None:
                self.curve.apply_client(s)
            s.connect(self.url)
            s.send_multipart(codec.encode_request(1, PingRequest()))
            ok = s.poll(200)
            s.close()
            if ok:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("kvdepot server did not answer within the timeout")

    def start_or_explain(self, timeout_s: float = 30.0) -> tuple[int, str] | None:
        """``start``; when the server does not come up, None is not returned but its exit code (1 when
        it had none) and its one-line reason (the last line it logged), and it is stopped."""
        try:
            self.start(timeout_s)
            return None
        except RuntimeError:
            self.stop()
        code = self.proc.returncode if self.proc is not None else None
        return (code if code and code > 0 else 1), self._last_logged() or "it did not start"

    def _last_logged(self) -> str:
        try:
            with open(self.log_path or "", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return ""
        return lines[-1].removeprefix("kvdepot server: ") if lines else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None
        return self.proc.returncode

    def status(self, timeout_s: float = 10.0) -> dict:
        """Its ``/status`` document (needs ``http_port``)."""
        with urllib.request.urlopen(f"{self.http_url}/status", timeout=timeout_s) as r:
            return json.load(r)

    def clear(self, scope: str = "l1") -> None:
        """Empty L1 (or ``tiers``, ``all``) through ``POST /cache/clear``: the next run starts afresh."""
        body = json.dumps({"scope": scope}).encode()
        req = urllib.request.Request(f"{self.http_url}/cache/clear", data=body, headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        code = self.stop()
        if self.scratch_dir and code == 0 and exc[0] is None:  # kept after a failure, for its log
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


def bench_server(l1_size_gb: float, prefix: str = "kvdepot-bench-") -> ServerProcess:
    """A server for a benchmark run (not started): tcp and an ipc socket in a fresh temporary folder
    with its log, one OpenMP thread, warnings only."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    return ServerProcess(
        args=["--l1-size-gb", str(l1_size_gb), "--log-level", "warning"],
        http_port=free_port(),
        ipc_path=os.path.join(tmp, "kvdepot.sock"),
        env={"OMP_NUM_THREADS": "1"},
        log_path=os.path.join(tmp, "server.log"),
        scratch_dir=tmp,
    )


def wait_prefault(server: ServerProcess, timeout_s: float = 300) -> float:
    """Seconds until the server's arena is pre-faulted (nothing is timed before: fresh pages fault in slowly)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        pf = server.status(timeout_s=5)["l1"]["prefault"]
        if pf["finished"]:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError("server prefault did not finish")
