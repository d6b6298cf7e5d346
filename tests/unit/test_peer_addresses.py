"""Peer addresses on IPv4 and IPv6: node ids, control endpoints, discovery addresses and router hints.

An IPv4 id stays ``HOST:PORT`` exactly as before (nodes of an earlier version compare ids as strings);
an IPv6 one is bracketed (``[::1]:31995``), since ``::1:31995`` is ambiguous; an address that cannot be
read is refused at configuration, naming the setting and how to write it.
"""

from __future__ import annotations

import argparse
import socket

import pytest

from kvdepot.bench.serverproc import ServerProcess
from kvdepot.errors import ConfigError
from kvdepot.peer import cli
from kvdepot.peer.config import PeerConfig, PeerFlags


def test_discovery_addresses_become_ids_ipv4_as_before_and_ipv6_bracketed_with_its_host_kept_bare():
    cfg = PeerConfig(discovery="10.0.0.1:31995, head.cluster:4000", host="10.0.0.2")  # IPv4 and names: exactly as before
    assert cfg.host == "10.0.0.2"
    assert cfg.bootstrap == ["10.0.0.1:31995", "head.cluster:4000"]
    assert PeerConfig().host == "127.0.0.1" and PeerConfig().bootstrap == []
    assert PeerConfig(host="[::1]").host == "::1"  # the socket APIs want it bare
    assert PeerConfig(host="::1").host == "::1"
    assert PeerConfig(host="0:0::1").host == "::1"  # one spelling, so two nodes naming one head agree
    cfg = PeerConfig(discovery="[::1]:31995,[0::1]:31997, 10.0.0.1:31995", host="::1")
    assert cfg.bootstrap == ["[::1]:31995", "[::1]:31997", "10.0.0.1:31995"]


def test_node_ids_endpoints_and_hints_bracket_ipv6_only():
    from kvdepot.peer.addresses import address_id, hint_target, node_id, split_host_port

    assert node_id("127.0.0.1", 31995) == "127.0.0.1:31995" and node_id("node-a", 1) == "node-a:1"
    assert node_id("::1", 31995) == node_id("[::1]", 31995) == "[::1]:31995"
    assert split_host_port("[::1]:31995") == ("::1", 31995) and split_host_port("10.0.0.1:31995") == ("10.0.0.1", 31995)
    assert address_id("[0:0::1]:31995") == "[::1]:31995"
    # a hint: (the node it names, '' without a port; the host, bare)
    assert hint_target("[::1]:31996") == ("[::1]:31996", "::1")
    assert hint_target("[::1]") == ("", "::1") and hint_target("::1") == ("", "::1")
    assert hint_target("10.0.0.2:31995") == ("10.0.0.2:31995", "10.0.0.2") and hint_target("10.0.0.2") == ("", "10.0.0.2")
    assert hint_target("[nonsense") == ("", "[nonsense")  # never raises: a hint that names no node is one round trip


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"discovery": "::1:31995"}, "--discovery: '::1:31995' is ambiguous: write an IPv6 address in brackets, as [::1]:31995"),
        ({"discovery": "[::1]"}, "--discovery: '[::1]' has no port"),
        ({"discovery": "10.0.0.1"}, "--discovery: '10.0.0.1' is not HOST:PORT"),
        ({"discovery": "10.0.0.1:99999"}, "the port must be a number from 1 to 65535"),
        ({"discovery": "[node-a]:1"}, "brackets hold an IPv6 address"),
        ({"host": "10.0.0.2:31995"}, "--host: '10.0.0.2:31995' is not an address (the port is a setting of its own)"),
        ({"host": "[::1]:31995"}, "--host: '[::1]:31995' is not an address"),
    ],
)
def test_a_bad_address_is_refused_naming_the_flag_and_how_to_write_it(options, says):
    with pytest.raises(ConfigError) as err:
        PeerFlags(**options)
    assert says in str(err.value)


def test_kvdepot_peer_refuses_an_ambiguous_discovery_address_and_status_node(capsys):
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    assert cli.main(parser.parse_args(["--discovery", "::1:31995"])) == 2
    assert "--discovery: '::1:31995' is ambiguous" in capsys.readouterr().err
    assert cli.main(parser.parse_args(["status", "--node", "::1:31995"])) == 2
    assert "--node '::1:31995' is ambiguous" in capsys.readouterr().err


def test_a_server_process_on_ipv6_has_bracketed_urls_and_ipv4_ones_are_as_before():
    assert ServerProcess(host="::1", port=5555, http_port=8080).url == "tcp://[::1]:5555"
    assert ServerProcess(host="::1", port=5555, http_port=8080).http_url == "http://[::1]:8080"
    assert ServerProcess(port=5555, http_port=8080).url == "tcp://127.0.0.1:5555"
    assert ServerProcess(port=5555, http_port=8080).http_url == "http://127.0.0.1:8080"


def _resolver(table: dict[str, list[socket.AddressFamily]], asked: list[str]):
    """A stand-in for ``socket.getaddrinfo`` that answers from ``table`` and records each name asked."""

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        asked.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(f, socket.SOCK_STREAM, 6, "", ("::1" if f == socket.AF_INET6 else "127.0.0.1", port or 0)) for f in table[host]]

    return getaddrinfo


def test_the_listen_family_follows_what_the_host_resolves_to_and_literals_need_no_lookup(monkeypatch):
    """A name whose only address was IPv6 bound an AF_INET socket, which cannot bind it: the data-plane
    listener failed to start on an IPv6-only host name."""
    from kvdepot.peer.addresses import listen_family

    asked: list[str] = []
    table = {"node6.test": [socket.AF_INET6], "node4.test": [socket.AF_INET], "both.test": [socket.AF_INET6, socket.AF_INET]}
    monkeypatch.setattr(socket, "getaddrinfo", _resolver(table, asked))
    assert listen_family("node6.test") == socket.AF_INET6
    assert listen_family("node4.test") == socket.AF_INET
    assert listen_family("both.test") == socket.AF_INET  # mixed: its IPv4 address, as before
    assert listen_family("nowhere.test") == socket.AF_INET  # unresolved: as before, and its bind says why
    assert asked == ["node6.test", "node4.test", "both.test", "nowhere.test"]
    asked.clear()
    for literal, family in (("::1", socket.AF_INET6), ("[::1]", socket.AF_INET6), ("::", socket.AF_INET6), ("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET)):
        assert listen_family(literal) == family, literal
    assert asked == [], "a literal needs no lookup"
