"""A KVClient survives a server restart on the same endpoint: it registers again on UNKNOWN_CONTEXT and
maps the new arena. The old data is gone; new stores and retrieves work."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens, pause, wait_until

from kvdepot.errors import ErrorCode, KVDepotTimeout, LeaseExpired
from kvdepot.protocol import messages as m


@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
@pytest.mark.parametrize("transport", ["auto", "inline"])
def test_client_keeps_working_across_a_restart(make_server, endpoint, transport, seed):
    srv = make_server()
    url = srv.url if endpoint == "tcp" else srv.ipc_url
    t1 = make_tokens(4 * CHUNK, seed)
    kv1 = make_kv(LAYOUT, len(t1), seed)
    with srv.client(url, transport=transport) as c:
        want = "shm" if transport == "auto" else "inline"
        assert c.transport == want
        assert c.store(t1, kv1) == 4 * CHUNK
        shm_before = srv.status()["l1"]["shm_path"]

        srv.restart()
        assert srv.status()["l1"]["shm_path"] != shm_before  # a new arena

        # The first call finds its context unknown, registers again and goes on.
        assert c.lookup(t1) == 0, "a restarted server has no data"
        assert c.transport == want
        assert srv.status()["contexts"] == 1

        t2 = make_tokens(5 * CHUNK, seed + 1)
        kv2 = make_kv(LAYOUT, len(t2), seed + 1)
        assert c.store(t2, kv2) == 5 * CHUNK
        assert_bytes_equal(c.retrieve(t2), kv2)
        assert c.store(t1, kv1) == 4 * CHUNK
        assert_bytes_equal(c.retrieve(t1), kv1)
        # An independent reader over the socket sees the same bytes: the shm writes went to the new
        # arena, not to a stale mapping of the old one (where the client would only read itself back).
        with srv.client(srv.url, transport="inline") as other:
            assert_bytes_equal(other.retrieve(t2), kv2)
            assert_bytes_equal(other.retrieve(t1), kv1)
        with c.prepare_retrieve(t2) as views:
            assert len(views) == 5
            assert_bytes_equal(views[4], kv2[:, :, 4 * CHUNK :])
        assert srv.status()["leases"] == 0

        # A second restart works just as well (the client remaps again).
        srv.restart()
        assert c.store(t2, kv2) == 5 * CHUNK
        assert_bytes_equal(c.retrieve(t2), kv2)
        assert srv.status()["l1"]["objects"] == 5
        with srv.client(srv.ipc_url, transport="inline") as other:
            assert_bytes_equal(other.retrieve(t2), kv2)


def test_client_operations_right_after_restart_with_prepare_store(make_server, seed):
    srv = make_server()
    t = make_tokens(3 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client() as c:
        assert c.store(t, kv) == 3 * CHUNK
        srv.restart()
        # The very first request after the restart is a PREPARE_STORE on the shm path: the slots it
        # hands out must be in the *new* arena, or the server would never see the bytes.
        with c.prepare_store(t) as slots:
            assert all(s is not None for s in slots)
            for i, s in enumerate(slots):
                s[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup(t) == 3 * CHUNK
        with srv.client(srv.ipc_url, transport="inline") as other:  # read through the socket instead
            assert_bytes_equal(other.retrieve(t), kv)


def test_heartbeats_survive_a_restart(make_server, seed):
    """While the server is down the heartbeat fails quietly; afterwards the client is usable again."""
    srv = make_server("--heartbeat-interval-s", "0.2")
    with srv.client() as c:
        assert srv.stop() == 0
        # Let a few heartbeats fail against the dead endpoint (bounded wait for them to have happened).
        hb = c.registration.heartbeat_interval_s
        assert hb == pytest.approx(0.2)
        time.sleep(5 * hb)
        srv.start_again()
        assert c.ping()
        t = make_tokens(2 * CHUNK, seed)
        kv = make_kv(LAYOUT, len(t), seed)
        wait_until(lambda: c.store(t, kv) == 2 * CHUNK, what="a store after the restart")
        assert_bytes_equal(c.retrieve(t), kv)


def test_the_heartbeat_renewing_after_a_restart_leaves_registering_to_the_requests(make_server, seed):
    """The heartbeat renews its sessions' locks holding the channel. After a restart its renewal used to
    register the client again right there, waiting for the registration lock while a worker thread,
    registering too, waited for the channel: both stood still until a timeout, and the worker's call
    failed as a transport error. Now a renewal the server cannot place just fails (those locks went
    with the old server) and the next request registers."""
    srv = make_server("--lease-ttl-s", "1")  # renewals every 0.25 s
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client() as c:
        c.renew_sessions = lambda: ["a-queued-request"]
        srv.restart()
        time.sleep(1.5)  # several renewals against the new server
        assert srv.status()["contexts"] == 0, "the heartbeat registered the client again"
        assert c.store(t, kv) == 2 * CHUNK  # the request registers
        assert srv.status()["contexts"] == 1
        assert_bytes_equal(c.retrieve(t), kv)


def test_a_request_for_a_path_another_thread_replaced_is_not_sent(make_server, seed):
    """Re-registering (after a restart) replaces the path, a new arena's; a thread that chose the old
    path just before used to send its PREPARE anyway under the new registration, got the new arena's
    offsets, failed mapping them on the closed old arena (ValueError) and left the lease to its TTL.
    It is told PathChanged before sending, and the client's call goes again on the new path."""
    from kvdepot.client.transfer import PathChanged

    srv = make_server()
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client() as c:
        stale = object()  # a path the client no longer uses
        with pytest.raises(PathChanged):
            c.link.request(m.PrepareStoreRequest(context_id=0, keys=c.hashes(t)), path=stale)
        assert srv.status()["leases"] == 0, "the request was sent: its lease waits for the TTL"
        assert c.store(t, kv) == 2 * CHUNK
        assert_bytes_equal(c.retrieve(t), kv)


def test_a_registration_that_timed_out_is_not_taken_for_the_old_one(make_server, seed):
    """A restarted server numbers contexts from 1 again. A registration whose reply came too late for the
    caller's deadline still registered a context there, under the old registration's very id: the
    client went on with the old registration, the server accepted it, and the client wrote into its
    old arena at the new arena's offsets, so the server published its own untouched slots as the chunks
    (wrong bytes for every reader, and no error anywhere). The next request registers again first."""
    srv = make_server()
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client(heartbeat=False) as c:
        assert c.transport == "shm"
        srv.restart()
        call = c.link.channel.call

        def silent_server(body, *args, **kwargs):
            if isinstance(body, m.RegisterContextRequest):
                pause(srv.proc.proc.pid)  # it reads the REGISTER only after the caller gave up
            return call(body, *args, **kwargs)

        c.link.channel.call = silent_server
        try:
            with pytest.raises(KVDepotTimeout), c.deadline(0.5):
                c.store(t, kv)
        finally:
            c.link.channel.call = call
            srv.proc.proc.send_signal(signal.SIGCONT)
        assert srv.wait_status(lambda st: st["contexts"] == 1)["contexts"] == 1  # what the late REGISTER made
        assert c.store(t, kv) == 2 * CHUNK
        with srv.client(srv.url, transport="inline") as other:  # through the socket: what the server holds
            assert_bytes_equal(other.retrieve(t), kv)
        assert_bytes_equal(c.retrieve(t), kv)
        assert srv.status()["leases"] == 0


def test_a_re_registration_that_could_not_map_the_new_arena_is_tried_again(make_server, seed):
    """Registering again after a restart closes the old arena before it maps the new one. When that failed
    (here the arena's file is out of sight for a moment; transport "shm" allows no fallback), the client
    kept its old registration and the closed path: the server knew the old id (the failed try's context,
    numbered from 1 again), so the client never registered again, and every store failed mapping its
    offsets on the closed arena (ValueError), its lease left to the TTL. The next call registers again
    and maps the arena; the context of the failed try is let go at once."""
    from kvdepot.errors import TransportUnavailable

    srv = make_server()
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client(transport="shm", heartbeat=False) as c:
        srv.restart()
        arena = srv.status()["l1"]["shm_path"]
        os.rename(arena, arena + ".away")
        try:
            with pytest.raises(TransportUnavailable):
                c.store(t, kv)
        finally:
            os.rename(arena + ".away", arena)
        assert c.store(t, kv) == 2 * CHUNK
        assert c.transport == "shm"
        with srv.client(srv.url, transport="inline") as other:
            assert_bytes_equal(other.retrieve(t), kv)
        st = srv.status()
        assert (st["contexts"], st["leases"]) == (1, 0), "the failed try's context stayed on the server"


def test_a_block_the_server_forgot_ends_with_lease_expired_not_unknown_context(make_server, seed):
    """A store block whose server restarted (or revoked the client) in the middle: its commit cannot be
    re-registered (a new context would not know the lease), so it says the lease ended (LEASE_EXPIRED,
    with why), not a bare UNKNOWN_CONTEXT; and the client goes on."""
    srv = make_server()
    t = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(t), seed)
    with srv.client() as c:  # shm: the block holds a server lease (inline sends the whole store at its end)
        with pytest.raises(LeaseExpired, match="no longer knows this client's context") as exc_info:
            with c.prepare_store(t) as slots:
                for i, s in enumerate(slots):
                    s[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
                srv.restart()
        assert exc_info.value.code == ErrorCode.LEASE_EXPIRED
        assert c.lookup(t) == 0  # nothing half-committed
        assert c.store(t, kv) == 2 * CHUNK  # registers again
        assert_bytes_equal(c.retrieve(t), kv)
