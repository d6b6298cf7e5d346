"""LOOKUP and its companions: how much of a prompt's prefix is stored, optionally locked for a session.

With no L2 tiers yet, a lookup completes at once; ``hits=None`` (ask again) is reserved for a prefetch
from L2 still running, which QUERY_PREFETCH_STATUS then answers.
"""

from __future__ import annotations

from kvdepot.errors import ErrorCode, KVDepotError, UnknownLease
from kvdepot.protocol import messages as m
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import context_and_keys
from kvdepot.server.rpc import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.state import Session


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
        ]

    def lookup(self, call: Call) -> Reply:
        body: m.LookupRequest = call.body
        context, keys = context_and_keys(self.ctx, call)
        table = self.ctx.storage.table
        if not body.session_id:
            return Reply(m.LookupReply(hits=table.lookup(keys)))
        lock = table.acquire_read(keys, call.client, session=body.session_id)
        hits = len(lock.offsets)
        old = self.ctx.sessions.put(context.id, body.session_id, Session(lock.lease_id, keys[:hits], hits))
        if old is not None:
            self._release(old.lease_id, call)
        return Reply(m.LookupReply(hits=hits, locked=hits > 0))

    def query_prefetch_status(self, call: Call) -> Reply:
        body: m.QueryPrefetchStatusRequest = call.body
        context = self.ctx.contexts.get(body.context_id, call.client)
        session = self.ctx.sessions.get(context.id, body.session_id)
        if session is None:
            raise KVDepotError(f"no lookup for session {body.session_id!r}", ErrorCode.UNKNOWN_SESSION)
        return Reply(m.LookupReply(hits=session.hits, locked=session.lease_id != 0))

    def free_lookup_locks(self, call: Call) -> Reply:
        body: m.FreeLookupLocksRequest = call.body
        context = self.ctx.contexts.get(body.context_id, call.client)
        session = self.ctx.sessions.get(context.id, body.session_id)
        if session is None or not session.lease_id:
            return Reply(m.FreeLookupLocksReply(released=0))
        end = None if body.end < 0 else body.end
        try:
            released = self.ctx.storage.table.release_read(session.lease_id, call.client, body.start, end)
        except UnknownLease:
            released = 0
        return Reply(m.FreeLookupLocksReply(released=released))

    def _release(self, lease_id, call: Call) -> None:
        try:
            self.ctx.storage.table.release_read(lease_id, call.client)
        except KVDepotError:
            pass

