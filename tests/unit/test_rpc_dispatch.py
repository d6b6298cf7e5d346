"""RpcServer with hand-written handlers over ipc:// (in ``tmp_path``), talked to by RpcChannel or, where
a test must see every frame (duplicates, deadlines, routing ids), by a bare DEALER socket.

No kvdepot server: the handlers are the test's, so each test says exactly what a handler does and
checks exactly what came back, how often, and on which thread.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import zmq

from kvdepot.errors import ErrorCode, KVDepotError, UnknownLease
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.messages import RequestType
from kvdepot.rpc.channel import RpcChannel
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.rpc.endpoints import EndpointInUse
from kvdepot.rpc.server import RpcServer
from kvdepot.types import ClientId

REPLY_S = inspect.signature(RpcChannel.call).parameters["timeout_s"].default  # a caller's default patience
LOOP = "kvdepot-rpc"  # the loop thread's name
SYNC, BLOCKING = HandlerMode.SYNC, HandlerMode.BLOCKING


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + REPLY_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {REPLY_S:g} s")
        time.sleep(0.001)  # yield to the loop thread; the predicate is what is asserted


class Observer:
    """A RequestObserver recording (event, client, thread name, monotonic time)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ClientId, str, float]] = []

    def request_started(self, client: ClientId) -> None:
        self.events.append(("started", client, threading.current_thread().name, time.monotonic()))

    def request_finished(self, client: ClientId) -> None:
        self.events.append(("finished", client, threading.current_thread().name, time.monotonic()))

    def seen(self) -> list[tuple[str, ClientId, str]]:
        return [e[:3] for e in self.events]


class Raw:
    """A bare DEALER: sends requests with the ids and deadlines the test picks, returns every reply."""

    def __init__(self, url: str, ident: bytes) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, ident)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(REPLY_S * 1000))
        self.sock.connect(url)

    def send(self, request_id: int, body: msgspec.Struct, payload=(), timeout_ms: int = 0) -> None:
        self.sock.send_multipart([*codec.encode_request(request_id, body, timeout_ms), *payload])

    def recv(self) -> tuple[int, object, list[bytes]]:
        """(request id, typed reply or (ErrorCode, message), payload frames) of the next reply."""
        header_frame, body, *payload = self.sock.recv_multipart()
        header = codec.decode_reply_header(header_frame)
        if header.status:
            err = msgspec.msgpack.decode(body, type=m.ErrorReply)
            assert err.code == header.status
            return header.request_id, (ErrorCode(err.code), err.message), payload
        return header.request_id, body, payload

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def url(tmp_path) -> str:
    return f"ipc://{tmp_path}/rpc.sock"


@pytest.fixture
def closing() -> Iterator[list]:
    """Everything a test opens (servers, channels, raw sockets) is closed at teardown, last first."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close()


@pytest.fixture
def serve(url, closing) -> Callable[..., RpcServer]:
    def start(*handlers: HandlerSpec, **options) -> RpcServer:
        server = RpcServer([url], list(handlers), **options)
        closing.append(server)
        server.start()
        return server

    return start


@pytest.fixture
def channel(url, closing) -> RpcChannel:
    ch = RpcChannel(url).open()
    closing.append(ch)
    return ch


@pytest.fixture
def raw(url, closing) -> Callable[[bytes], Raw]:
    def make(ident: bytes = b"raw-client") -> Raw:
        r = Raw(url, ident)
        closing.append(r)
        return r

    return make


def ping_handler(calls: list | None = None, mode: HandlerMode = SYNC) -> HandlerSpec:
    def fn(call: Call) -> Reply:
        if calls is not None:
            calls.append((call.request_id, threading.current_thread().name))
        return Reply(m.PingReply())

    return HandlerSpec(RequestType.PING, fn, mode)


def raising(rtype: RequestType, exc: BaseException, mode: HandlerMode) -> HandlerSpec:
    def fn(call: Call) -> Reply:
        raise exc

    return HandlerSpec(rtype, fn, mode)


def error_count(server: RpcServer, code: ErrorCode) -> float:
    return server.metrics.registry.get_sample_value("kvdepot_error_replies_total", {"code": code.name}) or 0.0


# --- one reply per request -----------------------------------------------------------------------------


def test_sync_and_blocking_handlers_answer_each_request_exactly_once(serve, raw):
    pings: list = []
    sizes: list = []

    def chunk_size(call: Call) -> Reply:
        sizes.append((call.request_id, threading.current_thread().name))
        return Reply(m.ChunkSizeReply(chunk_size=call.request_id * 10))

    serve(ping_handler(pings), HandlerSpec(RequestType.GET_CHUNK_SIZE, chunk_size, BLOCKING), workers=1)
    r = raw()
    for rid in range(1, 7):
        r.send(rid, m.PingRequest() if rid % 2 else m.GetChunkSizeRequest())
    # Fences: a duplicate of any reply above would be queued before the fence of its kind (SYNC replies
    # leave from the loop thread in order; BLOCKING ones from the one worker, through one pipe).
    r.send(100, m.PingRequest())
    r.send(101, m.GetChunkSizeRequest())
    replies: dict[int, list] = {}
    while not {100, 101} <= replies.keys():
        rid, body, payload = r.recv()
        replies.setdefault(rid, []).append(body)
        assert payload == []
    assert sorted(replies) == [1, 2, 3, 4, 5, 6, 100, 101]
    assert all(len(bodies) == 1 for bodies in replies.values()), replies
    for rid in (1, 3, 5, 100):
        assert msgspec.msgpack.decode(replies[rid][0], type=m.PingReply) == m.PingReply(ok=True)
    for rid in (2, 4, 6, 101):
        assert msgspec.msgpack.decode(replies[rid][0], type=m.ChunkSizeReply) == m.ChunkSizeReply(chunk_size=rid * 10)
    assert pings == [(1, LOOP), (3, LOOP), (5, LOOP), (100, LOOP)]
    assert [rid for rid, _ in sizes] == [2, 4, 6, 101]
    assert all(name.startswith("kvdepot-worker") for _, name in sizes)


def test_two_handlers_for_one_request_type_are_refused(url):
    with pytest.raises(ValueError, match="two handlers for PING"):
        RpcServer([url], [ping_handler(), ping_handler(mode=BLOCKING)])


# --- errors are replies --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [SYNC, BLOCKING])
def test_a_kvdepot_error_is_replied_with_its_code(serve, channel, mode):
    server = serve(
        raising(RequestType.LOOKUP, UnknownLease("lease 7 is gone"), mode),
        raising(RequestType.RENEW_LEASES, KVDepotError("arena full", ErrorCode.NO_SPACE), mode),
    )
    with pytest.raises(UnknownLease) as info:
        channel.call(m.LookupRequest(context_id=1, keys=[]))
    assert (info.value.code, info.value.message) == (ErrorCode.UNKNOWN_LEASE, "lease 7 is gone")
    with pytest.raises(KVDepotError) as info:
        channel.call(m.RenewLeasesRequest(context_id=1))
    assert (info.value.code, info.value.message) == (ErrorCode.NO_SPACE, "arena full")
    assert (error_count(server, ErrorCode.UNKNOWN_LEASE), error_count(server, ErrorCode.NO_SPACE)) == (1, 1)


@pytest.mark.parametrize("mode", [SYNC, BLOCKING])
def test_any_other_exception_is_internal_and_the_loop_keeps_serving(serve, channel, mode):
    server = serve(raising(RequestType.LOOKUP, ValueError("boom"), mode), ping_handler())
    for _ in range(2):
        with pytest.raises(KVDepotError) as info:
            channel.call(m.LookupRequest(context_id=1, keys=[]))
        assert (info.value.code, info.value.message) == (ErrorCode.INTERNAL, "ValueError: boom")
        assert channel.ping() is True
    assert error_count(server, ErrorCode.INTERNAL) == 2
    assert server.alive


def test_a_request_whose_dispatch_fails_is_answered_under_its_own_id(serve, channel, monkeypatch):
    """The loop's last line of defence (a failure outside any handler) used to answer with request id 0,
    which no caller waits for: the caller sat out its whole deadline instead of hearing at once."""
    server = serve(ping_handler())
    real, failed = server._dispatch, []

    def dispatch_failing_once(router, frames):
        if not failed:
            failed.append(frames)
            raise RuntimeError("a bug outside any handler")
        return real(router, frames)

    monkeypatch.setattr(server, "_dispatch", dispatch_failing_once)
    t0 = time.monotonic()
    with pytest.raises(KVDepotError) as info:
        channel.call(m.PingRequest(), timeout_s=REPLY_S)
    assert info.value.code == ErrorCode.INTERNAL and time.monotonic() - t0 < REPLY_S / 2
    assert channel.ping() is True and server.alive


def test_a_client_that_stops_reading_pinning_replies_is_refused_more_until_it_reads(serve, url, closing):
    """Replies that pin memory until sent (an inline retrieve pins its L1 objects) queue without limit
    for a client that never reads them: it could pin the whole cache. Past max_unsent_bytes of them its
    next such request is refused (REPLIES_UNREAD); once it reads, it is served again."""
    released = []
    size = 1 << 20

    def pinning(call: Call) -> Reply:
        return Reply(m.PingReply(), [np.full(size, 7, np.uint8)], on_sent=lambda: released.append(call.request_id))

    serve(HandlerSpec(RequestType.PING, pinning, SYNC, pins_until_sent=True), max_unsent_bytes=4 * size)
    slow = zmq.Context.instance().socket(zmq.DEALER)
    closing.append(slow)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 64 << 10)
    slow.connect(url)
    for rid in range(1, 200):  # 199 MiB asked for, nothing read
        slow.send_multipart(codec.encode_request(rid, m.PingRequest(), 0))
        time.sleep(0.005)
    # Read everything now: some replies, then refusals once 4 MiB were unsent.
    statuses = []
    slow.setsockopt(zmq.RCVTIMEO, int(REPLY_S * 1000))
    for _ in range(199):
        header, *rest = slow.recv_multipart()
        statuses.append(codec.decode_reply_header(header).status)
    refused = [i for i, st in enumerate(statuses) if st == ErrorCode.REPLIES_UNREAD]
    served = [i for i, st in enumerate(statuses) if st == 0]
    assert refused and served, statuses
    assert len(served) < 40, f"{len(served)} replies of 1 MiB queued for a client that did not read (limit 4 MiB)"
    wait_for("every sent reply to let go of what it pinned", lambda: len(released) == len(served))
    # It read them: served again.
    slow.send_multipart(codec.encode_request(500, m.PingRequest(), 0))
    header, *rest = slow.recv_multipart()
    assert (codec.decode_reply_header(header).request_id, codec.decode_reply_header(header).status) == (500, 0)


def test_a_client_with_many_blocking_requests_waiting_does_not_starve_another(serve, raw):
    """BLOCKING requests used to wait for a worker in the order they arrived: a client that pipelined
    many (an engine flushing its saves, a flood of clears) made another client's request wait behind all
    of them, past its deadline. Clients with requests waiting take turns; each client's own requests
    still start in its order."""
    gate = threading.Event()
    ran: list[tuple[bytes, int]] = []
    observer = Observer()

    def store(call: Call) -> Reply:
        if not ran:
            assert gate.wait(REPLY_S)  # the first call holds the only worker while the rest arrive
        ran.append((bytes(call.client), call.request_id))
        return Reply(m.Ack())

    serve(HandlerSpec(RequestType.STORE_INLINE, store, BLOCKING), workers=1, observer=observer)
    body = m.StoreInlineRequest(context_id=1, keys=[b"k" * 32], rows_per_frame=1)
    started = lambda: sum(e[0] == "started" for e in observer.events)  # noqa: E731
    flooder = raw(b"flooder")
    for rid in range(1, 21):
        flooder.send(rid, body)
    wait_for("the flood received", lambda: started() == 20)
    other = raw(b"other")
    other.send(1, body)
    wait_for("the other request received", lambda: started() == 21)
    gate.set()
    assert other.recv()[:2] == (1, msgspec.msgpack.encode(m.Ack()))
    for _ in range(20):
        assert flooder.recv()[1] == msgspec.msgpack.encode(m.Ack())
    position = ran.index((b"other", 1))
    # The one running when it arrived, and the flooder's turn that came before its own at most.
    assert position <= 2, f"the other client's request ran after {position} of the flooder's"
    assert [rid for who, rid in ran if who == b"flooder"] == list(range(1, 21))  # each client's own order
def test_a_client_that_pipelines_blocking_requests_without_waiting_is_refused_past_its_queue(serve, raw):
    """The loop takes in every request ZeroMQ received and hands BLOCKING ones to the worker pool, each
    keeping its payload in memory until a worker has run it. A client pipelining inline stores faster
    than the workers copy them (here: the one worker is held) grew the server's memory by all it sent
    (a real server: +1.7 GiB for 2.5 GiB sent). Past MAX_QUEUED_REQUESTS requests holding MAX_QUEUED_BYTES
    its next ones are refused (OVERLOADED), each answered once; other clients are not refused, and once
    its queue is done it is served again."""
    gate = threading.Event()
    ran: list[tuple[bytes, int]] = []

    def store(call: Call) -> Reply:
        assert gate.wait(REPLY_S)
        ran.append((call.client, call.request_id))
        return Reply(m.Ack())

    observer = Observer()
    serve(HandlerSpec(RequestType.STORE_INLINE, store, BLOCKING), workers=1, observer=observer)
    size = 8 << 20
    n = 64  # 512 MiB sent: twice MAX_QUEUED_BYTES, and 8 times MAX_QUEUED_REQUESTS
    payload = np.full(size, 7, np.uint8)
    body = m.StoreInlineRequest(context_id=1, keys=[b"k" * 32], rows_per_frame=1)
    flooder = raw(b"flooder")
    for rid in range(1, n + 1):
        flooder.send(rid, body, [payload])
    other = raw(b"other")
    other.send(1, body, [payload])
    wait_for("every request received", lambda: sum(e[0] == "started" for e in observer.events) >= n + 1)
    gate.set()
    replies: dict[int, list] = {}
    for _ in range(n):
        rid, reply, _ = flooder.recv()
        replies.setdefault(rid, []).append(reply)
    assert sorted(replies) == list(range(1, n + 1)) and all(len(r) == 1 for r in replies.values())
    served = [rid for rid, (reply,) in replies.items() if not isinstance(reply, tuple)]
    assert len(served) <= n // 2, (
        f"{len(served)} of {n} pipelined requests of {size >> 20} MiB were queued for the workers"
    )
    refused = {reply[0] for rid, (reply,) in replies.items() if isinstance(reply, tuple)}
    assert refused == {ErrorCode.OVERLOADED}
    assert other.recv()[0:2] == (1, msgspec.msgpack.encode(m.Ack()))  # another client is not refused
    flooder.send(n + 1, body, [payload])  # its queue is done: served again
    assert flooder.recv()[0:2] == (n + 1, msgspec.msgpack.encode(m.Ack()))


@pytest.mark.parametrize("mode", [SYNC, BLOCKING])
def test_a_reply_that_cannot_be_encoded_is_an_internal_error_for_that_request(serve, raw, mode):
    """A handler's reply the codec cannot encode (here a numpy integer where an int belongs) is the
    handler's failure like any other: its request gets an INTERNAL error reply under its own request
    id (a reply under id 0 never reaches the caller waiting for its id), and the request counts as
    finished, or its client is never again seen as silent."""
    observer = Observer()

    def chunk_size(call: Call) -> Reply:
        return Reply(m.ChunkSizeReply(chunk_size=np.int64(256)))

    serve(HandlerSpec(RequestType.GET_CHUNK_SIZE, chunk_size, mode), ping_handler(mode=mode), workers=1, observer=observer)
    me = ClientId(b"encode-client")
    r = raw(me)
    r.send(5, m.GetChunkSizeRequest())
    r.send(6, m.PingRequest())  # a fence run the same way: a reply to request 5 comes before it
    replies = []
    while not replies or replies[-1][0] != 6:
        rid, body, _ = r.recv()
        replies.append((rid, body[0] if isinstance(body, tuple) else "ok"))
    assert replies == [(5, ErrorCode.INTERNAL), (6, "ok")]
    fence = raw(b"fence-client")  # by the time a later request is answered, both have finished
    fence.send(1, m.PingRequest())
    assert fence.recv()[0] == 1
    events = [e for e in observer.seen() if e[1] == me]
    assert all(thread == LOOP for _, _, thread in events)
    kinds = [kind for kind, _, _ in events]  # a BLOCKING pair may start both before either finishes
    assert sorted(kinds) == ["finished", "finished", "started", "started"]
    assert all(kinds[: i + 1].count("started") >= kinds[: i + 1].count("finished") for i in range(len(kinds)))


def test_an_unserved_request_type_is_unknown_request_type(serve, channel):
    server = serve(ping_handler())
    with pytest.raises(KVDepotError) as info:
        channel.call(m.ClearRequest())
    assert (info.value.code, info.value.message) == (ErrorCode.UNKNOWN_REQUEST_TYPE, "CLEAR is not served here")
    assert channel.ping() is True
    assert server.metrics.registry.get_sample_value("kvdepot_requests_total", {"type": "CLEAR"}) == 0
    assert server.metrics.registry.get_sample_value("kvdepot_requests_total", {"type": "PING"}) == 1


def test_a_request_that_waited_past_its_deadline_is_not_run(serve, raw):
    gate = threading.Event()
    ran: list[int] = []
    observer = Observer()

    def slow(call: Call) -> Reply:
        assert gate.wait(REPLY_S)
        return Reply(m.ChunkSizeReply(chunk_size=1))

    def lookup(call: Call) -> Reply:
        ran.append(call.request_id)
        return Reply(m.LookupReply(hits=0))

    serve(
        HandlerSpec(RequestType.GET_CHUNK_SIZE, slow, BLOCKING),
        HandlerSpec(RequestType.LOOKUP, lookup, BLOCKING),
        workers=1,
        observer=observer,
    )
    r = raw()
    r.send(1, m.GetChunkSizeRequest())  # holds the only worker
    r.send(2, m.LookupRequest(context_id=1, keys=[]), timeout_ms=1)
    wait_for("both requests received", lambda: len(observer.events) == 2)
    received = observer.events[1][3]  # after the server noted its arrival, so after its deadline began
    while time.monotonic() <= received + 0.001:
        pass  # until its 1 ms have surely passed (on the same clock the server uses)
    gate.set()
    got = {}
    for _ in range(2):
        rid, body, _ = r.recv()
        got[rid] = body
    assert msgspec.msgpack.decode(got[1], type=m.ChunkSizeReply) == m.ChunkSizeReply(chunk_size=1)
    assert got[2] == (ErrorCode.DEADLINE_EXCEEDED, "the request waited past its deadline")
    assert ran == []


# --- payload -------------------------------------------------------------------------------------------


def test_payload_frames_reach_the_handler(serve, channel):
    seen: list[list[bytes]] = []

    def store_inline(call: Call) -> Reply:
        seen.append([bytes(f) for f in call.payload])
        return Reply(m.StoreInlineReply(statuses=[len(f) for f in call.payload]))

    serve(HandlerSpec(RequestType.STORE_INLINE, store_inline, BLOCKING))
    a, b = b"abc", np.arange(1000, dtype=np.uint16)
    reply = channel.call(m.StoreInlineRequest(context_id=1, keys=[b"k"], rows_per_frame=1), payload=[a, b])
    assert reply == m.StoreInlineReply(statuses=[3, 2000])
    assert seen == [[a, b.tobytes()]]


@pytest.mark.parametrize("mode", [SYNC, BLOCKING])
def test_reply_payload_comes_back_and_on_sent_runs_once_zeromq_is_done(serve, channel, closing, mode):
    sent = threading.Event()
    calls: list[str] = []
    frames = [np.arange(4096, dtype=np.uint8), np.full(100_000, 7, np.uint8)]

    def on_sent() -> None:
        calls.append(threading.current_thread().name)
        sent.set()

    def retrieve(call: Call) -> Reply:
        return Reply(m.RetrieveInlineReply(found=2, rows_per_frame=1), payload=frames, on_sent=on_sent)

    server = serve(HandlerSpec(RequestType.RETRIEVE_INLINE, retrieve, mode))
    reply, payload = channel.call(m.RetrieveInlineRequest(context_id=1, keys=[b"a", b"b"]), want_payload=True)
    assert reply == m.RetrieveInlineReply(found=2, rows_per_frame=1)
    assert [bytes(f) for f in payload] == [f.tobytes() for f in frames]
    assert sent.wait(REPLY_S)
    assert calls == [LOOP]  # the loop thread watches ZeroMQ's trackers
    server.close()
    assert calls == [LOOP]  # once, also after a close


def test_on_sent_of_a_reply_without_payload_runs_at_once(serve, channel):
    calls: list[str] = []

    def ping(call: Call) -> Reply:
        return Reply(m.PingReply(), on_sent=lambda: calls.append(threading.current_thread().name))

    def chunk_size(call: Call) -> Reply:
        return Reply(m.ChunkSizeReply(chunk_size=1))

    serve(HandlerSpec(RequestType.PING, ping, SYNC), HandlerSpec(RequestType.GET_CHUNK_SIZE, chunk_size, SYNC))
    assert channel.ping() is True
    # A later request is dispatched only once the loop is done with the ping, its on_sent included.
    assert channel.call(m.GetChunkSizeRequest()) == m.ChunkSizeReply(chunk_size=1)
    assert calls == [LOOP]  # once, on the loop thread, with no tracker to wait for


# --- what the owner is told ----------------------------------------------------------------------------


def test_the_observer_sees_each_request_start_and_finish_on_the_loop_thread(serve, raw):
    observer = Observer()

    def chunk_size(call: Call) -> Reply:
        return Reply(m.ChunkSizeReply(chunk_size=256))

    serve(
        ping_handler(),
        HandlerSpec(RequestType.GET_CHUNK_SIZE, chunk_size, BLOCKING),
        raising(RequestType.LOOKUP, ValueError("boom"), BLOCKING),
        observer=observer,
    )
    me = ClientId(b"observed-client")
    r = raw(me)
    for rid, body in enumerate([m.PingRequest(), m.GetChunkSizeRequest(), m.ClearRequest(), m.LookupRequest(context_id=1, keys=[])], 1):
        r.send(rid, body)
        assert r.recv()[0] == rid
    wait_for("the last finish", lambda: len(observer.events) == 6)
    # CLEAR is served by nobody: refused before it starts, so never told.
    assert observer.seen() == [("started", me, LOOP), ("finished", me, LOOP)] * 3


def disconnects(server: RpcServer) -> dict[str, float]:
    get = server.metrics.registry.get_sample_value
    return {kind: get("kvdepot_disconnects_total", {"kind": kind}) or 0.0 for kind in ("goodbye", "no_goodbye")}


def test_a_goodbye_counts_once_for_its_own_disconnect_and_not_for_a_client_that_goes_on(serve, raw):
    """An UNREGISTER was counted, and the next disconnect of anyone took it: a client that unregistered a
    context and went on (as KVClient does when it cannot use a context it registered) made a client that
    died later read as a goodbye, and so did the second of two contexts one client unregistered."""

    def ack(call: Call) -> Reply:
        return Reply(m.Ack())

    server = serve(ping_handler(), HandlerSpec(RequestType.UNREGISTER_CONTEXT, ack, SYNC), goodbyes=(RequestType.UNREGISTER_CONTEXT,),
                   housekeeping_interval_s=0.01)  # fmt: skip

    def say(r: Raw, *bodies: msgspec.Struct) -> None:
        for rid, body in enumerate(bodies, 1):
            r.send(rid, body)
            assert r.recv()[0] == rid

    stays = raw(b"stays")
    say(stays, m.UnregisterContextRequest(context_id=1), m.PingRequest())  # unregisters, then goes on: no goodbye
    dies = raw(b"dies")
    say(dies, m.PingRequest())
    dies.close()
    wait_for("the first disconnect", lambda: sum(disconnects(server).values()) == 1)
    assert disconnects(server) == {"goodbye": 0, "no_goodbye": 1}

    leaves = raw(b"leaves")
    say(leaves, m.UnregisterContextRequest(context_id=2), m.UnregisterContextRequest(context_id=3))  # two contexts, one goodbye
    leaves.close()
    wait_for("the second disconnect", lambda: sum(disconnects(server).values()) == 2)
    dies_too = raw(b"dies-too")
    say(dies_too, m.PingRequest())
    dies_too.close()
    wait_for("the third disconnect", lambda: sum(disconnects(server).values()) == 3)
    assert disconnects(server) == {"goodbye": 1, "no_goodbye": 2}


def test_housekeeping_runs_on_the_loop_thread_and_survives_its_own_failure(serve, channel):
    handler_thread: list[int] = []
    runs: list[int] = []
    second = threading.Event()

    def housekeeping() -> None:
        runs.append(threading.get_ident())
        if len(runs) >= 2:
            second.set()
        raise RuntimeError("housekeeping failed")  # logged; the loop goes on

    def ping(call: Call) -> Reply:
        handler_thread.append(threading.get_ident())
        return Reply(m.PingReply())

    server = serve(HandlerSpec(RequestType.PING, ping, SYNC), housekeeping=housekeeping, housekeeping_interval_s=0.01)
    assert second.wait(REPLY_S)
    assert channel.ping() is True
    assert len(set(runs)) == 1 and runs[0] == handler_thread[0]  # the SYNC handlers' thread: the loop
    assert server.alive


def test_the_channel_is_told_each_answered_request_type_errors_included(serve, channel):
    serve(ping_handler(), raising(RequestType.LOOKUP, UnknownLease("gone"), SYNC))
    answered: list[RequestType] = []
    channel.answered = answered.append
    assert channel.ping() is True
    with pytest.raises(UnknownLease):
        channel.call(m.LookupRequest(context_id=1, keys=[]))
    with pytest.raises(KVDepotError):
        channel.call(m.ClearRequest())
    results = channel.pipeline([(m.PingRequest(), ()), (m.PingRequest(), ())])
    assert results == [m.PingReply(), m.PingReply()]
    assert answered == [RequestType.PING, RequestType.LOOKUP, RequestType.CLEAR, RequestType.PING, RequestType.PING]


# --- one server per ipc path ---------------------------------------------------------------------------


def test_a_second_server_on_the_same_ipc_path_is_refused(serve, url, channel, closing):
    first = serve(ping_handler())
    second = RpcServer([url], [ping_handler()])
    closing.append(second)
    with pytest.raises(EndpointInUse, match="another kvdepot server is serving"):
        second.start()
    second.close()
    assert channel.ping() is True  # the first keeps its endpoint, socket file and all
    path = url.removeprefix("ipc://")
    assert os.path.exists(path)

    first.close()
    assert not os.path.exists(path)  # a clean exit removes the socket file
    third = RpcServer([url], [ping_handler()])
    closing.append(third)
    third.start()  # the endpoint is free again
    again = RpcChannel(url).open()
    closing.append(again)
    assert again.ping() is True


# --- request records for the event bus ---------------------------------------------------------------


@pytest.mark.parametrize("subscribed", [True, False])
def test_a_request_record_is_built_only_when_someone_reads_it(serve, channel, subscribed):
    """Every answered request (a success or an error) is one RequestDone on the bus when a subscriber
    wants them; with none (only other kinds subscribed), the loop publishes nothing at all."""
    from kvdepot.events import ChunkRequestDone, RequestDone
    from kvdepot.observability.bus import EventBus

    bus = EventBus(1024)
    got: list = []
    bus.subscribe("test", got.extend, (RequestDone,) if subscribed else (ChunkRequestDone,))
    bus.start()
    try:
        serve(ping_handler(), raising(RequestType.LOOKUP, KVDepotError("arena full", ErrorCode.NO_SPACE), SYNC), events=bus)
        assert channel.ping() is True
        with pytest.raises(KVDepotError):
            channel.call(m.LookupRequest(context_id=1, keys=[]))
        bus.flush()
        if subscribed:
            assert [(e.rtype, e.outcome) for e in got] == [("PING", "ok"), ("LOOKUP", "NO_SPACE")]
        else:
            assert got == [] and bus.stats().published == 0
    finally:
        bus.close()


# --- two-phase calls (begin, then collect) -------------------------------------------------------------


def test_begun_calls_to_two_servers_are_in_flight_at_once_and_each_reply_reaches_its_caller(serve, tmp_path, closing):
    """``begin`` sends at once and holds the channel until ``result``: two slow servers asked through
    two channels answer in about one handler's time, not two; a second collect is refused; an abandoned
    call frees the channel and its late reply is dropped by the next call."""
    slow = HandlerSpec(RequestType.PING, lambda c: (time.sleep(0.5), Reply(m.PingReply(ok=True)))[1], BLOCKING)
    urls = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]
    channels = []
    for url in urls:
        server = RpcServer([url], [slow])
        closing.append(server)
        server.start()
        channels.append(RpcChannel(url).open())
        closing.append(channels[-1])
    t0 = time.monotonic()
    pending = [ch.begin(m.PingRequest(), timeout_s=5) for ch in channels]
    assert [p.result().ok for p in pending] == [True, True]
    assert time.monotonic() - t0 < 0.95, "the two requests were not in flight together"  # one after the other: >= 1.0 s
    with pytest.raises(RuntimeError, match="already collected"):
        pending[0].result()

    held = channels[0].begin(m.PingRequest(), timeout_s=5)
    other = threading.Thread(target=lambda: results.append(channels[0].call(m.PingRequest(), timeout_s=5).ok))
    results: list = []
    other.start()
    time.sleep(0.1)
    assert results == []  # the channel is held by the begun call
    held.abandon()
    other.join(5)
    assert results == [True]  # the abandoned call's late reply went to nobody


# --- a worker thread that cannot start (no memory for its stack) -----------------------------------------


@pytest.fixture
def no_worker_starts(monkeypatch) -> Callable[[], list[str]]:
    """``refuse()``: from now on, the RPC pool's threads cannot start (as where pthread_create fails:
    no memory for a stack, the process's thread limit); returns the names refused so far, as they come."""
    real_start = threading.Thread.start
    refused: list[str] = []

    def start(self):
        if self.name.startswith("kvdepot-worker"):
            refused.append(self.name)
            raise RuntimeError("can't start new thread")  # what CPython raises then
        return real_start(self)

    def refuse() -> list[str]:
        monkeypatch.setattr(threading.Thread, "start", start)
        return refused

    return refuse


def lookup_handler(hits: int = 7) -> HandlerSpec:
    return HandlerSpec(RequestType.LOOKUP, lambda call: Reply(m.LookupReply(hits=hits)), BLOCKING)


def test_a_request_no_worker_thread_can_start_for_fails_clearly(serve, raw, no_worker_starts, monkeypatch):
    """It was answered SHUTTING_DOWN "server is shutting down", with nothing in the server's log:
    connectors took a server short of memory for one going away."""
    serve(lookup_handler(), workers=2)
    b = raw()
    no_worker_starts()
    b.send(1, m.LookupRequest(context_id=1, keys=[]))
    rid, (code, message), _ = b.recv()
    assert rid == 1 and code is ErrorCode.INTERNAL, message
    assert "could not start a worker thread" in message and "can't start new thread" in message
    monkeypatch.undo()
    b.send(2, m.LookupRequest(context_id=1, keys=[]))  # threads start again: served as ever
    rid, body, _ = b.recv()
    assert rid == 2 and msgspec.msgpack.decode(body, type=m.LookupReply).hits == 7


def test_a_request_a_running_worker_can_take_waits_for_it_when_no_thread_can_start(serve, raw, no_worker_starts):
    """A second worker that cannot start is no reason to refuse the request: the running one takes it in
    its turn. It was refused (SHUTTING_DOWN) all the same."""
    gate, running = threading.Event(), threading.Event()

    def slow(call: Call) -> Reply:
        running.set()
        assert gate.wait(REPLY_S)
        return Reply(m.ChunkSizeReply(chunk_size=1))

    serve(HandlerSpec(RequestType.GET_CHUNK_SIZE, slow, BLOCKING), lookup_handler(), workers=2)
    a, b = raw(b"client-a"), raw(b"client-b")
    a.send(1, m.GetChunkSizeRequest())  # starts a worker, and holds it
    assert running.wait(REPLY_S)
    refused = no_worker_starts()
    b.send(2, m.LookupRequest(context_id=1, keys=[]))  # a second worker cannot start
    wait_for("a second worker to be refused", lambda: len(refused) == 1)
    time.sleep(0.05)  # the loop deals with it (it replied at once, before)
    gate.set()
    assert a.recv()[0] == 1
    rid, body, _ = b.recv()
    assert rid == 2 and not isinstance(body, tuple), body  # an error reply is (code, message)
    assert msgspec.msgpack.decode(body, type=m.LookupReply).hits == 7
