"""LOOKUP and its companions: how much of a prompt's prefix is stored, optionally locked for a session.

A lookup answers from L1 at once. With a session and L2 tiers, chunks missing from L1 are fetched in
the background; the reply then says ``hits=None`` and QUERY_PREFETCH_STATUS gives the final count.
Sessions follow the state machine in ``server/sessions.py``.
"""

from __future__ import annotations

import time

from kvdepot.errors import BadRequest, ErrorCode, IllegalTransition, KVDepotError, LeaseExpired, UnknownLease
from kvdepot.limits import MAX_KEYS
from kvdepot.observability.metrics import L1
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import context_and_keys, touch_agent_session
from kvdepot.server.sessions import Key, Session
from kvdepot.server.state import Context
from kvdepot.storage.manager import LookupHints, Prefetched, Toucher
from kvdepot.types import NO_LEASE, ClientId, LeaseId, ObjectKey


class LookupModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.storage = ctx.storage

    def handlers(self) -> list[HandlerSpec]:
        R, S = m.RequestType, HandlerMode.SYNC
        # Lookups touch only in-memory tables (microseconds): they run on the loop thread, which saves
        # the thread-pool hop on the latency-critical path.
        return [
            HandlerSpec(R.LOOKUP, self.lookup, S),
            HandlerSpec(R.QUERY_PREFETCH_STATUS, self.query_prefetch_status, S),
            HandlerSpec(R.FREE_LOOKUP_LOCKS, self.free_lookup_locks, S),
            HandlerSpec(R.RENEW_LEASES, self.renew_leases, S),
        ]

    def lookup(self, call: Call) -> Reply:
        body: m.LookupRequest = call.body
        context, keys = context_and_keys(self.ctx, call)
        touch_agent_session(self.ctx, call, keys)
        counted = not body.probe and bool(keys)  # an engine's lookup: its hits and misses are counted
        if counted:
            self.ctx.metrics.lookup_asked(context.spec.model, len(keys) * context.chunk_size)
        if not body.session_id:
            hits = self.storage.lookup(keys)
            if counted:
                self._answered(context, len(keys), {L1: hits})
                self.ctx.chunk_request_done("lookup", call, context, body.keys, hits)
            return Reply(m.LookupReply(hits=hits, in_l1=hits))
        if body.lock:
            # NOBODY: a lookup lock tells the client no offsets; a retrieve hands them out later.
            lock = self.storage.lock_prefix(keys, call.client, session=body.session_id, toucher=Toucher.NOBODY)
            hits, lease = len(lock.offsets), lock.lease_id
        else:
            hits, lease = self.storage.lookup(keys), NO_LEASE
        prefetch = body.prefetch and self.storage.tier_count > 0 and hits < len(keys)
        if counted and not prefetch:
            self._answered(context, len(keys), {L1: hits})
            self.ctx.chunk_request_done("lookup", call, context, body.keys, hits)
        if not prefetch and not body.lock:
            return Reply(m.LookupReply(hits=hits, in_l1=hits))  # nothing to track: no session is kept
        key: Key = (context.id, body.session_id)
        session, old = self.ctx.sessions.open(key, lease, keys[:hits], hits, body.lock, keys if prefetch else None)
        self.ctx.release_quietly(old, call.client)
        if not prefetch:
            return Reply(m.LookupReply(hits=hits, locked=lease != NO_LEASE, in_l1=hits))
        client = call.client
        if counted:
            self.ctx.chunk_request_pending(call)
        started = time.monotonic()

        def done(p: Prefetched) -> None:
            if counted:
                # What the tiers did not load was in L1 (stored meanwhile, or past a gap): L1's hits.
                found = dict(p.by_tier)
                found[L1] = found.get(L1, 0) + hits + p.chunks - sum(p.by_tier.values())
                self._answered(context, len(keys), found)
                self.ctx.chunk_request_done("lookup", call, context, body.keys, hits + p.chunks, started, p.chunks)
            self._prefetched(key, session, client, hits + p.chunks)

        hints = LookupHints(body.source_hint, context.chunk_size, body.prefill_tokens_per_s)
        # Once the session ends (END_SESSION: the engine gave up on it; its context or client gone;
        # replaced by a new lookup), nobody waits for the prefetch: it loads nothing more.
        self.storage.prefetch(keys, hits, context.chunk_bytes, body.cache_salt, done, hints, lambda: self.ctx.sessions.prefetching(key, session))
        return Reply(m.LookupReply(hits=None, locked=lease != NO_LEASE, in_l1=hits))

    def _answered(self, context: Context, asked: int, found: dict[str, int]) -> None:
        """Count a lookup's final answer: chunks found per place (L1, or the tier that supplied them)."""
        cs = context.chunk_size
        self.ctx.metrics.lookup_answered(context.spec.model, {w: n * cs for w, n in found.items()}, (asked - sum(found.values())) * cs)

    def _prefetched(self, key: Key, session: Session, client: ClientId, total: int) -> None:
        """On the L2 driver thread: the prefetch ended with ``total`` leading chunks in L1. A locking
        session locks that whole prefix afresh, then lets go of its lookup's first lock. (Ended or
        replaced meanwhile: what was loaded stays in L1 as ordinary objects.)"""

        def lock_prefix(keys: list[ObjectKey]) -> tuple[LeaseId, int]:
            lock = self.storage.lock_prefix(keys, client, session=key[1], toucher=Toucher.NOBODY)
            return lock.lease_id, len(lock.offsets)

        old = self.ctx.sessions.prefetched(key, session, total, lock_prefix)
        if old:
            self.ctx.release_quietly(old, client)

    def query_prefetch_status(self, call: Call) -> Reply:
        body: m.QueryPrefetchStatusRequest = call.body
        context = self.ctx.context_of(body.context_id, call.client)
        answer = self.ctx.sessions.answer((context.id, body.session_id))
        if answer is None:
            raise KVDepotError(f"no lookup for session {body.session_id!r}", ErrorCode.UNKNOWN_SESSION)
        return Reply(m.LookupReply(hits=answer.hits, locked=answer.locked, in_l1=answer.in_l1))

    def free_lookup_locks(self, call: Call) -> Reply:
        body: m.FreeLookupLocksRequest = call.body
        context = self.ctx.context_of(body.context_id, call.client)
        key: Key = (context.id, body.session_id)
        lease = self.ctx.sessions.lease(key)
        if not lease:
            return Reply(m.FreeLookupLocksReply(released=0))
        end = None if body.end < 0 else body.end
        try:
            released = self.storage.release(lease, call.client, body.start, end, by_client=True)
        except IllegalTransition:
            released = 0  # a retrieve took the session's locks over meanwhile: they are its to end now
        except (UnknownLease, LeaseExpired):
            # Ended already (TTL, or this client was revoked): there is nothing left to free. Freeing is
            # idempotent, and a request's expired lock is that request's business, never an error that
            # would make an engine stop caching for everyone.
            self.ctx.metrics.request_failures.labels("lease_expired_frees").inc()
            released = 0
        if released and not self.storage.lease_active(lease):
            # That was its last lock: the session ends here, let go of by its client (the vLLM connector
            # frees a hit's locks once loaded and ends the session when the request finishes). Left in the
            # table, the sweep took it for one nobody ended and counted it in sessions_expired.
            self.ctx.sessions.freed(key, lease)
        return Reply(m.FreeLookupLocksReply(released=released))

    def renew_leases(self, call: Call) -> Reply:
        body: m.RenewLeasesRequest = call.body
        self.ctx.context_of(body.context_id, call.client)
        if len(body.lease_ids) + len(body.sessions) > MAX_KEYS:
            raise BadRequest(f"{len(body.lease_ids) + len(body.sessions)} renewals in one request; at most {MAX_KEYS}")
        renewed = self.storage.renew(call.client, [LeaseId(i) for i in body.lease_ids], body.sessions)
        return Reply(m.RenewLeasesReply(renewed=renewed))
