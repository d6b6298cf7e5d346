"""Hosts as Linux network namespaces joined by a bridge: a multi-node network on one machine.

``Network`` creates a bridge in this (the root) namespace with an address of its own, so the test
process is a host on the network too, and ``add_host`` makes a namespace with a veth pair whose far end
is on the bridge. ``cut``/``heal`` take a host's link down and up (a partition). Everything is removed
at ``close``. Needs root (CAP_NET_ADMIN); ``available()`` says whether this machine allows it.
"""

from __future__ import annotations

import os
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kvp{os.getpid() % 100000}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return ""


class Network:
    def __init__(self, subnet: int) -> None:
        """Hosts get 10.231.``subnet``.N; this process is 10.231.``subnet``.254."""
        self.tag = f"{os.getpid() % 10000:04d}{subnet % 100:02d}"
        self.prefix = f"10.231.{subnet}"
        self.bridge = f"kvb{self.tag}"
        self.gateway = f"{self.prefix}.254"
        self.hosts: dict[str, tuple[str, str]] = {}  # namespace -> (host end of its veth, address)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, index: int) -> tuple[str, str]:
        """A namespace with address ``prefix.index``; returns (namespace, address)."""
        ns, host_end, ns_end = f"kvn{self.tag}{index}", f"kvh{self.tag}{index}", f"kve{self.tag}{index}"
        address = f"{self.prefix}.{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[ns] = (host_end, address)
        return ns, address

    def cut(self, ns: str) -> None:
        _ip("link", "set", self.hosts[ns][0], "down")

    def heal(self, ns: str) -> None:
        _ip("link", "set", self.hosts[ns][0], "up")

    def close(self) -> None:
        for ns, (host_end, _) in self.hosts.items():
            _ip("link", "del", host_end, check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
