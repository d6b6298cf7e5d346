"""Registration, sessions, clear, ping: everything that is not lookup or data transfer."""

from __future__ import annotations

import logging

from kvdepot import __version__
from kvdepot.errors import BadRequest, ErrorCode, KVDepotError
from kvdepot.keys import NamespaceSpec
from kvdepot.layout import KVLayout
from kvdepot.limits import MAX_CHUNK_TOKENS
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.liveness import check_client_info
from kvdepot.server.modules import ServerContext

MAX_BLOCK_REPORT = 1 << 40  # blocks per REPORT_BLOCK_ALLOCATION: far beyond any real engine
# A context's model name is kept for its life and labels every per-model series of /metrics and /status (and
# a KV-events topic): one of megabytes made each scrape hundreds of MB. Room for a local model path and the
# connectors' suffixes; the hash scheme is a short tag.
MAX_MODEL_NAME = 4096
MAX_HASH_SCHEME = 256

log = logging.getLogger(__name__)


class ManagementModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def handlers(self) -> list[HandlerSpec]:
        R, S, B = m.RequestType, HandlerMode.SYNC, HandlerMode.BLOCKING
        return [
            HandlerSpec(R.PING, self.ping, S),
            HandlerSpec(R.REGISTER_CONTEXT, self.register, S),
            HandlerSpec(R.UNREGISTER_CONTEXT, self.unregister, S),
            HandlerSpec(R.GET_CHUNK_SIZE, self.get_chunk_size, S),
            HandlerSpec(R.END_SESSION, self.end_session, S),
            HandlerSpec(R.CLEAR, self.clear, B),
            HandlerSpec(R.REPORT_BLOCK_ALLOCATION, self.report_block_allocation, S),
        ]

    def ping(self, call: Call) -> Reply:
        return Reply(m.PingReply())

    def register(self, call: Call) -> Reply:
        body: m.RegisterContextRequest = call.body
        if body.protocol_version != m.PROTOCOL_VERSION:
            raise KVDepotError(
                f"client speaks protocol {body.protocol_version}, server {m.PROTOCOL_VERSION}",
                ErrorCode.VERSION_MISMATCH,
            )
        cfg = self.ctx.config
        try:
            layout = KVLayout(**{f: getattr(body.layout, f) for f in body.layout.__struct_fields__})
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad layout: {exc}") from None
        if not 0 <= body.rank < body.world_size:
            raise BadRequest(f"rank {body.rank} is outside world_size {body.world_size}")
        if not body.model:
            raise BadRequest("model must be named")
        if len(body.model) > MAX_MODEL_NAME or len(body.hash_scheme) > MAX_HASH_SCHEME:
            raise BadRequest(
                f"model names are at most {MAX_MODEL_NAME} characters and hash schemes at most {MAX_HASH_SCHEME}, "
                f"got {len(body.model)} and {len(body.hash_scheme)}"
            )
        bad_info = check_client_info(body.client)
        if bad_info:
            raise BadRequest(f"bad client info: {bad_info}")
        chunk_size = body.chunk_size or cfg.storage.chunk_size
        if not 0 < chunk_size <= MAX_CHUNK_TOKENS:
            raise BadRequest(f"chunk_size {chunk_size} is outside [1, {MAX_CHUNK_TOKENS}]")
        chunk_bytes = layout.chunk_bytes(chunk_size)
        if chunk_bytes > self.ctx.storage.capacity:
            raise BadRequest(f"one chunk ({chunk_bytes} bytes) is larger than L1 ({self.ctx.storage.capacity})")
        spec = NamespaceSpec(body.model, body.world_size, body.rank, layout.fingerprint(), chunk_size)
        self._check_compatible(body, spec)
        # A worker that maps the arena holds a liveness lock there, at an offset of its own, so the
        # server can tell whether it may still touch arena memory (see kvdepot/shm/segment.py).
        shm = self.ctx.storage.shm_offer(call.client)
        self.ctx.liveness.register(call.client, body.client, shm.liveness_lock)
        context = self.ctx.contexts.add(call.client, layout, spec, body.hash_scheme, body.client.pid)
        log.info(
            "context %d registered: model=%s rank=%d/%d layout=%s chunk=%d tokens (%d bytes)",
            context.id, body.model, body.rank, body.world_size, layout.fingerprint(), chunk_size, chunk_bytes,
        )
        return Reply(
            m.RegisterContextReply(
                context_id=context.id,
                chunk_size=chunk_size,
                chunk_bytes=chunk_bytes,
                hash_algorithm=cfg.storage.hash_algorithm,
                server_version=__version__,
                max_frame_bytes=cfg.rpc.max_frame_bytes,
                heartbeat_interval_s=cfg.rpc.heartbeat_interval_s,
                lease_ttl_s=cfg.storage.lease_ttl_s,
                shm=m.ShmInfo(path=shm.path, size=shm.size, nonce=shm.nonce, liveness_lock=shm.liveness_lock),
                l2_tiers=self.ctx.storage.tier_count,
                blocks=self.ctx.block_offer,
            )
        )

    def _check_compatible(self, body: m.RegisterContextRequest, spec: NamespaceSpec) -> None:
        """The compatibility handshake: refuse, naming both sides' values, a client whose keys could never
        match what this server keys objects by, or what a live client of the same model and rank stores
        (the "0 hits, no error" that otherwise shows up only as a cache that never hits)."""
        server_alg = self.ctx.config.storage.hash_algorithm.value
        if body.hash_algorithm and body.hash_algorithm != server_alg:
            raise KVDepotError(
                f"this client's keys are {body.hash_algorithm} hashes; this server keys objects by {server_alg} (--hash-algorithm): "
                f"they can never match. Start the server with --hash-algorithm {body.hash_algorithm}, or let the client hash as the server does",
                ErrorCode.INCOMPATIBLE,
            )
        conflict = self.ctx.contexts.cannot_share_with(spec, body.hash_scheme)
        if conflict is None:
            return
        other, differ = conflict
        mine = {"layout": spec.layout_fingerprint, "chunk_size": str(spec.chunk_size), "hash_scheme": body.hash_scheme or "(unnamed)"}
        both = "; ".join(f"{k}: this client {mine[k]}, the live one {v}" for k, v in differ.items())
        raise KVDepotError(
            f"model {spec.model!r} rank {spec.rank}/{spec.world_size}: this client could never share KV with a live client of the same "
            f"model and rank (pid {other.pid}, context {other.id}): {both}. Make them agree, or register this one under another model name",
            ErrorCode.INCOMPATIBLE,
        )

    def unregister(self, call: Call) -> Reply:
        context = self.ctx.contexts.remove(call.body.context_id, call.client)
        for lease in self.ctx.sessions.end_context(context.id):
            self.ctx.release_quietly(lease, call.client)
        self.ctx.forget_contexts([context])
        self.ctx.forget_if_idle(call.client)
        return Reply(m.Ack())

    def get_chunk_size(self, call: Call) -> Reply:
        return Reply(m.ChunkSizeReply(chunk_size=self.ctx.config.storage.chunk_size))

    def end_session(self, call: Call) -> Reply:
        context = self.ctx.context_of(call.body.context_id, call.client)
        self.ctx.release_quietly(self.ctx.sessions.end((context.id, call.body.session_id)), call.client)
        return Reply(m.Ack())

    def clear(self, call: Call) -> Reply:
        result = self.ctx.storage.clear(call.body.scope)  # a ClearScope: the decoder refused any other value
        return Reply(m.ClearReply(removed=result.l1_removed, tiers_removed=result.tiers_removed))

    def report_block_allocation(self, call: Call) -> Reply:
        body: m.ReportBlockAllocationRequest = call.body
        self.ctx.context_of(body.context_id, call.client)
        for name, value in (("allocated_blocks", body.allocated_blocks), ("freed_blocks", body.freed_blocks)):
            if not 0 <= value <= MAX_BLOCK_REPORT:
                raise BadRequest(f"{name}={value} is outside [0, {MAX_BLOCK_REPORT}]")
        self.ctx.metrics.engine_blocks.labels("allocated").inc(body.allocated_blocks)
        self.ctx.metrics.engine_blocks.labels("freed").inc(body.freed_blocks)
        return Reply(m.Ack())
