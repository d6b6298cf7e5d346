"""This machine's addresses, for tests of what a server does off loopback."""

from __future__ import annotations

import ipaddress
import socket
import subprocess


def non_loopback_ipv4() -> str:
    """A local IPv4 address that is not loopback ('' when the machine has none): the source address of
    the default route if there is one (connecting a UDP socket sends nothing), else the first global
    address ``ip`` lists."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # TEST-NET-1: only the routing table is consulted
            address = s.getsockname()[0]
            if _usable(address):
                return address
        except OSError:
            pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            address = parts[parts.index("inet") + 1].split("/")[0]
            if _usable(address):
                return address
    return ""


def _usable(address: str) -> bool:
    """Not loopback, not unspecified, and bindable here."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return False
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def has_ipv6_loopback() -> bool:
    """Can a socket bind ``::1`` here?"""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port6() -> int:
    """A port nothing listens on at ``::1`` right now."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]
