"""A caller's deadline holds: ``KVClient.deadline(s)`` bounds every request of the calling thread inside
it, whether the server is silent (SIGSTOP) or another thread holds the client's channel, and leaves
other threads alone. (An engine's prefetch has a budget of its own: a kvdepot call must end inside it.)
The bounds asserted are the deadline given against the client's own ``timeout_s``, far apart, so a
loaded machine cannot make them pass or fail by chance."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kvdepot.errors import KVDepotTimeout

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens, pause

TIMEOUT_S = 20.0  # the client's own per-request timeout
DEADLINE_S = 0.5  # what the caller allows: a request must end well before TIMEOUT_S


def test_a_silent_server_costs_the_caller_its_deadline_not_the_timeout(make_server, seed):
    srv = make_server()
    tokens = make_tokens(2 * CHUNK, seed)
    with srv.client(timeout_s=TIMEOUT_S, heartbeat=False) as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK
        pause(srv.proc.proc.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(KVDepotTimeout), c.deadline(DEADLINE_S):
                c.lookup(tokens)
            assert time.monotonic() - t0 < TIMEOUT_S / 4
        finally:
            srv.proc.proc.send_signal(signal.SIGCONT)
        assert c.lookup(tokens) == 2 * CHUNK  # served again, no deadline now


def test_a_channel_held_by_another_thread_is_no_reason_to_wait_past_the_deadline(make_server, seed):
    srv = make_server()
    tokens = make_tokens(2 * CHUNK, seed)
    with srv.client(timeout_s=TIMEOUT_S, heartbeat=False) as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:  # another thread in the middle of a long exchange
            with c.link.channel.held(TIMEOUT_S):
                holding.set()
                release.wait(TIMEOUT_S)

        other = threading.Thread(target=hold)
        other.start()
        assert holding.wait(10)
        try:
            t0 = time.monotonic()
            with pytest.raises(KVDepotTimeout, match="waited"), c.deadline(DEADLINE_S):
                c.lookup(tokens)
            assert time.monotonic() - t0 < TIMEOUT_S / 4
        finally:
            release.set()
            other.join()
        with c.deadline(DEADLINE_S * 20):
            assert c.lookup(tokens) == 2 * CHUNK


def test_deadlines_nest_and_stay_with_their_thread(make_server, seed):
    srv = make_server()
    tokens = make_tokens(CHUNK, seed)
    with srv.client(timeout_s=TIMEOUT_S, heartbeat=False) as c:
        with c.deadline(0.0001):
            time.sleep(0.01)
            with pytest.raises(KVDepotTimeout, match="deadline passed"):
                c.lookup(tokens)
            with c.deadline(TIMEOUT_S):  # an inner block cannot extend the outer deadline
                with pytest.raises(KVDepotTimeout):
                    c.lookup(tokens)
            found: list[int] = []
            t = threading.Thread(target=lambda: found.append(c.lookup(tokens)))  # another thread: no deadline
            t.start()
            t.join(30)
            assert found == [0]
        assert c.lookup(tokens) == 0  # the block is over: no deadline


def test_registering_again_inside_a_deadline_waits_no_longer_than_the_deadline(make_server, seed):
    """The server forgot the context (a restart, a revocation): the request registers again, and that
    registration is bounded by the caller's deadline too, not by the client's own timeout."""
    from kvdepot.protocol import messages as m

    srv = make_server()
    tokens = make_tokens(CHUNK, seed)
    with srv.client(timeout_s=TIMEOUT_S, heartbeat=False) as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == CHUNK
        link = c.link
        link.channel.call(m.UnregisterContextRequest(context_id=link.registration.context_id))  # forgotten
        waits: list[float] = []
        call = link.channel.call

        def spy(body, *args, **kwargs):
            if isinstance(body, m.RegisterContextRequest):
                waits.append(kwargs.get("timeout_s"))
            return call(body, *args, **kwargs)

        link.channel.call = spy
        with c.deadline(DEADLINE_S * 20):
            assert c.lookup(tokens) == CHUNK
        assert len(waits) == 1 and waits[0] <= DEADLINE_S * 20


def test_waiting_for_another_threads_registration_is_within_the_deadline(make_server, seed):
    """After a restart one thread (no deadline) registers again, and the server is slow to answer it (here:
    stopped). Another, inside a deadline, that needs the context meanwhile (told UNKNOWN_CONTEXT too, or
    seeing the registration under way) used to wait for that registration to end, up to the client's
    own timeout; it ends within its deadline now, and the registration goes on."""
    from kvdepot.errors import UnknownContext
    from kvdepot.protocol import messages as m

    srv = make_server()
    tokens = make_tokens(CHUNK, seed)
    with srv.client(timeout_s=TIMEOUT_S, heartbeat=False) as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == CHUNK
        srv.restart()
        registering = threading.Event()  # one thread is registering again (it holds the registration lock)
        paused = threading.Event()  # and the server is stopped before its REGISTER
        told = threading.Event()  # the deadline's thread was told UNKNOWN_CONTEXT
        call = c.link.channel.call

        def spy(body, *args, **kwargs):
            if isinstance(body, m.RegisterContextRequest) and threading.current_thread().name == "registers":
                registering.set()
                # Until the other thread was told too (a client that knows a registration is under way
                # sends nothing and just waits for it: then this is as slow as the server would be).
                told.wait(2 * DEADLINE_S)
                pause(srv.proc.proc.pid)  # the registration's REGISTER waits for a silent server
                paused.set()
            try:
                return call(body, *args, **kwargs)
            except UnknownContext:
                if threading.current_thread().name == "in-deadline":
                    told.set()
                raise

        c.link.channel.call = spy
        found: list = []
        registers = threading.Thread(target=lambda: found.append(c.lookup(tokens)), name="registers")
        registers.start()
        outcome: list = []

        def in_deadline() -> None:
            t0 = time.monotonic()
            try:
                with c.deadline(DEADLINE_S):
                    c.lookup(tokens)
            except KVDepotTimeout as exc:
                outcome.append(exc)
            outcome.append(time.monotonic() - t0)

        other = threading.Thread(target=in_deadline, name="in-deadline")
        try:
            assert registering.wait(10)
            other.start()
            assert paused.wait(10)
            other.join(TIMEOUT_S / 4)
        finally:
            srv.proc.proc.send_signal(signal.SIGCONT)
        other.join(TIMEOUT_S)
        registers.join(TIMEOUT_S)
        assert isinstance(outcome[0], KVDepotTimeout) and outcome[1] < TIMEOUT_S / 8, outcome
        assert found == [0], "the registering thread went on once the server answered"
        assert c.lookup(tokens) == 0


def _given_up_while_the_server_stalls(srv, fn) -> None:
    """``fn`` times out while the server is stopped; the server handles the request once it runs again
    (its deadline starts when its loop takes the request in, not when the client sent it)."""
    pause(srv.proc.proc.pid)
    try:
        with pytest.raises(KVDepotTimeout):
            fn()
    finally:
        srv.proc.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_a_prepare_given_up_on_leaves_no_lease_behind(make_server, seed, op):
    """The late reply named a lease nobody held. It ended at its TTL, with its holder alive, so it was
    quarantined for as long as the engine ran: a store's slots never reused, a read's objects pinned
    (never evicted, never cleared). The late reply now ends it, sent behind."""
    ttl = 1.0
    srv = make_server("--lease-ttl-s", str(ttl), "--client-timeout-s", "600")
    tokens = make_tokens(2 * CHUNK, seed)
    with srv.client(transport="shm") as c:
        if op == "retrieve":
            assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK
        prepare = c.prepare_store if op == "store" else c.prepare_retrieve

        def give_up():
            with c.deadline(0.3), prepare(tokens):
                pass

        _given_up_while_the_server_stalls(srv, give_up)
        assert c.ping()  # this exchange reads the late reply
        time.sleep(4 * ttl)
        st = srv.status()
        assert (st["leases"], st["quarantine"]["leases"]) == (0, 0), f"a lease nobody holds stays: {st['quarantine']}"
        if op == "retrieve":
            assert srv.clear()["removed"] == 2, "the objects stay pinned by a lease nobody holds"


def test_a_pin_given_up_on_is_not_left_behind(make_server, seed):
    """A late PIN_PREFIX reply named a hard pin whose id the caller never learned: it protected its
    prefix (against the salt's quota) until an operator found it."""
    import httpx

    srv = make_server("--client-timeout-s", "600")
    tokens = make_tokens(2 * CHUNK, seed)
    with srv.client() as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK

        def give_up():
            with c.deadline(0.3):
                c.pin(tokens)

        _given_up_while_the_server_stalls(srv, give_up)
        assert c.ping() and c.ping()  # the late reply read, its unpin sent behind and answered
        pins = httpx.get(f"{srv.http}/cache/pins", timeout=10).json()["pins"]
        assert not [p for p in pins if p["state"] in ("hard", "soft")], f"a pin the caller was told timed out stays: {pins}"
