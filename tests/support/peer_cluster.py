"""Peer-cluster nodes as real OS processes, for the fault tests.

``NodeProcess`` runs ``python -m support.peer_cluster`` (this file): a ``PeerStore`` in its own process
that takes line commands on stdin and answers one JSON line on stdout::

    set PREFIX COUNT SIZE   -> {"stored": n}           pages PREFIX0..PREFIX{COUNT-1} of SIZE bytes
    check PREFIX COUNT SIZE [VERSION]     -> {"hit": h, "miss": m, "wrong": w}   reads them back from wherever they are
    checkany PREFIX COUNT SIZE MAXVERSION -> the same, a hit being any version 0..MAXVERSION
    held PREFIX COUNT       -> {"held": [names]}       which of PREFIX0..PREFIX{COUNT-1} this node's pool holds now
    status                  -> PeerStore.status()
    quit

Page contents are a pure function of the key (``page_bytes``), so any process can check any byte it reads.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

SRC = Path(__file__).resolve().parents[2] / "src"
TESTS = Path(__file__).resolve().parents[1]


def page_bytes(key: str, size: int, version: int = 0) -> bytes:
    """What ``key`` holds (``version`` > 0: a rewritten page)."""
    return np.random.default_rng(xxhash.xxh64_intdigest(f"{key}#{version}".encode())).bytes(size)


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


class NodeProcess:
    def __init__(self, *, discovery: str = "", secret: str = "", host: str = "127.0.0.1", port: int = 0, data_port: int = 0,
                 pool_size_mb: int = 64, netns: str | None = None, extra: dict | None = None) -> None:  # fmt: skip
        self.options = {"discovery": discovery, "secret": secret, "host": host, "port": port, "data_port": data_port,
                        "pool_size_mb": pool_size_mb, "heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "timeout_s": 2.0,
                        "control_timeout_s": 0.5, "join_timeout_s": 10.0, "metrics_port": 0, **(extra or {})}  # fmt: skip
        self.netns = netns
        self.proc: subprocess.Popen | None = None
        self.node_id = ""

    def start(self, timeout_s: float = 30.0) -> NodeProcess:
        cmd = [sys.executable, "-m", "support.peer_cluster", json.dumps(self.options)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        ready = self._line(timeout_s)
        self.node_id = ready["node"]
        return self

    def command(self, line: str, timeout_s: float = 30.0) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)

    def _line(self, timeout_s: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"peer node {self.node_id or '?'} said nothing in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer node {self.node_id or '?'} exited ({self.proc.poll()})")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP, returning once every thread has stopped: right after ``kill`` one thread may still
        serve a read (a stalled owner once served 9 of 20 pages in CI)."""
        from support.servers import pause  # the test process only: node processes never pause anyone

        assert self.proc is not None
        pause(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.command("quit", timeout_s=10)
        except (TimeoutError, RuntimeError, BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def check_pages(store, prefix: str, count: int, size: int, version: int = 0, any_up_to: int | None = None) -> dict[str, int]:
    """Read every page back through ``store``: hits, misses, and wrong bytes (which must never happen).
    ``any_up_to``: a hit may be any version from 0 to it (pages rewritten while others read them)."""
    names = keys(prefix, count)
    return check_names(store, names, size, range(version, version + 1) if any_up_to is None else range(any_up_to, -1, -1))


def check_names(store, names: list[str], size: int, versions) -> dict[str, int]:
    got = store.batch_get(names)
    out = {"hit": 0, "miss": 0, "wrong": 0}
    for name, value in zip(names, got, strict=True):
        if value is None:
            out["miss"] += 1
        elif any(value == page_bytes(name, size, v) for v in versions):
            out["hit"] += 1
        else:
            out["wrong"] += 1
    return out


def _serve(options: dict) -> int:
    from kvdepot.peer import PeerStore

    store = PeerStore(**options)
    print(json.dumps({"node": store.node_id}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        op = parts[0]
        if op == "quit":
            break
        if op == "set":
            prefix, count, size = parts[1], int(parts[2]), int(parts[3])
            version = int(parts[4]) if len(parts) > 4 else 0
            names = keys(prefix, count)
            ok = store.batch_set(names, [page_bytes(n, size, version) for n in names])
            answer: dict = {"stored": sum(ok)}
        elif op == "check":
            answer = check_pages(store, parts[1], int(parts[2]), int(parts[3]), int(parts[4]) if len(parts) > 4 else 0)
        elif op == "checkany":
            answer = check_pages(store, parts[1], int(parts[2]), int(parts[3]), any_up_to=int(parts[4]))
        elif op == "held":
            answer = {"held": [n for n in keys(parts[1], int(parts[2])) if store.node.pool.contains(n.encode())]}
        elif op == "status":
            answer = store.status()
        else:
            answer = {"error": f"unknown command {op}"}
        print(json.dumps(answer), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(json.loads(sys.argv[1])))
