"""Capability modules. Each owns one family of requests and returns its HandlerSpecs.

A module is built from the ``ServerContext`` (``ModuleFactory``); the composition root takes the list of
factories it serves (``DEFAULT_MODULES`` in ``server/main.py``), so a capability (the peer tier's
requests, GPU transfers) plugs in as one more factory.
"""

from __future__ import annotations

import array
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvdepot.config import ServerConfig
from kvdepot.errors import BadRequest, KVDepotError, LeaseRevoked, UnknownContext
from kvdepot.events import NO_EVENTS, ChunkRequestDone, ChunkTokens, EventSink
from kvdepot.observability.metrics import Metrics
from kvdepot.protocol.messages import BlockTransferOffer
from kvdepot.rpc.dispatch import Call, HandlerSpec
from kvdepot.server.liveness import LivenessTracker
from kvdepot.server.sessions import SessionTable
from kvdepot.server.state import Context, ContextRegistry
from kvdepot.storage.manager import StorageManager
from kvdepot.types import ClientId, LeaseId, ObjectKey

log = logging.getLogger(__name__)
SPACE_BYTES = 8  # of a namespace digest, in ChunkRequestDone: enough to tell a server's namespaces apart


@dataclass
class ServerContext:
    """Everything a module may use; built once by the composition root."""

    config: ServerConfig
    storage: StorageManager
    liveness: LivenessTracker
    contexts: ContextRegistry = field(default_factory=ContextRegistry)
    sessions: SessionTable = field(default_factory=SessionTable)
    metrics: Metrics = field(default_factory=Metrics)
    events: EventSink = NO_EVENTS  # the event bus: what modules publish (ChunkRequestDone)
    # Told of contexts that went (unregistered, or their client gone), after their leases were ended: a
    # module that keeps state per context (the server-driven path's registered caches) drops it.
    contexts_gone: list[Callable[[list[Context]], None]] = field(default_factory=list)
    # What REGISTER_CONTEXT offers of the server-driven path (set by its module; None: none here).
    block_offer: BlockTransferOffer | None = None

    def forget_contexts(self, contexts: list[Context]) -> None:
        for listener in self.contexts_gone:
            listener(contexts)

    def context_of(self, context_id: int, client: ClientId) -> Context:
        """The caller's context. A client that was revoked (declared gone while it was only silent)
        learns so on its first request after it: LEASE_REVOKED saying why and when, not a bare
        UNKNOWN_CONTEXT."""
        try:
            return self.contexts.get(context_id, client)
        except UnknownContext:
            notice = self.liveness.take_notice(client)
            if notice is not None:
                raise LeaseRevoked(notice.message()) from None
            raise

    @property
    def digest_size(self) -> int:
        return self.config.storage.hash_algorithm.digest_size

    def chunk_tokens(self, context: Context, keys: list[ObjectKey], token_ids: list[int]) -> None:
        """A store that carries its chunks' token ids (the client opted in): checked, then handed to KV
        events before the chunks are committed. Tokens that do not cover exactly these chunks, or are not
        uint32, refuse the request: nothing is stored."""
        if not token_ids:
            return
        if len(token_ids) != len(keys) * context.chunk_size:
            raise BadRequest(f"token_ids has {len(token_ids)} tokens for {len(keys)} chunks of {context.chunk_size}")
        try:
            packed = array.array("I", token_ids).tobytes()
        except OverflowError:
            raise BadRequest("token_ids must be uint32") from None
        if self.events.wants(ChunkTokens):
            self.events.publish(ChunkTokens(tuple(keys), packed, context.chunk_size))

    def chunk_request_done(
        self, op: str, call: Call, context: Context, hashes: list[bytes], found: int,
        prefetch_started: float | None = None, prefetched: int = 0,
    ) -> None:  # fmt: skip
        """Tell the bus a LOOKUP/STORE/RETRIEVE was answered (the trace recorder, the alarm and tracing
        read it); nothing is built when nobody subscribes. ``prefetch_started``: the monotonic time a
        LOOKUP's prefetch from L2 began (it then ends now, having brought ``prefetched`` chunks)."""
        if not self.events.wants(ChunkRequestDone):
            return
        call.described = True
        now = time.monotonic()
        self.events.publish(
            ChunkRequestDone(
                op, time.time() - (now - call.received), now - call.received, context.spec.model, call.body.cache_salt,
                tuple(hashes), context.chunk_size, context.chunk_bytes, found, "ok", call.rtype.name,
                now - prefetch_started if prefetch_started is not None else 0.0, prefetched,
                context.namespace(call.body.cache_salt)[:SPACE_BYTES],
            )
        )

    def chunk_request_pending(self, call: Call) -> None:
        """This call's ChunkRequestDone comes later (a LOOKUP prefetching from L2): its RequestDone,
        published first, says so."""
        call.described = self.events.wants(ChunkRequestDone)

    def forget_if_idle(self, client: ClientId) -> None:
        """A clean goodbye: a client with no context and no lease left is no longer watched (loop
        thread: called from SYNC handlers only)."""
        if not self.contexts.owned_by(client) and not self.storage.leases_of(client):
            self.liveness.forget(client)

    def release_quietly(self, lease: LeaseId, owner: ClientId) -> None:
        """Release a lease that may have ended already (TTL, revocation): freeing is idempotent."""
        if not lease:
            return
        try:
            self.storage.release(lease, owner)
        except KVDepotError:
            pass  # already expired or released

    def abort_quietly(self, lease: LeaseId, owner: ClientId) -> None:
        """Abort a reservation that may hold nothing (NO_LEASE) or have ended already."""
        if not lease:
            return
        try:
            self.storage.abort(lease, owner)
        except KVDepotError:
            pass  # already expired or aborted

    def expire_sessions(self) -> int:
        """End the lookup sessions nobody will end (``SessionTable.expire``), releasing what they still
        hold; idle means one lease TTL. Returns how many ended."""
        gone = self.sessions.expire(self.config.storage.lease_ttl_s, self.storage.prefetch_bound_s, self.storage.lease_active)
        for context_id, lease in gone:
            owner = self.contexts.owner_of(context_id)
            if owner is not None:
                self.release_quietly(lease, owner)
        if gone:
            self.metrics.request_failures.labels("sessions_expired").inc(len(gone))
        return len(gone)

    def client_gone(self, client: ClientId, why: str, exited: bool) -> None:
        """The client's process exited or it went silent (``liveness.ClientWatch``, on the loop thread):
        drop its contexts and sessions and end its leases. What it may still touch (it went silent, but
        its process runs) is quarantined by the object table until the process is gone."""
        contexts = self.contexts.remove_owner(client)
        for c in contexts:
            self.sessions.end_context(c.id)  # their locks are the client's: released just below
        released = self.storage.release_owner(client, why, revoked=not exited)
        self.forget_contexts(contexts)
        how = "exited" if exited else "revoked"
        self.metrics.clients_gone.labels(how).inc()
        self.metrics.leases_ended_by_client_gone.labels(how).inc(released)
        if exited:
            self.storage.recheck_quarantine()  # what it held in quarantine is safe to reuse now
        held = [q for q in self.storage.quarantine() if q.owner == client]
        rec = self.liveness.record(client)
        pid = rec.info.pid if rec is not None else 0
        if held:
            log.warning(
                "client %s (pid %d) %s: revoked; %d leases ended, %d quarantined (%d bytes) until its process exits",
                client.hex()[:12], pid, why, released, held[0].leases, held[0].bytes,
            )
        else:
            log.info("client %s (pid %d) gone (%s): %d leases released, %d contexts dropped", client.hex()[:12], pid, why, released, len(contexts))


class ServerModule(Protocol):
    def handlers(self) -> list[HandlerSpec]: ...


@runtime_checkable
class ClosingModule(ServerModule, Protocol):
    """A module with threads or device resources of its own: closed by the composition root after the RPC
    server stopped and before storage closes (it may hold views of the arena)."""

    def close(self) -> None: ...


ModuleFactory = Callable[[ServerContext], ServerModule]
