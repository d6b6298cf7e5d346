"""RpcChannel: typed requests to one kvdepot endpoint over one ZeroMQ DEALER socket.

It owns request ids, deadlines and pipelining, and nothing above them (no context, no KV): a KVClient
uses one, and so can a node calling another node. It is safe for several threads at once: each call,
pipeline or begun call (``begin``, until its reply is collected) holds the channel for its whole
exchange, so a reply always reaches the thread that asked;
others wait their turn, within their own deadline (a call whose deadline passes while another thread
holds the channel times out: no call waits past its deadline), and a late reply to a request given up
on is recognised by its id and dropped.

A request may also be *sent behind* (``send_behind``): sent now, its reply left for whichever later
exchange on the channel receives it (ZeroMQ keeps one connection's messages in order, so the server
has handled it before anything this channel sends later). For finishes whose outcome the caller does
not wait for: a shared-memory read's release (one round trip a retrieve instead of two).

Life cycle: ``RpcChannel(url)`` builds nothing; ``open`` connects the socket; ``close`` closes it. A
``Heartbeat`` runs a callback on its own thread, started and stopped explicitly. A channel belongs to the
process that opened it: in a ``fork()`` child every request raises ``ForkedChannel`` at once (ZeroMQ
sockets do not survive a fork: libzmq answers the child's every wait with EINTR, which pyzmq retries
forever, so a request would spin past any deadline), and ``close`` only drops the child's copy.

A failed security handshake (CurveZMQ keys missing, not admitted, or the wrong server key) is silent in
ZeroMQ: the socket just retries. A monitor on the socket records it, and a request that gets no reply
in time raises ``HandshakeRefused`` saying what failed instead of a bare timeout.

``answered`` (optional) is told the request type of every request the server answered, an error reply
included: proof that the server is reachable for that kind of request (the connectors' circuit breakers
close on it). It runs on the calling thread and must be quick.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.errors import ChannelBusy, ErrorCode, ForkedChannel, HandshakeRefused, KVDepotError, KVDepotTimeout
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.messages import RequestType
from kvdepot.rpc.endpoints import enable_ipv6
from kvdepot.rpc.security import SocketSecurity

log = logging.getLogger(__name__)

OnReply = Callable[[int, object, list], None]  # (request index, typed reply, payload frames)
OnBehind = Callable[[object, KVDepotError | None], None]  # (typed reply or None, the error the server answered or None)
MAX_BEHIND = 64  # replies to requests sent behind that may wait unread; past it, the oldest is forgotten
MAX_LATE = 4096  # timed-out calls whose late reply grants something (``on_late``), kept apart: past it, the oldest is forgotten
# ZeroMQ's longest receive timeout (RCVTIMEO is an int of milliseconds: 24.8 days). A longer wait ("as long
# as it takes": a huge timeout_s) is cut to it; asked for as is, every request raised OverflowError.
MAX_WAIT_S = (2**31 - 1) / 1000
BORROWED_GRACE_S = 2.0  # past an error or the deadline: how long a server that answers may take to read what was sent
Answered = Callable[[RequestType], None]

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class RpcChannel:
    def __init__(self, url: str, context: zmq.Context | None = None, security: SocketSecurity | None = None) -> None:
        self.url = url
        self._security = security
        self._zctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._handshake_failure: int | None = None  # the last failed handshake's event, until one succeeds
        self._ids = itertools.count(1)
        self._rcvtimeo = -1
        self._pid = 0  # the process that opened the socket (``open``): a fork() child may not use it
        self._lock = threading.RLock()
        self.last_request = 0.0  # monotonic time of the last request sent
        self.closed = False
        self.answered: Answered | None = None
        self.unanswered = 0  # its owner's count of calls in a row that timed out (the peer tier keeps a few)
        self._behind: dict[int, tuple[object, OnBehind]] = {}  # request id -> (body, on_reply), lock held
        # The same for calls that timed out with an ``on_late``: their late reply grants something (a
        # lease, a pin) that only ``on_late`` gives back, so they are not forgotten for MAX_BEHIND
        # releases sent behind meanwhile (a stalled server and short deadlines make many of both).
        self._late: dict[int, tuple[object, OnBehind]] = {}
        # Requests sent behind while another thread held the channel: the holder sends them when it lets
        # go, or the next exchange before its own request (``_flush``), so none waits for the channel.
        self._outbox: collections.deque[tuple[object, OnBehind, float]] = collections.deque()

    def __repr__(self) -> str:
        return f"RpcChannel({self.url!r}, open={self._sock is not None and not self.closed})"

    def open(self) -> RpcChannel:
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._security is not None:
            self._security.apply_client(sock)
        enable_ipv6(sock, self.url)  # tcp://[::1]:PORT: ZeroMQ refuses an IPv6 address without it
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        sock.connect(self.url)
        self._sock = sock
        self._rcvtimeo = -1
        self._pid = os.getpid()
        return self

    @property
    def forked(self) -> bool:
        """True in a ``fork()`` child of the process that opened the channel: it may not use it."""
        return self._pid != 0 and self._pid != os.getpid()

    def _replace_socket(self) -> None:
        """Drop the connection and everything queued on it, and connect afresh (a new routing id: to
        the server a new client, which registers again). Called with the lock held. Replies to requests
        sent behind go with the old connection: nobody hears them (the server did or did not handle them;
        its leases are the old identity's, which the new one could not finish anyway)."""
        self._behind.clear()
        self._late.clear()
        self._outbox.clear()
        self._close_socket()
        if not self.closed:
            self.open()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._behind.clear()
            self._late.clear()
            self._outbox.clear()
            self._close_socket()

    def _close_socket(self) -> None:
        """Close the socket (LINGER 0: what it still queues is dropped) and its monitor. Lock held. In a
        fork() child only the references go: the socket is the parent's, and libzmq is not to be touched."""
        if self.forked:
            self._sock = self._monitor = None
            return
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)

    def held(self, timeout_s: float):
        """The channel's lock, for a caller that wants it only if it comes within ``timeout_s``
        (``with ch.held(t) as got: if got: ...``): the heartbeat does not queue behind a request."""
        return _TryLock(self, timeout_s)

    # --- requests ------------------------------------------------------------------------------------

    def call(self, body, payload: Sequence = (), timeout_s: float = 10.0, want_payload: bool = False, closing: bool = False,
             on_late: OnBehind | None = None):  # fmt: skip
        """One request, one reply (typed; the server's error reply raises the matching KVDepotError).

        ``on_late``: when this call times out, its reply may still come (the server handled the request
        after the caller gave up: its deadline starts when its loop receives the request, not when it
        was sent). The reply is then handed to ``on_late`` as one sent behind (``send_behind``), so a
        request that took something (a lease) can give it back instead of leaving it to nobody."""
        deadline = time.monotonic() + timeout_s
        with self._exclusive(body, timeout_s):
            rid = self._send(body, payload, deadline - time.monotonic(), closing)
            try:
                return self._reply_to(body, rid, deadline, want_payload)
            except KVDepotTimeout:
                if on_late is not None:
                    self._keep_behind(rid, body, on_late, late=True)
                raise

    def begin(self, body, timeout_s: float = 10.0) -> PendingCall:
        """Send one request now and collect its reply later (``PendingCall.result``), so that a caller
        can ask several servers at once, or work while this one answers. The channel stays held from
        here until the reply is collected or ``abandon``ed: other threads wait as for a call."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
            raise ChannelBusy(f"{type(body).__name__} waited {timeout_s:.3g} s for the channel another thread holds")
        try:
            self._flush()
            rid = self._send(body, (), deadline - time.monotonic())
        except BaseException:
            self._unlock()
            raise
        return PendingCall(self, body, rid, deadline)

    def send_behind(self, body, on_reply: OnBehind, timeout_s: float = 10.0) -> None:
        """Send one request (no payload) and return without waiting for its reply: a later exchange on
        this channel that receives it calls ``on_reply(result, None)``, or ``on_reply(None, error)`` for
        the server's error reply, on that exchange's thread, with the channel held (it must be quick; it
        may send behind again). ``timeout_s`` is the server's deadline for handling it. This never
        receives (a reply it took could be the one a surrounding exchange waits for): past
        ``MAX_BEHIND`` unread replies the oldest is forgotten, its reply then dropped as a late one.

        It never waits for the channel either: while another thread holds it, the request is queued,
        and sent by that thread when it lets go of the channel (or by the next exchange, before its
        own request, so one connection's order still holds for this thread's next request). Waiting
        instead, behind other threads' exchanges that a stalled server makes last their timeout each,
        it could go unsent: a read's release, and the lease then quarantined for the process's life."""
        if self.closed:
            raise KVDepotError("client is closed", ErrorCode.CONNECTION)
        self._outbox.append((body, on_reply, timeout_s))
        if self._lock.acquire(blocking=False):
            try:
                self._flush()
            finally:
                self._unlock()

    def _flush(self) -> None:
        """Send what ``send_behind`` queued. Lock held."""
        while self._outbox:
            body, on_reply, timeout_s = self._outbox.popleft()
            try:
                rid = self._send(body, (), timeout_s)
            except KVDepotError as exc:  # closed, or not open: nothing queued can go any more
                log.debug("kvdepot: %d requests sent behind dropped: %s", len(self._outbox) + 1, exc)
                self._outbox.clear()
                return
            self._keep_behind(rid, body, on_reply)

    def _unlock(self) -> None:
        """Let go of the channel, sending first what other threads queued behind meanwhile."""
        self._lock.release()
        while self._outbox and self._lock.acquire(blocking=False):
            try:
                self._flush()
            finally:
                self._lock.release()

    def _keep_behind(self, rid: int, body, on_reply: OnBehind, late: bool = False) -> None:
        """Have a later exchange hand ``rid``'s reply to ``on_reply``. Lock held. ``late``: a call's
        ``on_late`` (bounded by MAX_LATE, apart from what is sent behind)."""
        kept, bound = (self._late, MAX_LATE) if late else (self._behind, MAX_BEHIND)
        kept[rid] = (body, on_reply)
        while len(kept) > bound:
            forgotten = next(iter(kept))
            log.debug("kvdepot: %d replies are unread; forgetting request %d", len(kept), forgotten)
            del kept[forgotten]

    def _took_behind(self, header, reply_body) -> bool:
        """If ``header`` answers a request sent behind: decode it, hand it over, True. Lock held."""
        pending = self._behind.pop(header.request_id, None) or self._late.pop(header.request_id, None)
        if pending is None:
            return False
        body, on_reply = pending
        rtype = codec.request_type_of(body)
        if self.answered is not None:
            self.answered(rtype)
        try:
            result, error = codec.decode_reply_body(rtype, header, reply_body), None
        except KVDepotError as exc:
            result, error = None, exc
        try:
            on_reply(result, error)
        except Exception:
            log.exception("kvdepot: handling the reply to %s sent behind failed", type(body).__name__)
        return True

    def _reply_to(self, body, rid: int, deadline: float, want_payload: bool = False):
        """Receive until the reply to ``rid`` comes; decode it. Called with the lock held."""
        while True:
            header, reply_body, frames = self._recv(body, deadline)
            if header.request_id != rid:
                self._took_behind(header, reply_body)  # else a late reply to a request given up on
                continue
            rtype = codec.request_type_of(body)
            if self.answered is not None:
                self.answered(rtype)
            result = codec.decode_reply_body(rtype, header, reply_body)
            return (result, frames) if want_payload else result

    def pipeline(self, requests: list[tuple[object, Sequence]], on_reply: OnReply | None = None, timeout_s: float = 10.0, window: int = 4,
                 borrowed: bool = False, until: float | None = None) -> list:  # fmt: skip
        """Send ``requests`` with up to ``window`` in flight and collect every reply (in request order).

        ``on_reply(index, result, frames)`` runs as each reply arrives, so a caller can consume one
        reply's payload while ZeroMQ is still receiving the next. The first error is raised (the other
        replies are then discarded as stale when they arrive).

        ``borrowed``: the payload is the caller's memory, sent without a copy. Then nothing of it is
        still ZeroMQ's when this returns or raises: what was sent is waited for (the server takes it),
        and where the server does not (hung, gone) past the deadline, the connection is dropped with
        what it still queues. Else a caller that reuses its buffer after an error or a timeout would
        have ZeroMQ send the new bytes later, stored under the old request's keys.
        """
        deadline = time.monotonic() + timeout_s
        if until is not None:
            deadline = min(deadline, until)
        with self._exclusive(requests[0][0] if requests else None, timeout_s):
            trackers: list[zmq.MessageTracker] | None = [] if borrowed else None
            try:
                return self._pipeline(requests, on_reply, timeout_s, window, deadline, trackers, until)
            finally:
                if trackers:
                    self._let_go(trackers, deadline)

    def _let_go(self, trackers: list[zmq.MessageTracker], deadline: float) -> None:
        """Return once ZeroMQ holds none of the borrowed frames. Called with the lock held."""
        waiting = [t for t in trackers if not t.done]
        end = max(deadline, time.monotonic() + BORROWED_GRACE_S)
        while waiting and time.monotonic() < end:
            try:
                waiting[0].wait(timeout=max(0.0, end - time.monotonic()))
                waiting.pop(0)
            except zmq.NotDone:
                break
        if not waiting:
            return
        self._replace_socket()  # its queue goes with it: ZeroMQ frees those frames now, unsent
        for t in waiting:
            t.wait()  # prompt: the messages are being discarded

    def _pipeline(self, requests, on_reply: OnReply | None, timeout_s: float, window: int, deadline: float,
                  trackers: list[zmq.MessageTracker] | None, until: float | None) -> list:  # fmt: skip
        """``pipeline``'s exchange. Called with the lock held. Each reply that arrives gives the next
        ``timeout_s`` again (a many-GB transfer that keeps moving is not cut at one timeout's worth of
        bytes), never past ``until``."""
        results: list = [None] * len(requests)
        pending: dict[int, int] = {}
        sent = 0
        while sent < len(requests) or pending:
            while sent < len(requests) and len(pending) < window:
                body, payload = requests[sent]
                pending[self._send(body, payload, timeout_s, trackers=trackers)] = sent
                sent += 1
            header, reply_body, frames = self._recv(requests[0][0], deadline)
            index = pending.pop(header.request_id, None)
            if index is None:
                self._took_behind(header, reply_body)
                continue
            deadline = time.monotonic() + timeout_s if until is None else min(time.monotonic() + timeout_s, until)
            rtype = codec.request_type_of(requests[index][0])
            if self.answered is not None:
                self.answered(rtype)
            result = codec.decode_reply_body(rtype, header, reply_body)
            results[index] = result
            if on_reply is not None:
                on_reply(index, result, frames)
        return results

    @contextmanager
    def _exclusive(self, body, timeout_s: float) -> Iterator[None]:
        """The channel for one exchange, if it comes within ``timeout_s``."""
        if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
            raise ChannelBusy(f"{type(body).__name__} waited {timeout_s:.3g} s for the channel another thread holds")
        try:
            self._flush()
            yield
        finally:
            self._unlock()

    def _send(self, body, payload: Sequence, timeout_s: float, closing: bool = False, trackers: list | None = None) -> int:
        """Send one request; returns its id. Called with the lock held. ``trackers``: collect one per
        payload frame, done once ZeroMQ has let go of it (borrowed memory)."""
        if self.closed and not closing:
            raise KVDepotError("client is closed", ErrorCode.CONNECTION)
        sock = self._sock
        if sock is None:
            raise KVDepotError("channel is not open", ErrorCode.CONNECTION)
        self._check_process()
        rid = next(self._ids)
        header, encoded = codec.encode_request(rid, body, max(1, int(min(timeout_s, MAX_WAIT_S) * 1000)))  # 0 would mean "none"
        # Small frames are copied (cheaper than zero-copy bookkeeping); KV payload is not.
        if payload:
            sock.send(header, zmq.SNDMORE)
            sock.send(encoded, zmq.SNDMORE)
            if trackers is None:
                sock.send_multipart(payload, copy=False)
            else:
                frames = [zmq.Frame(p, track=True) for p in payload]
                sock.send_multipart(frames, copy=False)
                trackers.extend(f.tracker for f in frames)
        else:
            sock.send_multipart((header, encoded))
        self.last_request = time.monotonic()
        return rid

    def _recv(self, body, deadline: float):
        """Receive the next reply (any request id) before ``deadline``. Called with the lock held."""
        sock = self._sock
        assert sock is not None
        self._check_process()
        # A blocking recv with RCVTIMEO saves a poll() syscall per request. Past the deadline it is 0: a
        # reply that is already here is still taken (a begun call collected after a slower one's).
        remaining_ms = max(0, math.ceil(min(deadline - time.monotonic(), MAX_WAIT_S) * 1000))  # up: never give up before it
        if remaining_ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
            self._rcvtimeo = remaining_ms
        try:
            reply_header = sock.recv()
            reply_body = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
            frames = []
            while sock.getsockopt(zmq.RCVMORE):
                frames.append(sock.recv(copy=False))
        except zmq.Again:
            self._raise_if_refused()
            raise KVDepotTimeout(f"{type(body).__name__} got no reply from {self.url} in time") from None
        return codec.decode_reply_header(reply_header), reply_body, frames

    def _check_process(self) -> None:
        """ForkedChannel in a fork() child (before libzmq, which would spin there forever)."""
        if self.forked:
            raise ForkedChannel(
                f"this process ({os.getpid()}) is a fork() of process {self._pid}, which connected to {self.url}: a "
                f"ZeroMQ connection does not survive fork(), so it may not be used here; create a KVClient in this process"
            )

    def _raise_if_refused(self) -> None:
        """After a timeout: raise HandshakeRefused if the connection's last handshake failed."""
        monitor = self._monitor
        while monitor is not None:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._handshake_failure = None if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else int(event)
        if self._handshake_failure is None:
            return
        if self._handshake_failure == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            check = "this client's public key is not among those the server admits (its --curve-clients)"
        elif self._security is None:
            check = "the server requires CurveZMQ keys and this client has none (give curve= / the connector's curve_* keys)"
        else:
            check = "the server's public key this client was given (curve_server_key), and that the server uses CurveZMQ"
        raise HandshakeRefused(f"the server at {self.url} refused the handshake (CurveZMQ): check {check}")

    def ping(self, timeout_s: float = 10.0) -> bool:
        return self.call(m.PingRequest(), timeout_s=timeout_s).ok


class PendingCall:
    """A request ``RpcChannel.begin`` sent, whose reply is not collected yet.

    States: SENT (holds the channel) -> DONE by ``result`` (the reply, or its error raised) or by
    ``abandon`` (a reply that comes later is dropped as stale by the next call). Either releases the
    channel; a second ``result`` or ``abandon`` is refused. Collect on the thread that began it: the
    channel's lock belongs to that thread."""

    def __init__(self, channel: RpcChannel, body, rid: int, deadline: float) -> None:
        self._channel, self.body, self._rid, self._deadline = channel, body, rid, deadline
        self._done = False

    def result(self):
        self._finish()
        try:
            return self._channel._reply_to(self.body, self._rid, self._deadline)
        finally:
            self._channel._unlock()

    def abandon(self) -> None:
        self._finish()
        self._channel._unlock()

    def _finish(self) -> None:
        if self._done:
            raise RuntimeError("this call's reply was already collected or abandoned")
        self._done = True


class _TryLock:
    def __init__(self, channel: RpcChannel, timeout_s: float) -> None:
        self._channel, self._timeout, self._got = channel, timeout_s, False

    def __enter__(self) -> bool:
        self._got = self._channel._lock.acquire(timeout=self._timeout)
        return self._got

    def __exit__(self, *exc) -> None:
        if self._got:
            self._channel._unlock()


class Heartbeat:
    """Calls ``tick()`` every ``interval_s`` on its own thread, from ``start`` until ``stop``; ``kick``
    runs the next tick at once. A tick that raises is logged by the caller's tick itself; the loop never
    dies of one."""

    def __init__(self, interval_s: float, tick: Callable[[], None], name: str = "kvdepot-heartbeat") -> None:
        self._interval = interval_s
        self._tick = tick
        self._name = name
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception:  # never let the heartbeat die: the server would declare us gone
                pass
