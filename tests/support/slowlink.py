"""A slow, lossy or odd link between this host and one network namespace, where ``tc netem`` is missing.

``SlowLink`` makes a namespace whose only link to this (the root) namespace is a pair of TUN devices,
one on each side, joined by a small forwarder process (this file run as a program): every IP packet
crosses it, and it can hold each one for a delay (with jitter: packets then overtake each other),
drop a share of them, or drop all of them (a cut). The root side is ``gateway`` (nodes of the test
process listen there), the namespace side ``address``. Rate limits and MTUs are the kernel's own
(``tbf`` on the root TUN device, ``ip link set mtu``). Needs root; everything goes at ``close``.

The forwarder takes commands on stdin: ``set DELAY_S JITTER_S LOSS`` (LOSS a fraction), ``cut``,
``heal``.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


class SlowLink:
    def __init__(self, tag: str, subnet: int) -> None:
        """Namespace ``rvnet{tag}`` with address 10.232.``subnet``.2; this host is 10.232.``subnet``.1."""
        self.ns = f"rvnet{tag}"
        self.root_dev, self.ns_dev = f"rvtr{tag}", f"rvtn{tag}"
        self.gateway, self.address = f"10.232.{subnet}.1", f"10.232.{subnet}.2"
        _ip("netns", "add", self.ns)
        try:
            env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
            self.proc = subprocess.Popen([sys.executable, "-m", "support.slowlink", self.root_dev, self.ns, self.ns_dev],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the link's forwarder did not start")
            _ip("addr", "add", self.gateway, "peer", self.address, "dev", self.root_dev)
            _ip("link", "set", self.root_dev, "up")
            _ip("-n", self.ns, "addr", "add", self.address, "peer", self.gateway, "dev", self.ns_dev)
            _ip("-n", self.ns, "link", "set", self.ns_dev, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def set(self, delay_s: float = 0.0, jitter_s: float = 0.0, loss: float = 0.0) -> None:
        """Each packet, each way, held ``delay_s`` ± ``jitter_s``; ``loss`` of them dropped."""
        self._say(f"set {delay_s} {jitter_s} {loss}")

    def rate(self, rate: str | None) -> None:
        """Limit what this host sends into the namespace (``"20mbit"``); None: no limit."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.root_dev, "root"], capture_output=True)
        if rate:
            subprocess.run(["tc", "qdisc", "add", "dev", self.root_dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                           check=True, capture_output=True)  # fmt: skip
            subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_dev, "root", "tbf", "rate", rate,
                            "burst", "32kbit", "latency", "400ms"], check=True, capture_output=True)  # fmt: skip
        else:
            subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.ns_dev, "root"], capture_output=True)

    def cut(self) -> None:
        self._say("cut")

    def heal(self) -> None:
        self._say("heal")

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _ip("link", "del", self.root_dev, check=False)
        _ip("netns", "del", self.ns, check=False)


def _forward(root_dev: str, ns: str, ns_dev: str) -> None:
    root_fd = _open_tun(root_dev)
    _setns(f"/var/run/netns/{ns}")
    ns_fd = _open_tun(ns_dev)
    other = {root_fd: ns_fd, ns_fd: root_fd}
    delay = jitter = loss = 0.0
    cut = False
    queue: list[tuple[float, int, int, bytes]] = []  # (due, seq, fd to write, packet)
    seq = 0
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
        ready, _, _ = select.select([root_fd, ns_fd, stdin], [], [], timeout)
        for fd in ready:
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    return
                parts = line.split()
                if parts[0] == "set":
                    delay, jitter, loss = float(parts[1]), float(parts[2]), float(parts[3])
                elif parts[0] == "cut":
                    cut = True
                elif parts[0] == "heal":
                    cut = False
                print("ok", flush=True)
                continue
            for _ in range(64):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if cut or (loss and random.random() < loss):
                    continue
                due = time.monotonic() + max(0.0, delay + random.uniform(-jitter, jitter))
                seq += 1
                heapq.heappush(queue, (due, seq, other[fd], packet))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, packet = heapq.heappop(queue)
            try:
                os.write(fd, packet)
            except OSError:
                pass  # the device is down or its queue is full: the packet is lost


if __name__ == "__main__":
    _forward(*sys.argv[1:4])
