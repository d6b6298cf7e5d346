"""Registering a context, and choosing the transfer path the registration allows.

A client registers one context (``ContextIdentity``: model, layout, rank, world size) and gets back
what the server decided (``Registration``: the context id, the chunk geometry, the hash, timings and the
arena it offers). From the arena offer and the options, ``choose_path`` picks the ``TransferPath``:
shm when this process can map the arena and hold its liveness lock, else inline, and says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvdepot.client.options import ClientOptions, Transport
from kvdepot.client.shm import try_attach
from kvdepot.client.transfer import InlinePath, PathHost, ShmPath, TransferPath
from kvdepot.errors import TransportUnavailable
from kvdepot.hashing import HashAlgorithm
from kvdepot.layout import KVLayout
from kvdepot.malloc import keep_large_buffers_in_heap
from kvdepot.protocol import messages as m
from kvdepot.protocol.identity import local_client_info

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextIdentity:
    """What every key of this client's objects is made of (with the chunk size and the cache salt)."""

    model: str
    layout: KVLayout
    rank: int = 0
    world_size: int = 1

    def request(self, chunk_size: int, hash_algorithm: str = "", hash_scheme: str = "") -> m.RegisterContextRequest:
        lay = self.layout
        return m.RegisterContextRequest(
            protocol_version=m.PROTOCOL_VERSION,
            model=self.model,
            layout=m.LayoutSpec(
                num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype, use_mla=lay.use_mla
            ),
            world_size=self.world_size,
            rank=self.rank,
            chunk_size=chunk_size,
            client=local_client_info(),
            hash_algorithm=hash_algorithm,
            hash_scheme=hash_scheme,
        )


@dataclass(frozen=True)
class Registration:
    """The server's answer to a registration: what the context is, and how to talk to it."""

    context_id: int
    chunk_size: int
    chunk_bytes: int
    algorithm: HashAlgorithm
    max_frame_bytes: int
    heartbeat_interval_s: float
    lease_ttl_s: float
    l2_tiers: int
    shm: m.ShmInfo | None
    blocks: m.BlockTransferOffer | None = None  # the server-driven path, where the server offers it

    @classmethod
    def of(cls, reply: m.RegisterContextReply) -> Registration:
        return cls(
            reply.context_id,
            reply.chunk_size,
            reply.chunk_bytes,
            reply.hash_algorithm,
            reply.max_frame_bytes,
            reply.heartbeat_interval_s,
            reply.lease_ttl_s,
            reply.l2_tiers,
            reply.shm,
            reply.blocks,
        )


def choose_path(
    current: TransferPath | None, reg: Registration, options: ClientOptions, host: PathHost
) -> tuple[TransferPath, str]:
    """Keep ``current`` when it still works with this registration, else pick a path: shm when the arena
    maps (and is the one offered), inline otherwise. Returns the path and why it was chosen; raises
    TransportUnavailable when shm was asked for and cannot be had."""
    if isinstance(current, ShmPath) and reg.shm is not None and current.arena.nonce == reg.shm.nonce:
        return current, "the same arena"
    if isinstance(current, InlinePath) and options.transport is Transport.INLINE:
        return current, "inline was asked for"
    if current is not None:
        current.close()  # the server restarted with a new arena
    if options.transport is Transport.INLINE:
        path: TransferPath = InlinePath(host)
        why = "inline was asked for"
    else:
        arena, prefaulter, why = try_attach(reg.shm, options.prefault)
        if arena is not None:
            path = ShmPath(host, arena, prefaulter)
        elif options.transport is Transport.SHM:
            raise TransportUnavailable(f"shm transport requested but {why}")
        else:
            # The arena's file visible here but unusable is most likely a misconfiguration
            # (permissions, a second server, a stale path) rather than a remote client.
            visible = reg.shm is not None and os.path.exists(reg.shm.path)
            log.log(logging.WARNING if visible else logging.INFO, "kvdepot: using the inline transport (%s)", why)
            path = InlinePath(host)
    if path.name == Transport.INLINE and options.malloc_tuning:
        keep_large_buffers_in_heap()  # received frames reuse warm heap instead of fresh pages
    return path, why
