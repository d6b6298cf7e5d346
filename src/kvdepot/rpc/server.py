"""The ROUTER loop: receive → decode → dispatch → exactly one reply per request.

SYNC handlers run on the loop thread and must be quick (no big copies). BLOCKING handlers run on a
thread pool; a ZeroMQ socket belongs to one thread, so their replies come back to the loop through the
ROUTER itself: each worker has an inproc DEALER connected to it, under a routing id with a random
per-server prefix no client can guess. The loop thus blocks in one ``recv`` (with a timeout for
housekeeping) and never pays for a poll over several sockets on the round trip. Any exception a
handler raises becomes an error reply: a request is never left unanswered. A reply may carry raw payload
frames sent without a copy (``copy=False``); its ``on_sent`` callback runs once ZeroMQ has let go of
those buffers, so the read locks that keep them valid are released only then.

The loop knows requests, not clients: who is alive, what a client holds and what happens when it goes
are its owner's business. It tells a ``RequestObserver`` when each request starts and finishes, and
runs the owner's ``housekeeping`` on the loop thread every ``housekeeping_interval_s`` (the kvdepot
server watches its clients there: ``kvdepot.server.liveness``).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvdepot.errors import EndpointInUse, ErrorCode, KVDepotError
from kvdepot.events import NO_EVENTS, EventSink, RequestDone
from kvdepot.limits import MAX_FRAME_BYTES, MAX_QUEUED_BYTES, MAX_QUEUED_REQUESTS, MAX_UNSENT_BYTES
from kvdepot.observability.metrics import Metrics
from kvdepot.protocol import codec
from kvdepot.protocol.messages import RequestType
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.rpc.endpoints import IpcClaim, enable_ipv6
from kvdepot.rpc.security import SocketSecurity
from kvdepot.types import ClientId

log = logging.getLogger(__name__)
_POLLIN = int(zmq.POLLIN)  # an int: ``int & zmq.POLLIN`` builds an enum Flag, microseconds on the hot path


_HANDSHAKE_FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class RequestObserver(Protocol):
    """Told, on the loop thread, when a client's request starts and when its reply has been handed to
    ZeroMQ (a client with a request in flight is not silent)."""

    def request_started(self, client: ClientId) -> None: ...

    def request_finished(self, client: ClientId) -> None: ...


class _NoObserver:
    def request_started(self, client: ClientId) -> None:
        pass

    def request_finished(self, client: ClientId) -> None:
        pass


class RpcServer:
    def __init__(
        self,
        endpoints: list[str],
        handlers: list[HandlerSpec] = (),
        *,
        observer: RequestObserver | None = None,
        workers: int = 4,
        io_threads: int = 1,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        housekeeping: Callable[[], None] | None = None,
        housekeeping_interval_s: float = 0.1,
        goodbyes: Collection[RequestType] = (),
        metrics: Metrics | None = None,
        security: SocketSecurity | None = None,
        events: EventSink = NO_EVENTS,
        max_unsent_bytes: int = MAX_UNSENT_BYTES,
        max_queued_requests: int = MAX_QUEUED_REQUESTS,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        """``goodbyes``: request types after which a client closes its connection on purpose (its
        disconnect is then counted as a goodbye, not as a client that died; once per connection however
        many it sends, and not at all if it sends another request after it). ``io_threads``: ZeroMQ's
        threads moving bytes between the sockets and the kernel; each connection is served by one, so
        more than one lets inline payloads to several clients move at once."""
        self._endpoints = endpoints
        self._security = security  # None: plain sockets; else only clients with admitted keys get in
        self._handlers: dict[RequestType, HandlerSpec] = {}
        self.observer: RequestObserver = observer or _NoObserver()
        self._goodbye_types = frozenset(goodbyes)
        self._workers = workers
        self._io_threads = io_threads
        self._max_frame = max_frame_bytes
        self._housekeeping = housekeeping
        self._hk_interval = housekeeping_interval_s
        self.metrics = metrics or Metrics()
        self.events = events  # each answered request: a RequestDone (latency histograms, traces)
        self._report = True  # settled at start(), once the subscribers are known: build no record nobody reads
        # Children made once: a labelled counter's lookup would cost more than the increment.
        self._requests = {t: self.metrics.requests.labels(t.name) for t in RequestType}
        self._errors = {c: self.metrics.errors.labels(c.name) for c in ErrorCode}
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._waiting = _FairQueue(workers)  # BLOCKING calls waiting for a worker, served round robin by client
        self._stop = threading.Event()
        self._local = threading.local()
        self._reply_addr = f"inproc://kvdepot-replies-{id(self)}"
        self._worker_prefix = b"\x00" + os.urandom(15)  # routing ids of worker reply sockets
        self._trackers: deque[tuple[zmq.MessageTracker, Callable[[], None], bytes, int]] = deque()
        self._tracker_lock = threading.Lock()
        # Per client (routing id): payload bytes of its tracked replies ZeroMQ has not sent yet. The ROUTER
        # queues without a limit (SNDHWM 0), so a client that never reads would pin L1 for ever.
        self._unsent: dict[bytes, int] = {}
        self._max_unsent = max_unsent_bytes
        # Per client (routing id): BLOCKING requests handed to the pool and not finished, and the bytes of
        # their frames (which they keep in memory until then). The loop takes in whatever ZeroMQ received,
        # so without a limit a client pipelining inline stores faster than the workers copy them grew
        # the server's memory without bound (written by the loop and the workers: under _queued_lock).
        self._queued: dict[bytes, tuple[int, int]] = {}
        self._queued_lock = threading.Lock()
        self._max_queued_requests = max_queued_requests
        self._max_queued_bytes = max_queued_bytes
        self._claims = [IpcClaim(ep.removeprefix("ipc://")) for ep in endpoints if ep.startswith("ipc://")]
        # Clients of BLOCKING requests whose reply never reached the loop (appended by workers; deque ops are atomic).
        self._finished_unanswered: deque[ClientId] = deque()
        # BLOCKING calls whose worker could not make its socket to the loop (no file descriptor left): their
        # replies, for the loop to send itself (appended by workers, taken by the loop).
        self._handed_over: deque[tuple[Call, Any]] = deque()
        self._no_socket_logged = -1e9  # when a worker's failure to make that socket was last logged
        self._no_thread_logged = -1e9  # when a worker thread that could not start was last logged
        # Routing ids whose last request was a goodbye, their disconnect not seen yet (loop thread). A set:
        # a client that unregisters two contexts leaves once; one that speaks again has not left.
        self._goodbyes: set[bytes] = set()
        self._refusals = 0  # failed handshakes whose disconnect has not been seen yet (loop thread)
        self._refusal_logged: dict[str, float] = {}  # reason -> when last logged (a refused client retries every 0.1 s)
        self.add_handlers(handlers)

    # --- life cycle ----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def add_handlers(self, handlers: list[HandlerSpec]) -> None:
        """Serve these request types too (before ``start``); two handlers for one type is an error."""
        if self._thread is not None:
            raise RuntimeError("handlers are added before the server starts")
        for spec in handlers:
            if spec.rtype in self._handlers:
                raise ValueError(f"two handlers for {spec.rtype.name}")
            self._handlers[spec.rtype] = spec

    def bind(self) -> None:
        """Claim and bind every endpoint now, so an owner can learn that one is taken before it builds
        anything expensive. Raises EndpointInUse (an OSError naming the endpoint) for one another
        process holds, OSError for one that cannot be listened on. ``start`` binds if this was not done.
        (The socket is made on this thread and used only by the loop's from ``start`` on: a thread start
        is the memory barrier ZeroMQ asks for when a socket changes threads.)"""
        if self._router is not None:
            return
        self._ctx = zmq.Context(io_threads=self._io_threads)
        try:
            self._router, self._monitor = self._bind()
        except BaseException:
            self._ctx.destroy(linger=0)
            self._ctx = None
            raise

    def start(self) -> None:
        self._report = self.events.wants(RequestDone)
        self.bind()
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvdepot-worker")
        self._thread = threading.Thread(target=self._run, name="kvdepot-rpc", daemon=True)
        self._thread.start()

    def close(self, drain_s: float = 5.0) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout=drain_s + 5)
        if self._thread is None:  # bound but never started: the loop did not close its sockets
            for sock in (self._router, self._monitor):
                if sock is not None:
                    sock.close(linger=0)
        if self._security is not None:
            self._security.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket left (worker PUSH sockets) instead of waiting
        for claim in self._claims:
            claim.release()  # the socket is closed: remove its file, give the path up

    # --- the loop ------------------------------------------------------------------------------------

    def _bind(self) -> tuple[zmq.Socket, zmq.Socket]:
        assert self._ctx is not None
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # Hard limit per frame: anything larger makes ZeroMQ drop the connection (logged through the
        # monitor); frames between max_frame and this limit get a MESSAGE_TOO_LARGE reply.
        router.setsockopt(zmq.MAXMSGSIZE, 4 * max(self._max_frame, codec.MAX_BODY_BYTES) + (1 << 20))
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.SNDHWM, 0)
        enable_ipv6(router, self._endpoints)  # tcp://[::1]:PORT: ZeroMQ refuses an IPv6 address without ZMQ_IPV6
        if self._security is not None:
            self._security.apply_server(self._ctx, router)
        ep = ""
        try:
            for claim in self._claims:
                claim.acquire()  # before binding: a live server's socket is never taken over
            for ep in self._endpoints:
                router.bind(ep)
        except (zmq.ZMQError, OSError) as exc:
            router.close(linger=0)  # an open socket would make Context.term() wait forever
            for claim in self._claims:
                claim.release()
            if isinstance(exc, OSError):
                raise
            if exc.errno == errno.EADDRINUSE:
                raise EndpointInUse(ep, f"{ep} is in use (another process listens there)") from None
            raise OSError(exc.errno, f"cannot listen on {ep}: {exc.strerror}", ep) from None  # filename: which endpoint
        router.bind(self._reply_addr)  # the workers' replies come in here too
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED_EVENTS)
        return router, monitor

    def _run(self) -> None:
        router, monitor = self._router, self._monitor
        assert router is not None and monitor is not None
        next_hk = time.monotonic()
        timeout_ms = -1
        try:
            while not self._stop.is_set():
                # Wake for the next message, or in time for trackers / housekeeping.
                want = 20 if self._trackers else int(self._hk_interval * 1000)
                if want != timeout_ms:
                    router.setsockopt(zmq.RCVTIMEO, want)
                    timeout_ms = want
                try:
                    self._receive(router)
                except zmq.Again:
                    pass
                if self._trackers:
                    self._run_trackers()
                if self._finished_unanswered:
                    self._end_unanswered()
                if self._handed_over:
                    self._send_handed_over(router)
                now = time.monotonic()
                if now >= next_hk:
                    next_hk = now + self._hk_interval
                    self._drain_monitor(monitor)
                    if self._housekeeping is not None:
                        try:
                            self._housekeeping()
                        except Exception:
                            log.exception("housekeeping failed")
        finally:
            self._run_trackers(force=True)
            for _, result in self._handed_over:  # never sent: let go of what kept their payload valid
                if isinstance(result, tuple) and result[1].on_sent is not None:
                    result[1].on_sent()
            router.disable_monitor()
            for s in (router, monitor):
                s.close(linger=0)

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint = event.get("endpoint", b"").decode(errors="replace")
            if event["event"] & _HANDSHAKE_FAILED_EVENTS:
                self._refused(event["event"], endpoint)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if self._refusals:
                    self._refusals -= 1  # the refused connection closing: counted as refused already
                    self.metrics.disconnects.labels("refused").inc()
                elif self._goodbyes:
                    # A client that said goodbye closed its socket: all is well. (ZeroMQ does not say
                    # whose connection closed: any pending goodbye stands for it.)
                    self._goodbyes.pop()
                    self.metrics.disconnects.labels("goodbye").inc()
                    log.debug("a client closed its connection after its goodbye (%s)", endpoint)
                else:
                    self.metrics.disconnects.labels("no_goodbye").inc()
                    log.info(
                        "a connection closed without a goodbye (%s): the client died or reset, or sent a frame "
                        "over the %d-byte hard limit",
                        endpoint,
                        4 * max(self._max_frame, codec.MAX_BODY_BYTES) + (1 << 20),
                    )

    def _refused(self, event: int, endpoint: str) -> None:
        """A connection failed its security handshake: count it by why, and log it at most every 10 s
        per reason (ZeroMQ clients retry every 0.1 s).

        ``auth``: a CurveZMQ key not admitted; ``protocol``: no keys, the wrong server key, or another
        mechanism (ZeroMQ says so: a mismatch or a message that does not decrypt). ``incomplete``: the
        connection ended before the handshake did, which ZeroMQ reports without detail: a client that
        died or restarted while connecting, a TCP health check or a port scan. Common and harmless, so
        it is logged at info, and never blamed on keys."""
        reason = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol"}.get(event, "incomplete")
        self._refusals += 1
        self.metrics.handshake_failures.labels(reason).inc()
        now = time.monotonic()
        if now - self._refusal_logged.get(reason, -1e9) < 10.0:
            return
        self._refusal_logged[reason] = now
        if reason == "incomplete":
            log.info("a connection closed before its security handshake finished (%s): a client that died or restarted "
                     "while connecting, or a TCP probe; not a key problem", endpoint)  # fmt: skip
            return
        why = (
            "its CurveZMQ public key is not admitted (--curve-clients)"
            if reason == "auth"
            else "it has no keys, the wrong server key, or a different security mechanism"
        )
        log.warning("refused a connection in the security handshake (%s): %s", endpoint, why)

    def _receive(self, router: zmq.Socket) -> None:
        """Handle the next message (blocking up to RCVTIMEO), then any already queued."""
        prefix = self._worker_prefix
        for _ in range(256):  # bounded, so trackers and housekeeping are not starved
            # Routing id, header and body are small: copying them is cheaper than zero-copy Frame
            # objects. Payload frames (KV bytes) are received without a copy.
            first = router.recv()
            from_worker = first[:16] == prefix
            small = 4 if from_worker else 3
            frames: list = [first]
            while router.getsockopt(zmq.RCVMORE):
                frames.append(router.recv(copy=len(frames) < small))
            if from_worker:  # [worker, client, header, body, *payload]: a BLOCKING handler's reply
                try:
                    router.send_multipart(frames[1:], copy=False)
                finally:  # sent or not, the request is over: its client must not stay "busy" for ever
                    self.observer.request_finished(ClientId(frames[1]))
            else:
                try:
                    self._dispatch(router, frames)
                except Exception:
                    # Last line of defence: whatever a request does, the loop keeps serving.
                    log.exception("dispatching a request failed")
                    self._errors[ErrorCode.INTERNAL].inc()
                    try:
                        rid = _request_id_of(frames)  # so the caller hears now, not at its own deadline
                        self._send_error(router, frames[0], rid, ErrorCode.INTERNAL, "the server failed to handle this request")
                    except zmq.ZMQError:
                        pass
            if not router.getsockopt(zmq.EVENTS) & _POLLIN:
                return

    def _dispatch(self, router: zmq.Socket, frames: list) -> None:
        ident = frames[0]
        client = ClientId(ident)
        received = time.monotonic()
        if len(frames) < 3:
            self.metrics.dropped_frames.inc()
            self._send_error(router, ident, 0, ErrorCode.BAD_REQUEST, f"a request needs header and body frames, got {len(frames) - 1} frames")
            return
        try:
            header = codec.decode_request_header(frames[1])
            rtype, body = codec.decode_request_body(header, frames[2])
            payload = frames[3:]
            for i, f in enumerate(payload):
                if len(f) > self._max_frame:
                    raise codec.ProtocolViolation(
                        f"payload frame {i} has {len(f)} bytes, over the {self._max_frame}-byte frame limit",
                        ErrorCode.MESSAGE_TOO_LARGE,
                        header.request_id,
                    )
        except codec.ProtocolViolation as exc:
            self._errors[exc.code].inc()
            if self._report:
                self.events.publish(RequestDone("UNDECODED", exc.code.name, time.monotonic() - received, time.time()))
            log.warning("rejected a request from %s: %s", ident.hex()[:12], exc)
            self._send_error(router, ident, exc.request_id, exc.code, exc.message)
            return
        spec = self._handlers.get(rtype)
        if spec is None:
            self._send_error(router, ident, header.request_id, ErrorCode.UNKNOWN_REQUEST_TYPE, f"{rtype.name} is not served here")
            return
        self._requests[rtype].inc()
        if spec.pins_until_sent and self._unsent.get(ident, 0) >= self._max_unsent:
            self._errors[ErrorCode.REPLIES_UNREAD].inc()
            self._send_error(router, ident, header.request_id, ErrorCode.REPLIES_UNREAD,
                             f"{self._unsent.get(ident, 0)} bytes of earlier replies to this client are not read yet "
                             f"(over {self._max_unsent}): this request is refused until it reads them")  # fmt: skip
            return
        if rtype in self._goodbye_types:
            self._goodbyes.add(ident)
        elif self._goodbyes:
            self._goodbyes.discard(ident)  # it speaks again: it did not leave
        deadline = received + header.timeout_ms / 1000 if header.timeout_ms > 0 else float("inf")
        call = Call(client, header.request_id, rtype, body, payload, deadline, received)
        self.observer.request_started(client)
        if spec.mode is HandlerMode.SYNC:
            try:
                self._send(router, ident, call, self._invoke(spec, call))
            finally:  # a send that raised still ends the request (the caller answers it with an error)
                self.observer.request_finished(client)
        else:
            assert self._pool is not None
            nbytes = sum(len(f) for f in frames[1:])
            with self._queued_lock:
                count, queued = self._queued.get(ident, (0, 0))
                refuse = count >= self._max_queued_requests and queued >= self._max_queued_bytes
                if not refuse:
                    self._queued[ident] = (count + 1, queued + nbytes)
            if refuse:
                try:
                    self._send(router, ident, call, self._error_frames(
                        call, ErrorCode.OVERLOADED,
                        f"{count} earlier requests of this client ({queued} bytes) are still waiting for the server's "
                        f"workers (over {self._max_queued_requests} and {self._max_queued_bytes} bytes): this request "
                        f"is refused until they are done"))  # fmt: skip
                finally:
                    self.observer.request_finished(client)
                return
            item = (spec, call, nbytes)
            if not self._waiting.put(ident, item):
                return  # a running worker takes it in its client's turn
            turn = threading.Lock()  # taken once: by the thread that runs this worker, or by its withdrawal

            def work() -> None:
                if turn.acquire(blocking=False):
                    self._work()

            try:
                self._pool.submit(work)
            except RuntimeError as exc:
                # Shutting down, or no thread could be started (no memory for its stack, the process's thread
                # limit): the pool queued the worker before it tried, and an idle thread would run it later.
                if not turn.acquire(blocking=False):
                    return  # an idle thread took it meanwhile: the worker runs
                if not self._waiting.worker_gone(ident, item, stopping=self._stop.is_set()):
                    return  # a running worker takes it in its client's turn
                self._dequeued(ident, nbytes)
                if self._stop.is_set():
                    code, message = ErrorCode.SHUTTING_DOWN, "server is shutting down"
                else:
                    code, message = ErrorCode.INTERNAL, f"the server could not start a worker thread for this request: {exc}"
                    now = time.monotonic()
                    if now - self._no_thread_logged >= 10.0:
                        self._no_thread_logged = now
                        log.warning("could not start a worker thread (out of memory, or at the thread limit?): %s; "
                                    "requests no running worker can take are answered with an error", exc)  # fmt: skip
                self._errors[code].inc()
                self._send_error(router, ident, call.request_id, code, message)
                self.observer.request_finished(client)

    def _dequeued(self, ident: bytes, nbytes: int) -> None:
        """A BLOCKING request of this client is done: it no longer counts against its queue limit."""
        with self._queued_lock:
            count, queued = self._queued.get(ident, (1, nbytes))
            if count > 1:
                self._queued[ident] = (count - 1, queued - nbytes)
            else:
                self._queued.pop(ident, None)

    def _work(self) -> None:
        """A worker: run waiting BLOCKING calls, one client's next call at a time in turn, until none waits.
        A pool fed in arrival order let a client that pipelined many requests (or slow ones) make every
        other client's request wait behind all of them, past its deadline."""
        while not self._stop.is_set():
            item = self._waiting.take()
            if item is None:
                return
            try:
                self._run_blocking(*item)
            except Exception:
                log.exception("running a %s request failed", item[1].rtype.name)
        self._waiting.worker_gone()

    def _invoke(self, spec: HandlerSpec, call: Call) -> list[Any] | tuple[list[Any], Reply]:
        """Run a handler; returns the frames to send (and the Reply when it has payload/on_sent)."""
        if time.monotonic() > call.deadline:
            return self._error_frames(call, ErrorCode.DEADLINE_EXCEEDED, "the request waited past its deadline")
        reply: Reply | None = None
        try:
            reply = spec.fn(call)
            frames = codec.encode_reply(call.request_id, reply.body)  # encoding can fail too
            if self._report:
                self.events.publish(RequestDone(call.rtype.name, "ok", time.monotonic() - call.received, time.time(), call.described))
            return frames, reply
        except KVDepotError as exc:
            return self._error_frames(call, exc.code, exc.message)
        except Exception as exc:
            log.exception("%s handler failed", call.rtype.name)
            if reply is not None and reply.on_sent is not None:
                reply.on_sent()  # its payload will never be sent: let go of what kept it valid
            return self._error_frames(call, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _error_frames(self, call: Call, code: ErrorCode, message: str) -> list[Any]:
        self._errors[code].inc()
        if self._report:
            self.events.publish(RequestDone(call.rtype.name, code.name, time.monotonic() - call.received, time.time()))
        return codec.encode_error(call.request_id, code, message)

    def _send(self, sock: zmq.Socket, ident: bytes, call: Call, result) -> None:
        if isinstance(result, tuple):
            frames, reply = result
            if not reply.payload:
                sock.send_multipart([ident, *frames])  # small frames: plain copies
                if reply.on_sent is not None:
                    reply.on_sent()  # nothing of ours is in flight
                return
            out = [ident, *frames, *reply.payload]
            if reply.on_sent is not None:
                try:
                    # Measured first: a frame that is no buffer raises here, before any part of the
                    # message is queued (a half-sent message would swallow the error reply after it).
                    nbytes = sum(memoryview(f).nbytes for f in reply.payload)
                    tracker = _send_tracked(sock, out)
                except BaseException:
                    reply.on_sent()
                    raise
                with self._tracker_lock:
                    self._trackers.append((tracker, reply.on_sent, ident, nbytes))
                    self._unsent[ident] = self._unsent.get(ident, 0) + nbytes
                return
            sock.send_multipart(out, copy=False)
        else:
            sock.send_multipart([ident, *result])

    def _send_error(self, router: zmq.Socket, ident: bytes, request_id: int, code: ErrorCode, message: str) -> None:
        router.send_multipart([ident, *codec.encode_error(request_id, code, message)])

    def _run_blocking(self, spec: HandlerSpec, call: Call, nbytes: int = 0) -> None:
        try:
            self._run_blocking_call(spec, call)
        finally:
            self._dequeued(call.client, nbytes)

    def _run_blocking_call(self, spec: HandlerSpec, call: Call) -> None:
        result = self._invoke(spec, call)
        try:
            sock = self._reply_socket()
        except zmq.ZMQError as exc:
            # The handler has run (a store is done): its reply must still go, and the request end, or the
            # client times out and stays "busy" for ever (never declared gone). The loop sends it.
            self._no_reply_socket(call, exc)
            self._handed_over.append((call, result))
            return
        try:
            self._send(sock, call.client, call, result)
        except zmq.ZMQError:
            log.warning("could not hand the %s reply to the loop (shutting down?)", call.rtype.name)
            self._finished_unanswered.append(call.client)
        except Exception:
            log.exception("the %s reply could not be sent", call.rtype.name)
            self._answer_failed_send(sock, call)

    def _reply_socket(self) -> zmq.Socket:
        """This worker's socket to the loop, made at its first reply (ZMQError when it cannot be: a
        socket takes a file descriptor, and the process may have none left)."""
        sock = getattr(self._local, "reply", None)
        if sock is None:
            assert self._ctx is not None
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.ROUTING_ID, self._worker_prefix + threading.get_ident().to_bytes(8, "little"))
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(self._reply_addr)
            except BaseException:
                sock.close(linger=0)
                raise
            self._local.reply = sock
        return sock

    def _no_reply_socket(self, call: Call, exc: zmq.ZMQError) -> None:
        """Say (at most every 10 s) that a worker has no socket to the loop, and why."""
        now = time.monotonic()
        if now - self._no_socket_logged < 10.0:
            return
        self._no_socket_logged = now
        hint = ""
        if exc.errno == errno.EMFILE:
            hint = f"; the server is out of file descriptors (ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): raise it"
        log.warning("a worker could not open its socket to the RPC loop (%s)%s; the loop sends the %s reply itself", exc, hint, call.rtype.name)

    def _send_handed_over(self, router: zmq.Socket) -> None:
        """Loop thread: send the replies of workers that had no socket to the loop, and end their requests."""
        while self._handed_over:
            call, result = self._handed_over.popleft()
            try:
                self._send(router, call.client, call, result)
            except Exception:
                log.exception("the %s reply could not be sent", call.rtype.name)
            finally:
                self.observer.request_finished(call.client)

    def _answer_failed_send(self, sock: zmq.Socket, call: Call) -> None:
        """A BLOCKING handler's reply could not be sent: answer with an error instead (the loop ends the
        request as it forwards it), or, when even that fails, have the loop end the request."""
        try:
            sock.send_multipart([call.client, *self._error_frames(call, ErrorCode.INTERNAL, "the server failed to send its reply")])
        except Exception:
            log.warning("could not hand the %s error reply to the loop (shutting down?)", call.rtype.name)
            self._finished_unanswered.append(call.client)

    def _end_unanswered(self) -> None:
        """Loop thread: end the requests whose workers could hand no reply to the loop (the observer is
        the loop's alone), so their clients do not count as busy for ever."""
        while self._finished_unanswered:
            self.observer.request_finished(self._finished_unanswered.popleft())

    def _run_trackers(self, force: bool = False) -> None:
        if not self._trackers:
            return
        with self._tracker_lock:
            pending = list(self._trackers)
            self._trackers.clear()
        keep, sent = [], []
        for entry in pending:
            tracker, callback, _, _ = entry
            if force or tracker.done:
                sent.append(entry)
                try:
                    callback()
                except Exception:
                    log.exception("post-send callback failed")
            else:
                keep.append(entry)
        with self._tracker_lock:
            if keep:
                self._trackers.extendleft(reversed(keep))
            for _, _, ident, nbytes in sent:
                left = self._unsent.get(ident, 0) - nbytes
                if left > 0:
                    self._unsent[ident] = left
                else:
                    self._unsent.pop(ident, None)


class _FairQueue:
    """BLOCKING calls waiting for a worker: one FIFO per client (routing id), and the clients with calls
    waiting take turns, so each client's calls start in its order and a client with many waiting delays
    another's by at most one call per worker. ``put`` says when a new worker is to be started (fewer than
    ``workers`` are running); a running worker ``take``s until nothing waits."""

    def __init__(self, workers: int) -> None:
        self._lock = threading.Lock()
        self._queues: dict[bytes, deque] = {}
        self._turns: deque[bytes] = deque()  # clients with calls waiting, the next to be served first
        self._workers = workers
        self._free = workers  # workers that may still be started

    def put(self, client: bytes, item: Any) -> bool:
        with self._lock:
            queue = self._queues.get(client)
            if queue is None:
                queue = self._queues[client] = deque()
                self._turns.append(client)
            queue.append(item)
            if self._free:
                self._free -= 1
                return True
            return False

    def take(self) -> Any:
        """The next client's oldest waiting call; None (and this worker ends) when none waits."""
        with self._lock:
            if not self._turns:
                self._free += 1
                return None
            client = self._turns.popleft()
            queue = self._queues[client]
            item = queue.popleft()
            if queue:
                self._turns.append(client)
            else:
                del self._queues[client]
            return item

    def worker_gone(self, client: bytes | None = None, item: Any = None, stopping: bool = False) -> bool:
        """A worker that was counted as started did not run, or stopped without ``take`` seeing no calls.
        With the call that asked for it: take that call back (it is to be answered now) unless a running
        worker takes it in turn (never when ``stopping``: workers then stop); whether it was taken back."""
        with self._lock:
            self._free += 1
            if client is None or (self._free < self._workers and not stopping):
                return False  # another worker runs: it takes every call waiting before it stops
            return self._withdraw(client, item)

    def _withdraw(self, client: bytes, item: Any) -> bool:
        """Under ``_lock``: take back a call no worker has taken yet; whether it was still waiting."""
        queue = self._queues.get(client)
        at = next((i for i, waiting in enumerate(queue or ()) if waiting is item), None)
        if queue is None or at is None:
            return False
        del queue[at]
        if not queue:
            del self._queues[client]
            self._turns.remove(client)
        return True


def _send_tracked(sock: zmq.Socket, frames: list) -> zmq.MessageTracker:
    """Send ``frames`` as one message without copies; the tracker is done once ZeroMQ has let go of every
    frame. (``send_multipart`` returns the last frame's tracker only, and pyzmq copies a frame under its
    copy threshold and reports it sent at once: a chunk's short last frame said "sent" while the frames
    before it, views of the arena, were still queued, and their read locks ended under them.)"""
    last = len(frames) - 1
    return zmq.MessageTracker(*[sock.send(f, zmq.SNDMORE if i < last else 0, copy=False, track=True) for i, f in enumerate(frames)])


def _request_id_of(frames: list) -> int:
    """The request id in a message's header frame, or 0 where there is none to read."""
    try:
        return codec.decode_request_header(frames[1]).request_id
    except Exception:
        return 0
