"""Moving KV bytes: the shm path (PREPARE/COMMIT against arena slots the worker writes or reads itself)
and the inline path (raw payload frames over the socket).

Table-only steps (prepare, commit, and the zero-copy inline retrieve) are SYNC: they take microseconds.
The inline store copies up to hundreds of MiB into the arena, so it is BLOCKING.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvdepot.errors import BadRequest, KVDepotError, LeaseRevoked, UnknownContext
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import context_and_keys, count_short_retrieve, lock_for_retrieve, store_protects, touch_after_store
from kvdepot.server.state import Context
from kvdepot.storage.manager import ReadLock, Toucher
from kvdepot.types import LeaseId

log = logging.getLogger(__name__)


class TransferModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.storage = ctx.storage

    def handlers(self) -> list[HandlerSpec]:
        R, S, B = m.RequestType, HandlerMode.SYNC, HandlerMode.BLOCKING
        return [
            HandlerSpec(R.PREPARE_STORE, self.prepare_store, S),
            HandlerSpec(R.COMMIT_STORE, self.commit_store, S),
            HandlerSpec(R.PREPARE_RETRIEVE, self.prepare_retrieve, S),
            HandlerSpec(R.COMMIT_RETRIEVE, self.commit_retrieve, S),
            HandlerSpec(R.STORE_INLINE, self.store_inline, B),
            HandlerSpec(R.RETRIEVE_INLINE, self.retrieve_inline, S, pins_until_sent=True),
        ]

    # --- store ---------------------------------------------------------------------------------------

    def _require_watchable(self, call: Call) -> None:
        """Arena offsets go only to clients the server can watch: a paused client keeps writable views
        of its slots, so its space may be reused only once its process is known to be gone."""
        if not self.ctx.liveness.watchable(call.client):
            raise BadRequest(
                "the shm path needs a client the server can watch: one on this host that holds its liveness "
                "lock in the arena (ShmInfo.liveness_lock) or runs in the server's PID namespace; use inline"
            )

    def prepare_store(self, call: Call) -> Reply:
        context, keys = context_and_keys(self.ctx, call)
        self._require_watchable(call)
        self.ctx.chunk_tokens(context, keys, call.body.token_ids)
        protect = store_protects(call, keys, [])
        res = self.storage.reserve(keys, context.chunk_bytes, call.client, call.body.cache_salt, protect=protect, toucher=Toucher.CLIENT)
        try:
            touch_after_store(self.ctx, call, keys, res.statuses)
        except BaseException:
            self.ctx.abort_quietly(res.lease_id, call.client)
            raise
        allocated = sum(1 for s in res.statuses if s == m.SlotStatus.ALLOCATED)
        self.ctx.chunk_request_done("store", call, context, call.body.keys, allocated)
        return Reply(m.PrepareStoreReply(lease_id=res.lease_id, offsets=res.offsets, statuses=[int(s) for s in res.statuses]))

    def _context_for_finish(self, call: Call, finish: Callable[[], object], what: str) -> Context:
        """The caller's context for a COMMIT. Without one (the client was revoked, or unregistered the
        context first) the lease it names is still ended, as the abort or release ``finish`` does, so its
        space goes back now instead of at its TTL into quarantine for the life of the process (the lease
        is the caller's own: the table checks the owner); the client is told which and why."""
        try:
            return self.ctx.context_of(call.body.context_id, call.client)
        except LeaseRevoked:
            _finish_quietly(finish)
            raise
        except UnknownContext as exc:
            ended = _finish_quietly(finish)
            self.ctx.forget_if_idle(call.client)  # the unregister's goodbye, now that nothing is held
            how = f"it was {what}" if ended else "it had ended already"
            raise UnknownContext(f"{exc.message}; lease {call.body.lease_id} it names was not committed: {how}") from None

    def commit_store(self, call: Call) -> Reply:
        body: m.CommitStoreRequest = call.body
        lease = LeaseId(body.lease_id)
        context = self._context_for_finish(call, lambda: self.storage.abort(lease, call.client, by_client=True), "aborted")
        if body.abort:
            self.storage.abort(lease, call.client, by_client=True)
            return Reply(m.CommitStoreReply(committed=0))
        committed = self.storage.commit(lease, call.client, by_client=True)
        self.ctx.metrics.stored(context.spec.model, committed, committed * context.chunk_bytes, "shm")
        return Reply(m.CommitStoreReply(committed=committed))

    def store_inline(self, call: Call) -> Reply:
        body: m.StoreInlineRequest = call.body
        context, keys = context_and_keys(self.ctx, call)
        if not 0 <= body.first <= len(keys) or not 0 <= body.count <= len(keys) - body.first:
            raise BadRequest(f"first={body.first}, count={body.count} do not fit the {len(keys)} keys")
        protect = store_protects(call, keys, keys[: body.first])
        sent = keys[body.first : body.first + body.count] if body.count else keys[body.first :]
        self.ctx.chunk_tokens(context, sent, body.token_ids)
        size = context.chunk_bytes
        max_frame = self.ctx.config.rpc.max_frame_bytes
        per = codec.check_payload(call.payload, len(sent), size, context.rows, body.rows_per_frame, max_frame, call.request_id)
        # SERVER: this thread copies into the slots; if the lease ends meanwhile, they stay reserved.
        res = self.storage.reserve(sent, size, call.client, body.cache_salt, protect=protect, toucher=Toucher.SERVER)
        try:
            touch_after_store(self.ctx, call, keys, res.statuses)
            for i, (offset, status) in enumerate(zip(res.offsets, res.statuses)):
                if status == m.SlotStatus.ALLOCATED:
                    self.storage.copy_into(offset, [f.buffer for f in call.payload[i * per : (i + 1) * per]])
        except BaseException:
            self.ctx.abort_quietly(res.lease_id, call.client)
            raise
        committed = self.storage.commit(res.lease_id, call.client)
        self.ctx.metrics.stored(context.spec.model, committed, committed * size, "inline")
        self.ctx.chunk_request_done("store", call, context, body.keys, committed)
        return Reply(m.StoreInlineReply(statuses=[int(s) for s in res.statuses]))

    # --- retrieve ------------------------------------------------------------------------------------

    def _lock_for_retrieve(self, call: Call, toucher: Toucher) -> tuple[Context, ReadLock]:
        """Lock chunks ``keys[start:]``, reusing the session's lookup locks when they cover them.
        ``toucher``: who will read the locked extents (the client on shm, the server's send inline)."""
        check = (lambda: self._require_watchable(call)) if toucher is Toucher.CLIENT else None
        context, lock = lock_for_retrieve(self.ctx, call, toucher, check)
        count_short_retrieve(self.ctx, call, len(lock.offsets))
        return context, lock

    def prepare_retrieve(self, call: Call) -> Reply:
        context, lock = self._lock_for_retrieve(call, Toucher.CLIENT)
        self.ctx.metrics.retrieved(context.spec.model, len(lock.offsets), len(lock.offsets) * context.chunk_bytes, "shm")
        self.ctx.chunk_request_done("retrieve", call, context, call.body.keys, len(lock.offsets))
        return Reply(m.PrepareRetrieveReply(lease_id=lock.lease_id, offsets=lock.offsets))

    def commit_retrieve(self, call: Call) -> Reply:
        body: m.CommitRetrieveRequest = call.body
        lease = LeaseId(body.lease_id)
        self._context_for_finish(call, lambda: self.storage.release(lease, call.client, by_client=True), "released")
        # A lease that ended while its reader could still read kept its pins, so that read was sound;
        # LeaseExpired here means the pins did go (the reader could not be watched): the reads were unsafe.
        self.storage.release(lease, call.client, by_client=True)
        return Reply(m.Ack())

    def retrieve_inline(self, call: Call) -> Reply:
        # SERVER: ZeroMQ reads the extents until the send completes; the locks end only then.
        context, lock = self._lock_for_retrieve(call, Toucher.SERVER)
        if not lock.offsets:
            if lock.lease_id:
                self.storage.release(lock.lease_id, call.client)
            return Reply(m.RetrieveInlineReply(found=0))
        size = context.chunk_bytes
        max_frame = self.ctx.config.rpc.max_frame_bytes
        rpf = codec.rows_per_frame_for(size, context.rows, max_frame)
        payload = []
        for offset in lock.offsets:
            payload.extend(codec.split_object(self.storage.payload(offset, size), context.rows, rpf, max_frame))
        owner, lease = call.client, lock.lease_id
        self.ctx.metrics.retrieved(context.spec.model, len(lock.offsets), len(lock.offsets) * size, "inline")
        self.ctx.chunk_request_done("retrieve", call, context, call.body.keys, len(lock.offsets))

        def release() -> None:  # once ZeroMQ no longer reads the arena
            try:
                self.storage.release(lease, owner)
            except KVDepotError:
                pass

        return Reply(m.RetrieveInlineReply(found=len(lock.offsets), rows_per_frame=rpf), payload, on_sent=release)


def _finish_quietly(finish: Callable[[], object]) -> bool:
    """End a lease that may have ended already (TTL, revocation, another finish); whether this did."""
    try:
        finish()
    except KVDepotError:
        return False
    return True
