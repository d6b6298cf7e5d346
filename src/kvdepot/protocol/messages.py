"""Every request and reply body, and the registry pairing each RequestType with its classes.

Rules (they are the protocol's compatibility contract):
- ``RequestType`` values are explicit integers and only ever appended; never renumber or reuse one.
- Each request type maps to exactly one request struct and one reply struct (``REGISTRY``), checked at
  import, so a handler can never answer with the wrong shape.
- KV bytes never appear in these structs: they travel as raw payload frames after the body frame.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from kvdepot.hashing import HashAlgorithm
from kvdepot.types import ClearScope, SlotStatus  # wire enums too: SlotStatus is re-exported here  # noqa: F401

PROTOCOL_VERSION = 6  # 2: ShmInfo.liveness_lock, RENEW_LEASES, SlotStatus.OVER_QUOTA; 3: LookupRequest.probe, LookupReply.in_l1;
# 4: LookupRequest.source_hint and prefill_tokens_per_s, the PEER_* requests; 5: RegisterContextRequest.hash_algorithm and
# hash_scheme (the compatibility handshake); 6: RegisterContextReply.blocks and the paged-cache requests (REGISTER_KV_CACHE ..
# RETRIEVE_BLOCKS: the server-driven path)


# AGENT_SESSION_NOTE: ``agent_session`` (LOOKUP, PREPARE_STORE, STORE_INLINE) names a conversation of
# ``cache_salt``: the request opens or renews it and moves its protection from eviction to the request's
# keys (the whole chain from chunk 0), until the server's --agent-session-ttl-s passes without a turn.
# Appended with a default, and these three bodies omit defaults on the wire, so a client that does not
# use it sends exactly what protocol 4 sent and PROTOCOL_VERSION stays 4.


class RequestType(IntEnum):
    PING = 1
    REGISTER_CONTEXT = 2
    UNREGISTER_CONTEXT = 3
    GET_CHUNK_SIZE = 4
    LOOKUP = 5
    QUERY_PREFETCH_STATUS = 6
    FREE_LOOKUP_LOCKS = 7
    PREPARE_STORE = 8
    COMMIT_STORE = 9
    PREPARE_RETRIEVE = 10
    COMMIT_RETRIEVE = 11
    STORE_INLINE = 12
    RETRIEVE_INLINE = 13
    END_SESSION = 14
    CLEAR = 15
    REPORT_BLOCK_ALLOCATION = 16
    RENEW_LEASES = 17
    # lifecycle controls (storage/pins.py): an old server answers UNKNOWN_REQUEST_TYPE, so no version bump
    PIN_PREFIX = 18
    UNPIN = 19
    CLOSE_AGENT_SESSION = 20
    # the server-driven path: the server moves a worker's paged cache blocks itself (CUDA IPC; host files)
    REGISTER_KV_CACHE = 21
    UNREGISTER_KV_CACHE = 22
    STORE_BLOCKS = 23
    RETRIEVE_BLOCKS = 24
    # the peer tier's control plane (node to node; kvdepot.peer)
    PEER_JOIN = 32
    PEER_HEARTBEAT = 33
    PEER_PUBLISH = 34
    PEER_UNPUBLISH = 35
    PEER_RESOLVE = 36
    PEER_STATUS = 37
    PEER_PROMOTE = 38


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


# --- framing headers ------------------------------------------------------------------------------


class RequestHeader(msgspec.Struct, array_like=True):
    version: int
    request_id: int
    type: int
    timeout_ms: int = 0  # the client's remaining patience; 0 = none


class ReplyHeader(msgspec.Struct, array_like=True):
    version: int
    request_id: int
    status: int  # ErrorCode; 0 = OK, else the body is an ErrorReply


class ErrorReply(_Body):
    code: int
    message: str


# --- shared pieces ---------------------------------------------------------------------------------


class LayoutSpec(_Body):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    use_mla: bool = False


class ClientInfo(_Body):
    """Lets a same-host server watch the client process and free its leases the moment it dies."""

    pid: int = 0
    hostname: str = ""
    boot_id: str = ""
    pid_namespace: int = 0


class ShmInfo(_Body):
    """The server's arena. A worker that maps it must hold an OFD write lock on the one byte at
    ``liveness_lock`` of that file for as long as it may touch the mapping: the server gives arena
    offsets only to clients it can watch that way (or through a pidfd)."""

    path: str
    size: int
    nonce: bytes
    liveness_lock: int = -1


class Ack(_Body):
    ok: bool = True


class BlockTransferOffer(_Body):
    """What the server-driven path (REGISTER_KV_CACHE, STORE_BLOCKS, RETRIEVE_BLOCKS) can reach from this
    server: the GPUs it can open CUDA IPC memory on (by UUID), and whether it maps host caches kept in
    shared-memory files (``HostFileMemory``) under ``shm_dir``."""

    devices: list[str] = msgspec.field(default_factory=list)
    host_files: bool = False
    shm_dir: str = ""


# --- requests and replies --------------------------------------------------------------------------


class PingRequest(_Body):
    pass


class PingReply(_Body):
    ok: bool = True


class RegisterContextRequest(_Body):
    protocol_version: int
    model: str
    layout: LayoutSpec
    world_size: int = 1
    rank: int = 0
    chunk_size: int = 0  # 0: the server's default
    client: ClientInfo = msgspec.field(default_factory=ClientInfo)
    # The compatibility handshake: what the client's chunk keys are made with. ``hash_algorithm`` "" takes
    # the server's (the client hashes with what the reply announces); a client whose keys come from its
    # engine (SGLang's page keys) names the algorithm they need. ``hash_scheme`` names how tokens become
    # keys (``kvdepot.hashing.HASH_SCHEME`` for kvdepot's chain; the engine's, when it makes the keys).
    hash_algorithm: str = ""
    hash_scheme: str = ""


class RegisterContextReply(_Body):
    context_id: int
    chunk_size: int
    chunk_bytes: int
    hash_algorithm: HashAlgorithm
    server_version: str
    max_frame_bytes: int
    heartbeat_interval_s: float
    lease_ttl_s: float
    shm: ShmInfo | None = None
    l2_tiers: int = 0  # > 0: lookups may complete later (prefetch from L2)
    blocks: BlockTransferOffer | None = None  # None: this server has no server-driven path (no torch, or turned off)


class UnregisterContextRequest(_Body):
    context_id: int


class GetChunkSizeRequest(_Body):
    pass


class ChunkSizeReply(_Body):
    chunk_size: int


class LookupRequest(_Body, omit_defaults=True):
    """With ``session_id``: the hits are tracked for that session, read-locked (``lock``) until it
    retrieves, frees them or ends, and chunks missing from L1 are fetched from L2 (``prefetch``): the
    reply then says ``hits=None`` and QUERY_PREFETCH_STATUS tells the final count. A session that does
    not lock ends by itself once QUERY_PREFETCH_STATUS has reported a final count."""

    context_id: int
    keys: list[bytes]
    cache_salt: str = ""
    session_id: str = ""
    lock: bool = True
    prefetch: bool = True
    probe: bool = False  # a store's check of what is stored already: not counted as a lookup
    source_hint: str = ""  # a router's HOST[:PORT] of where the prompt's KV was computed (the peer tier asks it first)
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: unknown): a pull slower than recomputing is skipped
    agent_session: str = ""  # a conversation's name: its prefix is kept across turns (see AGENT_SESSION_NOTE)


class LookupReply(_Body):
    hits: int | None  # leading chunks found; None while a prefetch is still running
    locked: bool = False
    in_l1: int = 0  # of the leading chunks, how many were in L1 at the lookup (the rest came from L2)


class QueryPrefetchStatusRequest(_Body):
    context_id: int
    session_id: str


class FreeLookupLocksRequest(_Body):
    context_id: int
    session_id: str
    start: int = 0  # release the session's locks on chunks [start, end)
    end: int = -1  # -1: to the end


class FreeLookupLocksReply(_Body):
    released: int


TOKEN_IDS_NOTE = """A store may carry its chunks' token ids (a client opts in: ``ClientOptions.send_token_ids``):
the server never needs them, but KV events then name each stored block's tokens, as vLLM's own do, so a
router that hashes tokens its own way can index kvdepot's blocks."""


class PrepareStoreRequest(_Body, omit_defaults=True):
    context_id: int
    keys: list[bytes]
    cache_salt: str = ""
    agent_session: str = ""  # see AGENT_SESSION_NOTE
    token_ids: list[int] = []  # see TOKEN_IDS_NOTE: the tokens of every chunk in ``keys``, or none


class PrepareStoreReply(_Body):
    lease_id: int
    offsets: list[int]  # arena offset per key, -1 where status is not ALLOCATED
    statuses: list[int]  # SlotStatus per key


class CommitStoreRequest(_Body):
    context_id: int
    lease_id: int
    abort: bool = False


class CommitStoreReply(_Body):
    committed: int


class PrepareRetrieveRequest(_Body):
    """Lock and locate chunks ``keys[start:]`` (the leading run of them found). ``keys`` is the whole
    chain from chunk 0, so the server can reuse the locks this session's LOOKUP took."""

    context_id: int
    keys: list[bytes]
    cache_salt: str = ""
    session_id: str = ""
    start: int = 0
    limit: int = 0  # > 0: at most this many chunks


class PrepareRetrieveReply(_Body):
    lease_id: int
    offsets: list[int]  # one per chunk found, from keys[start] on


class CommitRetrieveRequest(_Body):
    context_id: int
    lease_id: int


class StoreInlineRequest(_Body, omit_defaults=True):
    """Followed by payload frames: the chunks ``keys[first:first+count]`` (``count`` 0: to the end) in
    order, each split into frames of ``rows_per_frame`` rows (see ``codec``). ``keys`` is the whole chain
    from chunk 0: the chunks before ``first`` are the prefix this store extends, and making room for the
    new chunks never evicts them."""

    context_id: int
    keys: list[bytes]
    rows_per_frame: int
    cache_salt: str = ""
    first: int = 0
    count: int = 0
    agent_session: str = ""  # see AGENT_SESSION_NOTE
    token_ids: list[int] = []  # see TOKEN_IDS_NOTE: the tokens of the chunks this request sends, or none


class StoreInlineReply(_Body):
    statuses: list[int]  # SlotStatus per key sent (keys[first:])


class RetrieveInlineRequest(_Body):
    """As PrepareRetrieveRequest, but the bytes come back as payload frames. ``limit`` > 0 caps the
    chunks returned, so a client can fetch a long prefix as several pipelined, bounded replies."""

    context_id: int
    keys: list[bytes]
    cache_salt: str = ""
    session_id: str = ""
    start: int = 0
    limit: int = 0


class RetrieveInlineReply(_Body):
    """Followed by the payload frames of the ``found`` chunks from ``keys[start]`` on, each split into
    frames of ``rows_per_frame`` rows."""

    found: int
    rows_per_frame: int = 0


class EndSessionRequest(_Body):
    context_id: int
    session_id: str


class ClearRequest(_Body):
    scope: ClearScope = ClearScope.L1


class ClearReply(_Body):
    removed: int  # L1 objects
    tiers_removed: dict[str, int] = msgspec.field(default_factory=dict)  # tier name -> objects (-1: failed)


class ReportBlockAllocationRequest(_Body):
    context_id: int
    allocated_blocks: int = 0
    freed_blocks: int = 0


class RenewLeasesRequest(_Body):
    """Push the deadline of this client's named leases, and of every lease of the named sessions, to
    now + the lease TTL: a live client renews the locks of work it is still doing (a request waiting in
    an engine's queue, a slow prefill), so the TTL only ever ends leases it leaked."""

    context_id: int
    lease_ids: list[int] = msgspec.field(default_factory=list)
    sessions: list[str] = msgspec.field(default_factory=list)


class RenewLeasesReply(_Body):
    renewed: int


# --- lifecycle controls ---------------------------------------------------------------------------


class PinPrefixRequest(_Body):
    """Keep the leading run of ``keys`` that is in L1 now from eviction: until UNPIN (``ttl_s`` 0, a
    hard pin) or for ``ttl_s`` seconds (a soft pin). Counted against the salt's quota (NO_SPACE when the
    salt's pinned bytes would exceed it). A pin belongs to the server, not the client: it outlives it."""

    context_id: int
    keys: list[bytes]
    cache_salt: str = ""
    ttl_s: float = 0.0


class UnpinRequest(_Body):
    pin_id: int


class PinReply(_Body):
    pin_id: int
    pinned: int  # objects the pin protects (0: none of the prefix was in L1)
    state: str  # hard, soft, released, expired
    expires_in_s: float = -1.0  # -1: no deadline (hard, or ended)


class CloseAgentSessionRequest(_Body):
    """End an agent session (see AGENT_SESSION_NOTE): its prefix is evicted normally from now on."""

    name: str
    cache_salt: str = ""


# --- the server-driven path: a worker's paged cache, moved by the server ---------------------------------


class CudaIpcMemory(_Body, tag="cuda_ipc"):
    """One CUDA allocation of the worker, as torch's CUDA IPC sharing exports it (the fields of
    ``UntypedStorage._share_cuda_``), as plain bytes and numbers: never pickled. The server opens it on
    its own device with this UUID (the two processes may number their devices differently)."""

    device_uuid: str
    handle: bytes
    size: int  # bytes of the storage
    offset: int  # the storage's byte offset inside the exported allocation
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


class HostFileMemory(_Body, tag="host_file"):
    """A paged cache in host memory that lives in a shared-memory file: ``kvdepot-kvcache-*`` directly in
    the server's shm directory (``BlockTransferOffer.shm_dir``), a regular file owned by the server's
    user, mapped by the server from ``offset`` for ``size`` bytes."""

    path: str
    size: int
    offset: int = 0


CacheMemory = CudaIpcMemory | HostFileMemory


class PagedLayerSpec(_Body):
    """One layer's cache inside one of the registered memories: its first element at byte ``offset``,
    its shape and strides (in elements) as the engine sees it, in ``format`` (``kvdepot.layout.PagedFormat``:
    ``kv_first`` ``[K, blocks, block_size, H, D]`` or ``block_first`` ``[blocks, K, block_size, H, D]``)."""

    memory: int  # index into RegisterKVCacheRequest.memories
    offset: int
    shape: list[int]
    stride: list[int]
    dtype: str
    format: str
    group: int = 0  # the KV-cache group whose block ids address this layer


class RegisterKVCacheRequest(_Body):
    """The worker's paged KV cache, every layer in model order (the chunk's L axis)."""

    context_id: int
    memories: list[CacheMemory]
    layers: list[PagedLayerSpec]
    block_size: int


class RegisterKVCacheReply(_Body):
    cache_id: int
    num_blocks: int
    # CUDA: IPC handles of the events the server records after layer l of every RETRIEVE_BLOCKS copy it
    # queued (one per layer); the worker opens them once and waits on one before that layer. Empty for
    # host memory (its copies are done when the reply comes).
    layer_events: list[bytes] = msgspec.field(default_factory=list)


class UnregisterKVCacheRequest(_Body):
    context_id: int
    cache_id: int


class StoreBlocksRequest(_Body, omit_defaults=True):
    """Copy chunks ``keys[first:]`` out of the registered cache into L1. ``block_ids[g]`` lists, for
    KV-cache group ``g``, the blocks of those chunks in order (``chunk_size // block_size`` per chunk).
    ``keys`` is the whole chain from chunk 0 (what comes before ``first`` is the prefix this extends).
    ``ready_event``: a CUDA IPC event handle the worker recorded once the blocks were written; the
    server's copies wait for it. The reply comes when the copies have read every block: the worker may
    reuse them then."""

    context_id: int
    cache_id: int
    keys: list[bytes]
    block_ids: list[list[int]]
    cache_salt: str = ""
    first: int = 0
    ready_event: bytes = b""
    agent_session: str = ""  # see AGENT_SESSION_NOTE
    token_ids: list[int] = []  # see TOKEN_IDS_NOTE: the tokens of the chunks from ``first`` on, or none


class StoreBlocksReply(_Body):
    statuses: list[int]  # SlotStatus per chunk from keys[first] on


class RetrieveBlocksRequest(_Body, omit_defaults=True):
    """Copy the leading stored chunks of ``keys[start:]`` (at most ``limit``) into the registered cache:
    ``block_ids[g]`` names group ``g``'s blocks of those chunks, from chunk ``start`` on. The blocks of
    the first ``skip_first_n_tokens`` tokens (from chunk ``start``) are never written: the engine's own
    prefix cache shares them. With ``session_id`` the session's lookup locks are taken over.
    ``ready_event``: recorded by the worker once those blocks may be written. CUDA: the reply comes when
    the copies are queued, and the worker waits on ``layer_events`` before it reads a layer; host memory:
    when they are done."""

    context_id: int
    cache_id: int
    keys: list[bytes]
    block_ids: list[list[int]]
    cache_salt: str = ""
    session_id: str = ""
    start: int = 0
    limit: int = 0
    skip_first_n_tokens: int = 0
    ready_event: bytes = b""


class RetrieveBlocksReply(_Body):
    found: int  # chunks copied: a prefix of keys[start:]


# --- the peer tier (node to node) -------------------------------------------------------------------


class PeerNodeInfo(_Body):
    """One member of a peer cluster: its id (``host:control_port``), where its data plane listens, and
    the incarnation it started with (a restarted node is told from its earlier self)."""

    id: str
    host: str
    control_port: int
    data_port: int
    incarnation: int = 0


class PeerMembershipReply(_Body, omit_defaults=True):
    """A master's view: live members (the head first, then by id) and the active masters. ``settling``:
    the master has just started and may lack live members (``discovery.py``): add what it names, drop
    no one on its word. Appended with a default and left off the wire when false, so a peer that
    predates it decodes every settled answer as before (and refuses a settling one, which keeps its
    membership as it was: the safe reading); no version bump."""

    members: list[PeerNodeInfo]
    masters: list[str]
    head: str = ""
    silent_ms: list[int] = msgspec.field(default_factory=list)  # per member: since this master last heard it
    settling: bool = False


class PeerJoinRequest(_Body):
    node: PeerNodeInfo


class PeerHeartbeatRequest(_Body):
    node: PeerNodeInfo


class PeerLocation(_Body, omit_defaults=True):
    """Where one published page lives: its owner's pool range, the generation that range holds, and
    the page's checksum (xxh3_128), which the reader checks on every byte it receives. ``incarnation``
    came later (2026-11-27) and a node before it refuses the field: left off the wire when 0, so the
    records of such nodes that a newer shard holds still decode there (they did not: a node before it
    found no page of its own version whose directory owner was a newer node)."""

    key: bytes
    node: str
    offset: int
    length: int
    generation: int
    checksum: bytes
    resident: bool = True
    incarnation: int = 0  # of the node that published it: a restarted node's earlier records are dropped


class PeerPublishRequest(_Body):
    records: list[PeerLocation]


class PeerUnpublishRequest(_Body):
    """Forget these (key, node, generation) records; a newer generation of the same key stays."""

    keys: list[bytes]
    node: str
    generations: list[int]


class PeerCountReply(_Body, omit_defaults=True):
    """``later_run`` (a publish's reply): the shard knows a later run of the publisher than the one its
    records name, so it refused them; the publisher's clock stepped back across a restart, and it must
    take a run after that one. Left off the wire when 0, so a peer that predates it decodes every other
    answer as before."""

    count: int
    later_run: int = 0


class PeerResolveRequest(_Body):
    keys: list[bytes]
    own_pages: bool = False  # answer from this node's own pool and disk, not its directory shard (a router's hint)


class PeerResolveReply(_Body):
    """Per key, the records this shard holds (empty: unknown here)."""

    locations: list[list[PeerLocation]]


class PeerStatusRequest(_Body):
    pass


class PeerPromoteRequest(_Body):
    """Bring these pages from the owner's disk back into its pool; the reply holds each one's fresh
    resident record (empty: not on this node any more)."""

    keys: list[bytes]


class PeerStatusReply(_Body):
    node: PeerNodeInfo
    members: list[PeerNodeInfo]
    masters: list[str]
    pool_used_bytes: int
    pool_capacity_bytes: int
    pool_keys: int
    directory_records: int


# --- the registry ----------------------------------------------------------------------------------

REGISTRY: dict[RequestType, tuple[type[_Body], type[_Body]]] = {
    RequestType.PING: (PingRequest, PingReply),
    RequestType.REGISTER_CONTEXT: (RegisterContextRequest, RegisterContextReply),
    RequestType.UNREGISTER_CONTEXT: (UnregisterContextRequest, Ack),
    RequestType.GET_CHUNK_SIZE: (GetChunkSizeRequest, ChunkSizeReply),
    RequestType.LOOKUP: (LookupRequest, LookupReply),
    RequestType.QUERY_PREFETCH_STATUS: (QueryPrefetchStatusRequest, LookupReply),
    RequestType.FREE_LOOKUP_LOCKS: (FreeLookupLocksRequest, FreeLookupLocksReply),
    RequestType.PREPARE_STORE: (PrepareStoreRequest, PrepareStoreReply),
    RequestType.COMMIT_STORE: (CommitStoreRequest, CommitStoreReply),
    RequestType.PREPARE_RETRIEVE: (PrepareRetrieveRequest, PrepareRetrieveReply),
    RequestType.COMMIT_RETRIEVE: (CommitRetrieveRequest, Ack),
    RequestType.STORE_INLINE: (StoreInlineRequest, StoreInlineReply),
    RequestType.RETRIEVE_INLINE: (RetrieveInlineRequest, RetrieveInlineReply),
    RequestType.END_SESSION: (EndSessionRequest, Ack),
    RequestType.CLEAR: (ClearRequest, ClearReply),
    RequestType.REPORT_BLOCK_ALLOCATION: (ReportBlockAllocationRequest, Ack),
    RequestType.RENEW_LEASES: (RenewLeasesRequest, RenewLeasesReply),
    RequestType.PIN_PREFIX: (PinPrefixRequest, PinReply),
    RequestType.UNPIN: (UnpinRequest, PinReply),
    RequestType.CLOSE_AGENT_SESSION: (CloseAgentSessionRequest, Ack),
    RequestType.REGISTER_KV_CACHE: (RegisterKVCacheRequest, RegisterKVCacheReply),
    RequestType.UNREGISTER_KV_CACHE: (UnregisterKVCacheRequest, Ack),
    RequestType.STORE_BLOCKS: (StoreBlocksRequest, StoreBlocksReply),
    RequestType.RETRIEVE_BLOCKS: (RetrieveBlocksRequest, RetrieveBlocksReply),
    RequestType.PEER_JOIN: (PeerJoinRequest, PeerMembershipReply),
    RequestType.PEER_HEARTBEAT: (PeerHeartbeatRequest, PeerMembershipReply),
    RequestType.PEER_PUBLISH: (PeerPublishRequest, PeerCountReply),
    RequestType.PEER_UNPUBLISH: (PeerUnpublishRequest, PeerCountReply),
    RequestType.PEER_RESOLVE: (PeerResolveRequest, PeerResolveReply),
    RequestType.PEER_STATUS: (PeerStatusRequest, PeerStatusReply),
    RequestType.PEER_PROMOTE: (PeerPromoteRequest, PeerResolveReply),
}


def _check_registry() -> None:
    missing = set(RequestType) - set(REGISTRY)
    if missing:
        raise RuntimeError(f"request types without message classes: {sorted(m.name for m in missing)}")
    seen: dict[type, RequestType] = {}
    for rtype, (req_cls, _) in REGISTRY.items():
        if req_cls in seen:
            raise RuntimeError(f"{req_cls.__name__} is used by both {seen[req_cls].name} and {rtype.name}")
        seen[req_cls] = rtype
    values = [int(t) for t in RequestType]
    if len(values) != len(set(values)):
        raise RuntimeError("duplicate RequestType values")


_check_registry()
