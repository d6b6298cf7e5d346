"""LOOKUP and its companions: how much of a prompt's prefix is stored, optionally locked for a session.

A lookup answers from L1 at once. With a session and L2 tiers, chunks missing from L1 are fetched in
the background; the reply then says ``hits=None`` and QUERY_PREFETCH_STATUS gives the final count.
"""

from __future__ import annotations

from kvdepot.errors import BadRequest, ErrorCode, KVDepotError, LeaseExpired, UnknownLease
from kvdepot.protocol import messages as m
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import context_and_keys
from kvdepot.server.rpc import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.state import Session
from kvdepot.storage.controllers import PrefetchJob
from kvdepot.storage.l1 import NO_LEASE, Toucher
from kvdepot.types import LeaseId

MAX_RENEWALS = 1 << 16


class LookupModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

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
        table = self.ctx.storage.table
        if not body.session_id:
            return Reply(m.LookupReply(hits=table.lookup(keys)))
        if body.lock:
            # NOBODY: a lookup lock tells the client no offsets; a retrieve hands them out later.
            lock = table.acquire_read(keys, call.client, session=body.session_id, toucher=Toucher.NOBODY)
            hits, lease = len(lock.offsets), lock.lease_id
        else:
            hits, lease = table.lookup(keys), NO_LEASE
        prefetcher = self.ctx.storage.prefetcher
        prefetch = body.prefetch and prefetcher is not None and hits < len(keys)
        if not prefetch and not body.lock:
            return Reply(m.LookupReply(hits=hits))  # nothing to track: no session is kept
        session = Session(lease, keys[:hits], None if prefetch else hits, body.lock, keys if prefetch else None)
        old = self.ctx.sessions.put(context.id, body.session_id, session)
        if old is not None:
            self._release(old.lease_id, call)
        if not prefetch:
            return Reply(m.LookupReply(hits=hits, locked=lease != NO_LEASE))
        assert prefetcher is not None
        client, sid = call.client, body.session_id
        prefetcher.submit(
            PrefetchJob(keys, hits, context.chunk_bytes, body.cache_salt, lambda n: self._prefetched(context.id, sid, session, client, hits + n))
        )
        return Reply(m.LookupReply(hits=None, locked=lease != NO_LEASE))

    def _prefetched(self, context_id, session_id: str, session: Session, client, total: int) -> None:
        """On the L2 driver thread: the prefetch ended with ``total`` leading chunks in L1."""
        table = self.ctx.storage.table
        with self.ctx.sessions.lock:
            if not self.ctx.sessions.is_current(context_id, session_id, session):
                return  # ended or replaced meanwhile: what was loaded stays in L1 as ordinary objects
            keys = session.all_keys or session.keys
            session.all_keys = None
            if not session.lock:
                session.hits = total
                return
            # Lock the whole prefix afresh, then let go of the lookup's first lock.
            lock = table.acquire_read(keys[:total], client, session=session_id, toucher=Toucher.NOBODY)
            old, session.lease_id = session.lease_id, lock.lease_id
            session.keys = keys[: len(lock.offsets)]
            session.hits = len(lock.offsets)
        if old:
            self._release(old, None, client)

    def query_prefetch_status(self, call: Call) -> Reply:
        body: m.QueryPrefetchStatusRequest = call.body
        context = self.ctx.context_of(body.context_id, call.client)
        session = self.ctx.sessions.get(context.id, body.session_id)
        if session is None:
            raise KVDepotError(f"no lookup for session {body.session_id!r}", ErrorCode.UNKNOWN_SESSION)
        hits = session.hits
        if hits is not None and not session.lock:
            self.ctx.sessions.pop(context.id, body.session_id)  # a lock-free session ends when answered
        return Reply(m.LookupReply(hits=hits, locked=session.lease_id != 0))

    def free_lookup_locks(self, call: Call) -> Reply:
        body: m.FreeLookupLocksRequest = call.body
        context = self.ctx.context_of(body.context_id, call.client)
        session = self.ctx.sessions.get(context.id, body.session_id)
        if session is None or not session.lease_id:
            return Reply(m.FreeLookupLocksReply(released=0))
        end = None if body.end < 0 else body.end
        try:
            released = self.ctx.storage.table.release_read(session.lease_id, call.client, body.start, end)
        except (UnknownLease, LeaseExpired):
            # Ended already (TTL, or this client was revoked): there is nothing left to free. Freeing is
            # idempotent, and a request's expired lock is that request's business, never an error that
            # would make an engine stop caching for everyone.
            self.ctx.failures.add("lease_expired_frees")
            released = 0
        return Reply(m.FreeLookupLocksReply(released=released))

    def renew_leases(self, call: Call) -> Reply:
        body: m.RenewLeasesRequest = call.body
        self.ctx.context_of(body.context_id, call.client)
        if len(body.lease_ids) + len(body.sessions) > MAX_RENEWALS:
            raise BadRequest(f"{len(body.lease_ids) + len(body.sessions)} renewals in one request; at most {MAX_RENEWALS}")
        renewed = self.ctx.storage.table.renew(call.client, [LeaseId(i) for i in body.lease_ids], body.sessions)
        return Reply(m.RenewLeasesReply(renewed=renewed))

    def _release(self, lease_id, call: Call | None, client=None) -> None:
        if not lease_id:
            return
        try:
            self.ctx.storage.table.release_read(lease_id, call.client if call is not None else client)
        except KVDepotError:
            pass

