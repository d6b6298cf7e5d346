"""A shared-memory retrieve is one round trip: its release is sent behind, and L1 is asked first.

The release's reply changes nothing for the reader (the server keeps a live reader's pins, even past
its lease's TTL), so the block ends once the release is sent; the reply is read by the channel's next
exchange. These tests hold the parts of that promise that can fail: the block waits for one reply,
the release still reaches the server (before anything the client sends later), a failed release is
told and retried, and unread replies never pile up past a bound. With L2 tiers, a retrieve that L1
holds whole asks nothing else (before, every one probed the tiers first: a LOOKUP round trip), and one
that L1 holds only part of still gets the rest from the tiers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np

from kvdepot.client.context import RELEASE_BEHIND_TRIES
from kvdepot.errors import ErrorCode, KVDepotError, UnknownLease
from kvdepot.protocol import messages as m
from kvdepot.rpc.channel import MAX_BEHIND, RpcChannel

from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens, pause
from support.tiers import assert_prefix_bytes, make_prompt, start_tier_server, store_full, wait_store_idle


def _count_replies(channel: RpcChannel) -> list[int]:
    """Count the replies ``channel`` receives from now on (wrapping its one receive)."""
    seen = [0]
    recv = channel._recv

    def counting(body, deadline):
        seen[0] += 1
        return recv(body, deadline)

    channel._recv = counting
    return seen


class StalledAndBusy:
    """``begin``: the server SIGSTOPped, and another thread of ``c``'s process keeping its channel busy
    with lookups that each time out (an engine's other threads, back to back). ``end``: that thread
    stopped and the server running again, a reply read and the lease TTL (2 s) past, so whatever was
    left to the TTL has been."""

    def __init__(self, srv, c, seed: int) -> None:
        self.pid, self.c, self.seed = srv.proc.proc.pid, c, seed
        self.busy, self.done = threading.Event(), threading.Event()
        self.other = threading.Thread(target=self._keep_busy, daemon=True)

    def _keep_busy(self) -> None:
        while not self.done.is_set():
            self.busy.set()
            try:
                self.c.lookup(make_tokens(CHUNK, self.seed + 1))
            except KVDepotError:
                pass

    def begin(self) -> None:
        pause(self.pid)
        self.other.start()
        assert self.busy.wait(5)
        time.sleep(0.05)

    def end(self) -> None:
        time.sleep(0.5)
        self.done.set()
        self.other.join(5)
        os.kill(self.pid, signal.SIGCONT)
        self.c.ping()
        time.sleep(2.5)  # past the lease TTL
        self.c.ping()


def test_a_shm_retrieve_waits_for_one_reply_and_its_release_still_lands(server, seed):
    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client() as c:
        assert c.transport == "shm"
        assert c.store(tokens, kv) == 4 * CHUNK
        c.ping()
        seen = _count_replies(c.link.channel)
        with c.prepare_retrieve(tokens) as views:
            got = np.concatenate([np.array(v) for v in views], axis=2)
        assert seen[0] == 1, f"a shm retrieve block received {seen[0]} replies: its release was waited for"
        assert_bytes_equal(got, kv)
        # ZeroMQ keeps one connection in order: the next request finds the release handled.
        assert c.ping() is True
        assert seen[0] == 3  # the release's reply, read on the way to the PING's
        assert server.status()["leases"] == 0
        # The same through retrieve(): one PREPARE reply each, and from the second on the previous
        # release's reply, already there, read on the way.
        for _ in range(3):
            assert_bytes_equal(c.retrieve(tokens), kv)
        assert seen[0] == 3 + 3 + 2
        c.ping()
        assert server.status()["leases"] == 0


def test_a_release_the_server_refuses_is_told_to_its_sender(server):
    channel = RpcChannel(server.ipc_url).open()
    heard: list = []
    try:
        channel.send_behind(m.CommitRetrieveRequest(context_id=1, lease_id=987654), lambda r, e: heard.append((r, e)))
        assert heard == []  # not read yet: nothing waited for it
        assert channel.ping() is True  # the next exchange reads it on the way
        assert len(heard) == 1
        result, error = heard[0]
        assert result is None and isinstance(error, KVDepotError) and error.code == ErrorCode.UNKNOWN_CONTEXT, heard
    finally:
        channel.close()


def test_unread_replies_never_pile_up_past_the_bound(server):
    """Sending behind never receives (it could take the reply a surrounding exchange waits for), so
    past MAX_BEHIND unread replies the oldest are forgotten: their replies are dropped as late ones."""
    channel = RpcChannel(server.ipc_url).open()
    heard: list = []
    try:
        for i in range(3 * MAX_BEHIND):
            channel.send_behind(m.PingRequest(), lambda r, e, i=i: heard.append((i, r, e)))
            assert len(channel._behind) <= MAX_BEHIND
        assert heard == []
        assert channel.ping() is True  # reads every reply on its way to its own
        assert [i for i, _, _ in heard] == list(range(2 * MAX_BEHIND, 3 * MAX_BEHIND))  # the latest, each once, in order
        assert all(isinstance(r, m.PingReply) and e is None for _, r, e in heard)
        assert channel._behind == {}
    finally:
        channel.close()


def test_a_failed_release_is_sent_again_then_given_up_on_with_a_warning(server, caplog):
    """A release the server could not handle (here: a deadline that passed) leaves the lease held, so
    it is sent again, RELEASE_BEHIND_TRIES times in all; one whose lease is gone is not."""
    with server.client() as c:
        link = c.link
        sent: list = []
        real = link.channel.send_behind

        def failing(body, on_reply, timeout_s=10.0):
            sent.append(body.lease_id)
            real(body, on_reply, timeout_s)
            on_reply(None, KVDepotError("the request waited past its deadline", ErrorCode.DEADLINE_EXCEEDED))

        link.channel.send_behind = failing
        with caplog.at_level(logging.WARNING, logger="kvdepot.client.context"):
            link.release_behind(m.CommitRetrieveRequest(context_id=link.registration.context_id, lease_id=424242))
        assert sent == [424242] * RELEASE_BEHIND_TRIES
        assert any("failed 3 times" in r.getMessage() for r in caplog.records), caplog.text

        sent.clear()
        link.channel.send_behind = lambda body, on_reply, timeout_s=10.0: (sent.append(body.lease_id), on_reply(None, UnknownLease("no lease")))
        link.release_behind(m.CommitRetrieveRequest(context_id=link.registration.context_id, lease_id=7))
        assert sent == [7]
        assert c.ping() is True  # the real sends' replies (UNKNOWN_LEASE) are read and dropped quietly
        assert link.channel._behind == {}


def test_with_l2_tiers_a_whole_l1_hit_is_one_round_trip_and_the_rest_comes_from_the_tiers(make_server, seed):
    srv = start_tier_server(make_server, "memory:size_gb=0.25,name=mem")
    prompt = make_prompt(4, seed)
    with srv.client() as c:
        assert c.transport == "shm"
        store_full(c, prompt)
        wait_store_idle(srv)
        c.ping()
        seen = _count_replies(c.link.channel)
        assert_prefix_bytes(c.retrieve(prompt.tokens), prompt, prompt.n_tokens)
        assert seen[0] == 1, f"a whole L1 hit with an L2 tier received {seen[0]} replies"

        srv.clear()  # L1 empty; the tier holds all four chunks
        c.ping()
        seen[0] = 0
        assert_prefix_bytes(c.retrieve(prompt.tokens), prompt, prompt.n_tokens)
        assert seen[0] >= 3  # the lock (nothing), the probe that brought them in, the lock again
        c.ping()
        assert srv.status()["leases"] == 0
        before = seen[0]
        with c.prepare_retrieve(prompt.tokens) as views:  # now in L1 again: one reply
            assert len(views) == 4
        assert seen[0] == before + 1


def test_a_release_sent_while_other_threads_keep_the_channel_busy_still_reaches_the_server(make_server, seed):
    """A read's release waited at most ``timeout_s`` for the channel; while other threads kept it busy
    (here: a stalled server, each of their requests holding it until its timeout, back to back) it was
    never sent at all, only logged ("the lease ends at its TTL"). A read lease that ends at its TTL
    while its reader's process runs is quarantined with its pins for as long as that process lives:
    the objects it read can never be evicted or cleared again, though the reader was long done."""
    srv = make_server("--lease-ttl-s", "2")
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(timeout_s=0.3) as c:
        assert c.transport == "shm"
        assert c.store(tokens, kv) == 2 * CHUNK
        with c.prepare_retrieve(tokens) as views:
            assert_bytes_equal(np.concatenate([np.array(v) for v in views], axis=2), kv)
            stall = StalledAndBusy(srv, c, seed)
            stall.begin()
        # The block is over (its release went behind): the server handles it once it runs again.
        stall.end()
        st = srv.status()
        assert st["quarantine"]["leases"] == 0 and st["leases"] == 0, (
            f"the read's release never reached the server: {st['leases']} leases, {st['quarantine']['leases']} in quarantine"
        )
        assert st["l1"]["read_locked"] == 0


def test_a_commit_that_never_got_the_channel_does_not_leave_its_slots_in_quarantine(make_server, seed):
    """A shm store's COMMIT waits at most ``timeout_s`` for the channel. When other threads kept it busy
    (a stalled server), the commit was never sent and the caller got a KVDepotTimeout, but nothing ended
    the write lease: it ended at its TTL while the writer's process ran, so its slots were quarantined
    (counted as used, never reused) for as long as that process lives. Now an abort follows behind."""
    from kvdepot.errors import KVDepotTimeout

    srv = make_server("--lease-ttl-s", "2")
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(timeout_s=0.3) as c:
        assert c.transport == "shm"
        stall = StalledAndBusy(srv, c, seed)
        try:
            with c.prepare_store(tokens) as slots:
                for j, slot in enumerate(slots):
                    slot[...] = kv[:, :, j * CHUNK : (j + 1) * CHUNK]
                stall.begin()
        except KVDepotTimeout:
            pass  # the commit's fate is unknown to the caller: that is allowed, a leak is not
        stall.end()
        st = srv.status()
        assert st["quarantine"]["leases"] == 0 and st["leases"] == 0, f"the store's lease was left to its TTL: {st['quarantine']}"
        assert st["l1"]["used_bytes"] == 0 or c.lookup(tokens) == 2 * CHUNK, "slots held by nothing"


def test_late_grants_past_the_bound_of_unread_replies_are_still_given_back(make_server, seed):
    """A request whose reply grants a lease (a shm PREPARE) and that timed out keeps its id, so that
    the late reply's lease is given back. Those ids shared the MAX_BEHIND bound with releases sent
    behind, and past it the oldest was forgotten: on a stalled server, an engine whose loads each gave
    up after a short deadline (SGLang's prefetch budget) timed out more than MAX_BEHIND of them, and the
    leases of the forgotten ones were held by nobody: ended at their TTL, then quarantined with their
    read pins for as long as the engine runs."""
    from kvdepot.errors import KVDepotTimeout

    srv = make_server("--lease-ttl-s", "2")
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(timeout_s=1.0) as c:
        assert c.transport == "shm"
        assert c.store(tokens, kv) == 2 * CHUNK
        pid = srv.proc.proc.pid
        pause(pid)
        try:
            for _ in range(MAX_BEHIND + 16):
                try:
                    with c.deadline(0.01):
                        with c.prepare_retrieve(tokens):
                            raise AssertionError("a paused server answered")
                except KVDepotTimeout:
                    pass
        finally:
            os.kill(pid, signal.SIGCONT)
        c.ping()  # reads the late replies, giving each lease back behind
        c.ping()
        time.sleep(2.5)  # past the lease TTL
        c.ping()
        st = srv.status()
        assert st["quarantine"]["leases"] == 0 and st["leases"] == 0, (
            f"late leases nobody gave back: {st['leases']} held, {st['quarantine']['leases']} quarantined"
        )
