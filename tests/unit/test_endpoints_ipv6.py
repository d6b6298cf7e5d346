"""IPv6 endpoints: ``--host ::1`` made ``tcp://::1:5555``, and ZeroMQ refused every IPv6 address
("No such device") because no socket set ``ZMQ_IPV6``: a server on IPv6 could not start, and a client
could not connect to ``tcp://[::1]:PORT``. The endpoints are bracketed now, and ``enable_ipv6`` sets
the option on a socket whose endpoint needs it."""

from __future__ import annotations

import threading

import pytest
import zmq

from support.addresses import has_ipv6_loopback

from kvdepot.config import HttpConfig, RpcConfig, host_port, tcp_endpoint
from kvdepot.config import is_ipv6_endpoint as config_is_ipv6_endpoint
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.rpc.channel import RpcChannel
from kvdepot.rpc.endpoints import enable_ipv6, is_ipv6_endpoint


needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine's loopback has no IPv6 address")


def test_an_ipv6_host_makes_a_bracketed_endpoint_and_an_ipv4_one_is_as_before():
    assert tcp_endpoint("::1", 5555) == "tcp://[::1]:5555"
    assert tcp_endpoint("[::1]", 5555) == "tcp://[::1]:5555"
    assert tcp_endpoint("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert tcp_endpoint("kv.internal", 5555) == "tcp://kv.internal:5555"
    assert host_port("::", 8080) == "[::]:8080"
    assert RpcConfig(host="::1").endpoints == ["tcp://[::1]:5555"]
    assert RpcConfig(host="::", port=6000).endpoints == ["tcp://[::]:6000"]


def test_a_bracketed_host_flag_is_the_bare_address_the_socket_apis_want():
    assert RpcConfig(host="[::1]").host == "::1"
    assert HttpConfig(host="[::1]").host == "::1"
    assert RpcConfig(host="[::1]").endpoints == ["tcp://[::1]:5555"]


def test_only_an_ipv6_endpoint_turns_on_zmq_ipv6():
    for ep in ("tcp://[::1]:5555", "tcp://::1:5555", "tcp://[::]:5555", "tcp://eth0;[fe80::1]:5555"):
        assert is_ipv6_endpoint(ep) and config_is_ipv6_endpoint(ep), ep
    for ep in ("tcp://127.0.0.1:5555", "tcp://*:5555", "tcp://kv.internal:5555", "ipc:///tmp/a:b", "inproc://x"):
        assert not is_ipv6_endpoint(ep) and not config_is_ipv6_endpoint(ep), ep
    ctx = zmq.Context()
    try:
        for endpoints, want in ((["tcp://127.0.0.1:1", "ipc:///tmp/x"], 0), (["ipc:///tmp/x", "tcp://[::1]:1"], 1), ("tcp://[::1]:1", 1)):
            sock = ctx.socket(zmq.ROUTER)
            enable_ipv6(sock, endpoints)
            assert sock.getsockopt(zmq.IPV6) == want, endpoints
            sock.close(linger=0)
    finally:
        ctx.term()


@needs_ipv6
def test_a_channel_pings_a_server_socket_on_ipv6_loopback():
    """Both sides as a kvdepot server and client set them up: a ROUTER bound through ``enable_ipv6``,
    and an ``RpcChannel`` to ``tcp://[::1]:PORT`` (which set no ZMQ_IPV6 and never connected)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    enable_ipv6(router, "tcp://[::1]:0")
    router.bind("tcp://[::1]:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    assert endpoint.startswith("tcp://[::1]:"), endpoint

    def answer_one_ping() -> None:
        if router.poll(10_000):
            ident, header, _body = router.recv_multipart()
            rid = codec.decode_request_header(header).request_id
            router.send_multipart([ident, *codec.encode_reply(rid, m.PingReply(ok=True))])

    thread = threading.Thread(target=answer_one_ping, daemon=True)
    thread.start()
    channel = RpcChannel(endpoint, context=ctx).open()
    try:
        assert channel.ping(timeout_s=10.0)
    finally:
        channel.close()
        thread.join(timeout=10)
        router.close(linger=0)
        ctx.term()


@needs_ipv6
def test_kv_events_sockets_bind_ipv6_loopback():
    """``--kv-events-endpoint tcp://[::1]:PORT`` (loopback, so allowed without --insecure) could not bind."""
    from kvdepot.observability.kv_events import KVEventsPublisher

    pub = KVEventsPublisher("tcp://[::1]:0", "tcp://[::1]:0")
    try:
        pub.bind()
        assert all(ep.startswith("tcp://[::1]:") for ep in pub.bound_endpoints), pub.bound_endpoints
    finally:
        pub.close()
