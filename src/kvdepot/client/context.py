"""``ContextLink``: one registered context on one server, and the requests made on it.

It owns the channel, the current registration and the transfer path that registration allows, and the
lease renewer. It is the host a transfer path talks to (``transfer.PathHost``): requests on the context
(registering again, once, when the server forgot it after a restart or a revocation), requests as they
are (a commit, whose lease a new context would not know), pipelines, how many leading chunks are stored,
and renewal of the leases of open blocks. ``KVClient`` is the facade over it.

Life cycle::

    ┌─open failed─┐
    ▼             │
    BUILT ──open──┴──► OPEN ──close──► CLOSED
      │                                  ▲
      └───────────────close──────────────┘

``ContextLink(...)`` does no I/O. ``open`` connects, registers and starts the heartbeat; one that fails
(no server yet, a refused handshake) lets go of its socket and path and leaves a fresh channel, so a
later ``open`` tries again from scratch. ``open`` on an open link does nothing, on a closed one it is
refused. ``close`` says goodbye (UNREGISTER) and closes the path and the channel.

Registering again (the server forgot the context)::

    LIVE ──UNKNOWN_CONTEXT──► REGISTERING ──registered──► LIVE (a new context, perhaps a new path)
                                   │
                                   └─failed──► FORGOTTEN ──next request on the context──► REGISTERING

A registration that failed leaves the old one FORGOTTEN, never LIVE again: a restarted server numbers
its contexts from 1, so the old id may well be a context the failed try registered there (its reply
lost to a timeout), which the server would accept while the client still used the old arena. So the
next request registers first, whoever makes it, instead of waiting for an UNKNOWN_CONTEXT.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress

from kvdepot.client.options import ClientOptions
from kvdepot.client.registration import ContextIdentity, Registration, choose_path
from kvdepot.client.renewal import LeaseRenewer
from kvdepot.client.transfer import PathChanged, TransferPath
from kvdepot.errors import (
    ErrorCode, KVDepotError, KVDepotTimeout, LeaseExpired, LeaseRevoked, PrefetchTooSlow, ServerUnreachable, UnknownContext,
    UnknownLease,
)  # fmt: skip
from kvdepot.layout import KVLayout
from kvdepot.protocol import messages as m
from kvdepot.rpc.channel import OnBehind, RpcChannel
from kvdepot.rpc.endpoints import ipc_access_problem
from kvdepot.types import ChunkHash

log = logging.getLogger(__name__)

# Requests whose reply grants this client something only it can end (a lease, a pin): one nobody
# receives is given back (``ContextLink._give_back``).
_GRANTING = (m.PrepareStoreRequest, m.PrepareRetrieveRequest, m.PinPrefixRequest)

STATUS_POLL_MAX_S = 0.005  # the longest pause between two asks for an L2 prefetch's result
RELEASE_BEHIND_TRIES = 3  # sends of a read's release whose reply nobody waits for, while the server answers with a failure


class ContextLink:
    def __init__(self, url: str, identity: ContextIdentity, options: ClientOptions) -> None:
        self.url = url
        self.identity = identity
        self.options = options
        self.channel = RpcChannel(url, security=options.curve)
        self.renewer = LeaseRenewer(self)
        self.path: TransferPath | None = None
        self.transport_reason = ""  # why the path is what it is (what ``auto`` found)
        self._reg: Registration | None = None
        self._forgotten: Registration | None = None  # the registration a failed re-registration left (FORGOTTEN)
        self._reg_lock = threading.RLock()  # opening, (re-)registration
        self._closed = False
        self._local = threading.local()  # this thread's deadline (``deadline``)

    def __repr__(self) -> str:
        return f"ContextLink({self.url!r}, {self._reg!r}, {self.path!r})"

    @property
    def layout(self) -> KVLayout:
        return self.identity.layout

    @property
    def registration(self) -> Registration:
        if self._reg is None:
            raise KVDepotError("client is not connected")
        return self._reg

    # --- life cycle ----------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect, register (choosing the path) and start the heartbeat. Nothing to do when open
        already; refused once closed. A failure leaves the link as built, for another ``open``."""
        with self._reg_lock:
            if self._closed:
                raise KVDepotError("client is closed", ErrorCode.CONNECTION)
            if self._reg is not None:
                return
            self._open()
            if self.options.heartbeat:
                self.renewer.start()

    def _open(self) -> None:
        self.channel.open()
        try:
            self._reg = self._register(timeout_s=self.options.connect_timeout_s)
        except KVDepotTimeout:
            self._start_over()
            refused = ipc_access_problem(self.url)  # a socket this user may not open is not "a server that is down"
            if refused:
                raise ServerUnreachable(f"cannot connect to {self.url}: {refused}") from None
            raise ServerUnreachable(
                f"no kvdepot server answered at {self.url} within connect_timeout_s={self.options.connect_timeout_s:g} s "
                f"(is it running, and is this its address?)"
            ) from None
        except BaseException:
            self._start_over()
            raise

    def _start_over(self) -> None:
        """After a failed ``open``: close the socket (a closed channel refuses every request for good) and
        the path, and leave a new channel, as ``__init__`` did, for the next ``open``. What the owner set
        on the channel (``answered``) carries over."""
        answered = self.channel.answered
        self._close_transport()
        self.path, self.transport_reason = None, ""
        self.channel = RpcChannel(self.url, security=self.options.curve)
        self.channel.answered = answered

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.renewer.stop()
        # A registration another thread is making is waited for (within timeout_s), so the goodbye names
        # the context the server has; and no thread registers again from here on (``_reregister``): a
        # request the goodbye overtook is answered UNKNOWN_CONTEXT, and registering then would leave the
        # closed client a live context on the server that nothing ever ends.
        got = self._reg_lock.acquire(timeout=self.options.timeout_s)
        try:
            if self._reg is not None:
                self._goodbye(self._reg, min(1.0, self.options.timeout_s))
            self._close_transport()
        finally:
            if got:
                self._reg_lock.release()

    def _goodbye(self, reg: Registration, timeout_s: float) -> None:
        """UNREGISTER ``reg``'s context, if the server answers within ``timeout_s`` (best effort: a
        context the server keeps ends with the client anyway)."""
        with suppress(KVDepotError):
            self.channel.call(m.UnregisterContextRequest(context_id=reg.context_id), timeout_s=timeout_s, closing=True)

    def _close_transport(self) -> None:
        self.channel.close()
        if self.path is not None:
            self.path.close()

    # --- deadlines -----------------------------------------------------------------------------------

    @contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Every request this thread makes inside the block ends within ``seconds`` from now, in all
        (a KVDepotTimeout otherwise), waiting for the channel or for another thread's registration
        included, and none waits longer than ``timeout_s``. Nested blocks keep the earlier deadline.
        Other threads are not affected."""
        outer = getattr(self._local, "deadline", None)
        mine = time.monotonic() + seconds
        self._local.deadline = mine if outer is None else min(outer, mine)
        try:
            yield
        finally:
            self._local.deadline = outer

    def _timeout(self) -> float:
        """How long the next request of this thread may take."""
        left = self._left()
        return self.options.timeout_s if left is None else min(self.options.timeout_s, left)

    def _left(self) -> float | None:
        """What is left of this thread's deadline (None: it has none); KVDepotTimeout once it passed."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVDepotTimeout("the caller's deadline passed before the request was sent")
        return left

    # --- requests (what the transfer paths use: transfer.PathHost) -----------------------------------

    def request(self, body, payload: Sequence = (), *, path: TransferPath | None = None, want_payload: bool = False,
                timeout_s: float | None = None):  # fmt: skip
        """A request on our context; registers again once if the server forgot it (restart, revocation).
        ``path``: the transfer path asking; if registering again replaced it (a restarted server, a new
        arena), PathChanged is raised instead of redoing the request (its answer would be the new
        path's to read). ``timeout_s``: this request's own patience instead of ``timeout_s`` (a one-off
        that takes long, such as registering a GPU cache)."""
        reg = self._live()
        if path is not None and self.path is not path:
            # Another thread registered again since the caller chose its path (re-registering sets the
            # path before the registration): the answer would be the new path's offsets.
            raise PathChanged()
        body.context_id = reg.context_id
        try:
            reply = self.channel.call(body, payload, timeout_s=timeout_s or self._timeout(), want_payload=want_payload,
                                      on_late=self._give_back_late(body))  # fmt: skip
        except UnknownContext:
            reg = self._reregister(reg)
            body.context_id = reg.context_id
            if path is not None and self.path is not path:
                raise PathChanged() from None
            reply = self.channel.call(body, payload, timeout_s=timeout_s or self._timeout(), want_payload=want_payload,
                                      on_late=self._give_back_late(body))  # fmt: skip
        if path is not None and (self._reg is not reg or self._forgotten is reg or self.path is not path):
            # Another thread began registering again while this request was out (the check above came
            # before it): the server that answered may be a restarted one, which gave this client its
            # old context id again, so the reply's offsets may be a new arena's, which ``path`` cannot
            # read (it would read or write the old arena's bytes at them). Its lease is given back, the
            # registration waited for, and the request redone on the path it chose.
            if isinstance(body, _GRANTING):
                self._give_back(body, body.context_id, reply[0] if want_payload else reply)
            self._live()
            raise PathChanged()
        return reply

    def _give_back_late(self, body) -> OnBehind | None:
        """For a request whose reply hands this client a lease (a shm PREPARE) or a pin: what to do with that reply
        when it comes after the caller gave up (``RpcChannel.call``'s ``on_late``). Nobody holds that
        lease, so it is ended at once, sent behind; left alone, it would end only at its TTL, and then
        be quarantined for as long as this process runs (the server cannot know its offsets never
        reached anyone): its slots never reused, its read pins never dropped."""
        if not isinstance(body, _GRANTING):
            return None
        context_id = body.context_id

        def on_late(result, error: KVDepotError | None) -> None:
            if error is None:
                self._give_back(body, context_id, result)

        return on_late

    def _give_back(self, body, context_id: int, result) -> None:
        """End what ``result``, the reply to ``body``, granted and nobody holds: a read's lease is released
        (as any read's, retried), a store's aborted, a pin unpinned (sent behind, never waited for)."""
        if isinstance(body, m.PrepareRetrieveRequest):
            if result.lease_id:
                self.release_behind(m.CommitRetrieveRequest(context_id=context_id, lease_id=result.lease_id))
            return
        if isinstance(body, m.PrepareStoreRequest):
            end = m.CommitStoreRequest(context_id=context_id, lease_id=result.lease_id, abort=True) if result.lease_id else None
        else:  # a pin outlives its client and only its (random) id ends it
            end = m.UnpinRequest(pin_id=result.pin_id) if result.pin_id else None
        if end is not None:
            with suppress(KVDepotError):
                self.channel.send_behind(end, lambda _r, _e: None, timeout_s=self.options.timeout_s)

    def finish(self, body):
        """A request as is, never re-registering: a commit, whose lease a new context would not know. It
        is not cut short by the caller's ``deadline``: a block's end must reach the server (its lease
        would otherwise wait for the TTL). A context the server no longer knows took the lease with it:
        said as such (LEASE_EXPIRED), not as a bare UNKNOWN_CONTEXT (the server tells the first request
        after a revocation why, and that may have been another thread's)."""
        try:
            return self.channel.call(body, timeout_s=self.options.timeout_s)
        except KVDepotTimeout:
            if isinstance(body, m.CommitStoreRequest) and body.lease_id:
                # The commit may never have been sent (other threads kept the channel past timeout_s)
                # or not been answered: an abort follows behind (never waiting for the channel), so
                # the write lease does not wait for its TTL, and then stay quarantined for as long as
                # this process runs. A commit the server handled first makes the abort a no-op.
                abort = m.CommitStoreRequest(context_id=body.context_id, lease_id=body.lease_id, abort=True)
                with suppress(KVDepotError):
                    self.channel.send_behind(abort, lambda _r, _e: None, timeout_s=self.options.timeout_s)
            raise
        except UnknownContext as exc:
            raise LeaseExpired(f"the server no longer knows this client's context (unregistered, declared gone after a silence, "
                               f"or the server restarted), so the lease did not stay: {exc.message}") from None  # fmt: skip

    def release_behind(self, body: m.CommitRetrieveRequest, tries: int = RELEASE_BEHIND_TRIES) -> None:
        """A shared-memory read's release, sent without waiting for its reply (``RpcChannel.send_behind``):
        its outcome changes nothing for the caller, as the server keeps the pins of a reader whose
        process runs even past the lease's TTL or a revocation (storage/l1.py), so what it read was sound
        whatever the reply says. A reply that says the lease is over already needs nothing (a revocation
        is logged: the operator wants to know); any other error (the server busy past the deadline,
        failing) leaves the lease held, so the release is sent again, ``tries`` times in all. One that
        cannot be sent is logged: its lease then ends at its TTL, as a failed ``finish``'s."""

        what = f"the release of lease {body.lease_id}"

        def on_reply(_result, error: KVDepotError | None) -> None:
            if error is None or isinstance(error, (UnknownLease, UnknownContext)):
                return
            if isinstance(error, LeaseRevoked):  # declared gone meanwhile: its pins were kept, its read sound
                log.warning("kvdepot: %s: %s", what, error.message)
                return
            if isinstance(error, LeaseExpired):
                # Only if the server stopped watching a reader that still ran: a broken invariant.
                log.error("kvdepot: %s: %s; the server let go of the pins while this process read", what, error.message)
                return
            if tries > 1:
                self.release_behind(body, tries - 1)
            else:
                log.warning("kvdepot: %s failed %d times, the last: %s; the lease ends at its TTL", what, RELEASE_BEHIND_TRIES, error)

        try:
            self.channel.send_behind(body, on_reply, timeout_s=self.options.timeout_s)
        except KVDepotError as exc:
            log.warning("kvdepot: could not send %s: %s; the lease ends at its TTL", what, exc)

    def pipeline(self, requests: list[tuple[object, Sequence]], on_reply=None, borrowed: bool = False) -> list:
        """Pipelined requests on our context, registering again once if the server forgot it. The
        client's ``timeout_s`` bounds the wait for each reply, not the whole transfer (a large inline
        load that keeps moving is never cut short); a caller's ``deadline`` bounds it all.
        ``borrowed``: the payload is the caller's own memory (see ``RpcChannel.pipeline``)."""
        reg = self._live()
        for body, _ in requests:
            body.context_id = reg.context_id  # the path built them before a registration this may have made
        until = getattr(self._local, "deadline", None)  # the caller's: each reply restarts timeout_s, not this
        try:
            return self.channel.pipeline(requests, on_reply, timeout_s=self._timeout(), borrowed=borrowed, until=until)
        except UnknownContext:
            new = self._reregister(reg)
            for body, _ in requests:
                body.context_id = new.context_id
            return self.channel.pipeline(requests, on_reply, timeout_s=self._timeout(), borrowed=borrowed, until=until)

    def call_aside(self, body, timeout_s: float):
        """A request that is not the context's, and that the server may take long over (a clear of slow
        tiers), on a channel of its own: the client's channel stays free meanwhile. The heartbeat needs
        it to renew the leases of blocks other threads have open, and the server's lease TTL (60 s by
        default) is no longer than such a wait may be (``KVClient.clear`` waits up to 60 s). Only while
        the link is open, as any request."""
        if self._closed:
            raise KVDepotError("client is closed", ErrorCode.CONNECTION)
        self.registration  # noqa: B018 (not connected: the same error as a request's)
        channel = RpcChannel(self.url, security=self.options.curve).open()
        try:
            return channel.call(body, timeout_s=timeout_s)
        finally:
            channel.close()

    def lookup(
        self, hashes: list[ChunkHash], salt: str, session_id: str = "", lock: bool = True, prefetch: bool = True, probe: bool = False
    ) -> int | None:
        """LOOKUP: leading chunks in L1 (locked for ``session_id`` when given); None while the server
        prefetches from L2 for that session. ``probe``: a check on the way to a store or a retrieve,
        which the server does not count as an engine's lookup."""
        return self.lookup_reply(hashes, salt, session_id, lock, prefetch, probe).hits

    def lookup_reply(
        self, hashes: list[ChunkHash], salt: str, session_id: str = "", lock: bool = True, prefetch: bool = True, probe: bool = False,
        source_hint: str = "", prefill_tokens_per_s: float = 0.0, agent_session: str = "",
    ) -> m.LookupReply:
        """``lookup`` with the whole reply (``in_l1``: how many of the hits were in L1 at the lookup).
        ``source_hint`` and ``prefill_tokens_per_s`` reach the tiers' lookups (see ``LookupRequest``);
        ``agent_session`` makes it a turn of that conversation (its prefix is kept between turns)."""
        if not hashes:
            return m.LookupReply(hits=0)
        req = m.LookupRequest(
            context_id=0, keys=list(hashes), cache_salt=salt, session_id=session_id, lock=lock, prefetch=prefetch, probe=probe,
            source_hint=source_hint, prefill_tokens_per_s=prefill_tokens_per_s, agent_session=agent_session,
        )
        return self.request(req)

    def stored_chunks(self, hashes: list[ChunkHash], salt: str, probe: bool = False) -> int:
        """Leading chunks stored, waiting for the server to bring missing ones in from L2 first.
        ``probe``: on the way to a retrieve (not counted as a lookup; see ``lookup``)."""
        if not hashes:
            return 0
        if not self.registration.l2_tiers:
            return self.lookup(hashes, salt, probe=probe) or 0
        session = f"_kvdepot-{os.urandom(8).hex()}"
        hits = self.lookup(hashes, salt, session, lock=False, probe=probe)
        window = self._timeout()
        deadline = time.monotonic() + window
        delay = 0.0002

        def too_slow() -> PrefetchTooSlow:
            with suppress(KVDepotError):  # past the caller's deadline too: not cut short (see finish)
                self.finish(m.EndSessionRequest(context_id=self.registration.context_id, session_id=session))
            return PrefetchTooSlow(f"the prefetch from L2 did not finish within {window:.3g} s")

        while hits is None:
            if time.monotonic() + delay >= deadline:
                raise too_slow()
            time.sleep(delay)
            delay = min(delay * 2, STATUS_POLL_MAX_S)
            poll = m.QueryPrefetchStatusRequest(context_id=0, session_id=session)
            try:
                # Its wait ends at the lookup's deadline at the latest: a poll that times out is that
                # deadline arriving (ZeroMQ's millisecond timer may say so a hair before it), so a slow
                # prefetch, this request's miss; said as a timeout, it read as an unreachable server (a
                # connector then stops asking it at all). The lookup just before it was answered.
                hits = self.request(poll, timeout_s=max(1e-3, deadline - time.monotonic())).hits
            except KVDepotTimeout:
                raise too_slow() from None
        return hits

    def renew(self, sessions: Iterable[str] = (), lease_ids: Iterable[int] = (), reregister: bool = True) -> int:
        """Push the TTL of these sessions' locks and of these leases (this client's own) to now + TTL;
        returns how many leases were renewed (ended ones are skipped, not an error). ``reregister=False``
        (the heartbeat): a server that forgot the context is not registered with again here. Those
        leases went with it, and the heartbeat holds the channel: registering would wait for a worker
        thread that is itself registering and waits for the channel (both until a timeout)."""
        req = m.RenewLeasesRequest(context_id=0, lease_ids=list(lease_ids), sessions=list(sessions))
        if not req.lease_ids and not req.sessions:
            return 0
        if reregister:
            return self.request(req).renewed
        reg = self.registration
        if reg is self._forgotten:
            return 0  # those leases went with the server that forgot it; the next request registers
        req.context_id = reg.context_id
        return self.channel.call(req, timeout_s=self._timeout()).renewed

    def holding(self, lease_id: int):
        """While the block runs, the heartbeat renews ``lease_id``."""
        return self.renewer.holding(lease_id)

    # --- registration --------------------------------------------------------------------------------

    def _live(self) -> Registration:
        """The registration to send under: a FORGOTTEN one (see the module's drawing) is registered again
        first, as the server may know its id as another context."""
        reg = self.registration
        if reg is self._forgotten:
            reg = self._reregister(reg)
        return reg

    def _reregister(self, failed: Registration) -> Registration:
        """Register again, unless another thread already did since ``failed`` stopped working. All of it
        is within the caller's deadline, if any: waiting for another thread's registration too (the
        server answers it, but that thread's patience may be the client's ``timeout_s``). A failure
        leaves ``failed`` FORGOTTEN: the next request tries again."""
        left = self._left()
        if not self._reg_lock.acquire(timeout=-1 if left is None else left):
            raise KVDepotTimeout(f"another thread was registering again for longer than the caller's deadline ({left:.3g} s left)")
        try:
            if self._closed:
                raise KVDepotError("client is closed", ErrorCode.CONNECTION)
            if self._reg is failed:
                log.warning("kvdepot: the server forgot context %d; registering again", failed.context_id)
                self._forgotten = failed
                self._reg = self._register(timeout_s=self._timeout())  # within the caller's deadline, if any
                self._forgotten = None
            return self._reg
        finally:
            self._reg_lock.release()

    def _register(self, timeout_s: float | None = None) -> Registration:
        reply: m.RegisterContextReply = self.channel.call(
            self.identity.request(self.options.chunk_size, self.options.hash_algorithm, self.options.hash_scheme), timeout_s=timeout_s or self.options.timeout_s
        )
        reg = Registration.of(reply)
        try:
            self.path, self.transport_reason = choose_path(self.path, reg, self.options, self)
        except BaseException:
            # The server has a context this client cannot use (no path for it): let it go now rather
            # than at the client's end. choose_path may have closed the old path: FORGOTTEN keeps
            # anyone from sending under the old registration, and the next try chooses again.
            with suppress(KVDepotTimeout):  # past the caller's deadline: not even that
                self._goodbye(reg, min(1.0, self._timeout()))
            raise
        log.info("kvdepot: context %d on %s, transport %s", reg.context_id, self.url, self.path.name.value)
        return reg
