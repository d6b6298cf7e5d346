"""Peer addresses: node ids, discovery addresses and router hints, IPv4 and IPv6 alike.

A node is named ``HOST:PORT`` (its control port) as it tells the others. An IPv6 literal is bracketed
there (``[::1]:31995``): ``::1:31995`` could be the address ``::1:31995`` or ``::1`` on port 31995.
An IPv4 address or a host name is written as it always was (``10.0.0.2:31995``), so nodes of an
earlier version, which compare ids as strings, keep agreeing on IPv4. The host a socket binds or
connects to is always bare (``::1``): ``PeerNodeInfo.host`` carries it so.
"""

from __future__ import annotations

import ipaddress
import socket

from kvdepot.config import host_port, unbracket

__all__ = ["address_id", "canonical_host", "check_host", "hint_target", "is_ipv6_host", "listen_family", "node_id", "split_host_port"]


def is_ipv6_host(host: str) -> bool:
    """Is ``host`` (bare or bracketed) an IPv6 literal?"""
    try:
        return ipaddress.ip_address(unbracket(host)).version == 6
    except ValueError:
        return False


def canonical_host(host: str) -> str:
    """The bare host, an IPv6 literal in its one short form (``0:0::1`` and ``[::1]`` are both ``::1``,
    so two spellings of one head give one id); anything else exactly as given (IPv4 ids unchanged)."""
    bare = unbracket(host.strip())
    return str(ipaddress.ip_address(bare)) if is_ipv6_host(bare) else host.strip()


def node_id(host: str, port: int | str) -> str:
    """A node's id: ``10.0.0.2:31995``, ``[::1]:31995``."""
    return host_port(canonical_host(host), port)


def listen_family(host: str) -> socket.AddressFamily:
    """The family a socket bound to ``host`` needs: AF_INET6 for an IPv6 literal or a name whose only
    addresses are IPv6, else AF_INET as before (a name with an IPv4 address binds that one). A literal
    is decided without a lookup; a name that does not resolve stays AF_INET, and its bind says why."""
    bare = unbracket(host)
    try:
        return socket.AF_INET6 if ipaddress.ip_address(bare).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        families = {info[0] for info in socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):  # gaierror is an OSError; a name too long to encode is not
        return socket.AF_INET
    # An AF_INET socket cannot bind a name with no IPv4 address ("address family for hostname not supported").
    return socket.AF_INET6 if families == {socket.AF_INET6} else socket.AF_INET


def check_host(host: str) -> str:
    """Why ``host`` is no address a node can listen on ('' when it is one): a port or brackets around
    something other than an IPv6 address belong elsewhere."""
    bare = unbracket(host.strip())
    if bare.startswith("[") or bare.endswith("]"):
        return f"{host!r} is not an address (brackets hold an IPv6 address: [::1])"
    if ":" in bare and not is_ipv6_host(bare):
        return f"{host!r} is not an address (the port is a setting of its own)"
    return ""


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (bare host, port); ValueError saying what is wrong and how
    to write it."""
    text = address.strip()
    if text.startswith("["):
        inner, close, rest = text[1:].partition("]")
        if not close or not is_ipv6_host(inner):
            raise ValueError(f"{address!r}: brackets hold an IPv6 address ([::1]:31995)")
        if not rest.startswith(":"):
            raise ValueError(f"{address!r} has no port: write [{inner}]:PORT")
        host, port = inner, rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{address!r} is not HOST:PORT (an IPv6 address in brackets: [::1]:31995)")
        if ":" in host:  # more than one colon: an IPv6 address, whose port cannot follow unbracketed
            raise ValueError(f"{address!r} is ambiguous: write an IPv6 address in brackets, as [{host}]:{port} or [{text}]:PORT")
    return canonical_host(host), _port(address, port)


def _port(address: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{address!r}: the port must be a number from 1 to 65535")
    return int(port)


def address_id(address: str) -> str:
    """The id of the node at ``address`` (``HOST:PORT``): what its own id is, however it was spelled."""
    return node_id(*split_host_port(address))


def hint_target(hint: str) -> tuple[str, str]:
    """A router's ``host[:port]`` -> (the node id it names, '' without a port; its bare host). Never
    raises: a hint it cannot read matches no node (one round trip, then the directory)."""
    text = hint.strip()
    if text.startswith("[") and "]" in text:  # [::1] or [::1]:31995
        inner, _, rest = text[1:].partition("]")
        host = canonical_host(inner)
        return (node_id(host, rest[1:]) if rest.startswith(":") and rest[1:] else ""), host
    if is_ipv6_host(text):  # a bare IPv6 address: its last group is no port
        return "", canonical_host(text)
    host, sep, port = text.rpartition(":")
    if not sep:
        return "", text
    return (text if ":" not in host else node_id(host, port)), canonical_host(host)  # IPv4 and names: as before
