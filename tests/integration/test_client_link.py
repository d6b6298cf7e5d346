"""The client's link to its server (``kvdepot.client.context.ContextLink``) as a user of the plain client
meets it: a ``connect()`` that failed because the server was not up yet is called again on the same
client once it is, and a request the server may take long over (a clear of slow tiers) does not hold
the channel the heartbeat needs to renew the leases of open blocks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvdepot import ClientOptions, KVClient
from kvdepot.errors import KVDepotError, ServerUnreachable

from support.servers import CHUNK, LAYOUT, MODEL, assert_bytes_equal, make_kv, make_tokens, pause
from support.tiers import start_tier_server, valkey_spec


def test_connect_again_once_the_server_is_up(make_server, seed):
    """A failed connect used to close the channel for good: every later connect() failed with "client is
    closed", so the connectors built a new client each time. Now it leaves the client as built."""
    srv = make_server()
    assert srv.stop() == 0  # its endpoint is known, nothing answers there yet
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    c = KVClient(srv.ipc_url, MODEL, LAYOUT, options=ClientOptions(connect_timeout_s=0.3), connect=False)
    answered: list = []
    c.link.channel.answered = answered.append  # what a connector sets before it connects
    try:
        with pytest.raises(ServerUnreachable):
            c.connect()
        with pytest.raises(ServerUnreachable):
            c.connect()
        srv.start_again()
        assert c.connect() is c
        assert answered, "what was set on the channel before the failed connects was lost"
        assert c.connect() is c  # connected already: nothing to do (no second socket, no second context)
        assert c.store(t, kv) == 2 * CHUNK
        assert_bytes_equal(c.retrieve(t), kv)
        st = srv.status()
        assert (st["contexts"], st["leases"]) == (1, 0)
    finally:
        c.close()
    with pytest.raises(KVDepotError, match="closed"):
        c.connect()


def test_a_clear_slower_than_the_lease_ttl_leaves_the_heartbeat_renewing_open_blocks(own_valkey, make_server, seed):
    """The heartbeat renews an open block's lease only when it gets the client's channel. ``clear()`` waits
    for the server up to 60 s (its tiers' clears, up to 30 s each), as long as the default lease TTL, and
    held the channel all along: a block open meanwhile lost its lease and its commit was refused
    (LEASE_EXPIRED). The clear goes on a channel of its own now. Here the TTL is 1 s and the clear waits
    for a hung valkey tier's 3 s socket timeout."""
    srv = start_tier_server(make_server, valkey_spec(own_valkey.url, name="slow", socket_timeout_s=3), extra=("--lease-ttl-s", "1"))
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client() as c:  # renewals every 0.25 s
        pause(own_valkey.proc.pid)
        try:
            with c.prepare_store(t) as slots:
                for i, slot in enumerate(slots):
                    slot[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
                t0 = time.monotonic()
                c.clear("tiers")
                assert time.monotonic() - t0 > 2.0, "the clear was not slower than the TTL: this proves nothing"
        finally:
            os.kill(own_valkey.proc.pid, signal.SIGCONT)
        assert_bytes_equal(c.retrieve(t), kv)
        assert srv.status()["leases"] == 0


def test_a_client_closed_while_its_threads_make_requests_leaves_no_context_on_the_server(make_server, seed):
    """close() says goodbye (UNREGISTER) and then closes the channel. A thread whose request the server
    read between the two got UNKNOWN_CONTEXT and registered again, on the channel not yet closed: the
    closed client left a live context (and client record) on the server, which the compatibility
    handshake still compares new registrations with, and which no goodbye ever ends."""
    import threading

    srv = make_server()
    tokens = [make_tokens(CHUNK, seed + i) for i in range(8)]
    for _trial in range(25):
        c = srv.client(timeout_s=2.0)
        started = threading.Barrier(9)

        def work(i: int, c=c, started=started) -> None:
            started.wait(10)
            while True:
                try:
                    c.lookup(tokens[i])
                except KVDepotError:
                    return  # closed

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(10)
        time.sleep(0.05)
        c.close()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    st = srv.wait_status(lambda s: s["contexts"] == 0, timeout_s=3)
    assert st["contexts"] == 0, f"closed clients left {st['contexts']} contexts registered on the server"


def test_a_client_that_waits_as_long_as_it_takes_stores_and_retrieves(server, seed):
    """A timeout past ZeroMQ's longest receive timeout (2^31 ms, 24.8 days: "wait as long as it takes")
    failed every request with a bare OverflowError out of the channel, registration included: the
    client never worked. Infinity, which ClientOptions took too, failed so in a lock's wait: it is
    refused, saying why."""
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with KVClient(server.ipc_url, MODEL, LAYOUT, options=ClientOptions(timeout_s=1e9, connect_timeout_s=1e9)) as c:
        assert c.ping()
        assert c.store(t, kv) == 2 * CHUNK
        assert_bytes_equal(c.retrieve(t), kv)
    with pytest.raises(ValueError, match="positive and finite"):
        ClientOptions(timeout_s=float("inf"))
