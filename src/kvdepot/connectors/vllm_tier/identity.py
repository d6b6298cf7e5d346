"""What a vLLM offload chunk is called in kvdepot: its namespace, its layout, and its chunk hash.

One kvdepot chunk is one row of vLLM's primary (CPU) offload tier, byte for byte: the KV of one
``OffloadKey`` (``blocks_per_chunk`` blocks of one KV-cache group) as every worker of the engine wrote it,
side by side, with the row's alignment padding. The tier runs in vLLM's scheduler, which holds whole rows,
so every object is registered as rank 0 of 1; the engine's topology is part of the namespace instead.

- **Namespace.** The model part of the registered context is ``<model>|vllm-offload-<digest>``, where the
  digest covers everything that decides what a row's bytes mean: the model, the KV dtype, the hash and
  chunk granularity, the KV-cache groups (block size and layer names), the parallel topology (unless vLLM
  certifies the row parallelism-agnostic), the replicated and canonical layout switches, vLLM's KV-cache
  layout, the device type and the row size. Two engines share exactly when all of these agree; the
  data-parallel index and the engine id are left out, so the replicas of one deployment share.
- **Layout.** Rows are opaque bytes to kvdepot: ``[1, 1, T, 1, row_bytes / T]`` of uint8, where T is the
  tokens one offload chunk covers (so the server's token counts mean tokens) when every group agrees on
  it and it divides the row, else 1.
- **Chunk hash.** ``sha256(OffloadKey)`` cut to the server's digest size. An ``OffloadKey`` is vLLM's
  block hash (a chain over the prompt's tokens and the request's cache salt) and the group index, so it
  already names the tokens; hashing it once more makes any key length fit the server's fixed one.
  vLLM's default block hash (sha256 from a fixed seed) is the same in every process; with a
  non-cryptographic one (``--prefix-caching-hash-algo xxhash``) engines share only under one
  ``PYTHONHASHSEED``, as for vLLM's own file-system tier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdepot.layout import KVLayout
from kvdepot.types import ChunkHash

KEY_SCHEME = "vllm-offload-key-v1"  # how chunk hashes are made (the server's compatibility handshake names it)
NAMESPACE_VERSION = 1  # bump when the row format or the fields below change meaning
_DIGEST_CHARS = 16


def chunk_hash(key: bytes, digest_size: int) -> ChunkHash:
    """The kvdepot chunk hash of a vLLM ``OffloadKey`` on a server whose hashes are ``digest_size`` bytes."""
    return ChunkHash(hashlib.sha256(key).digest()[:digest_size])


def group_of(key: bytes) -> int:
    """The KV-cache group index an ``OffloadKey`` ends with (4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")


def namespace_fields(config: Any, device: str, fp8_format: str = "", canonical_format: str = "") -> dict[str, Any]:
    """What decides the meaning of a row's bytes, from vLLM's ``OffloadingConfig`` (read by attribute, so
    this module does not import vLLM). ``fp8_format``: the platform's fp8 encoding (e4m3fn on NVIDIA,
    e4m3fnuz on some AMD GPUs: one device type, other bits), named where the KV is fp8;
    ``canonical_format``: vLLM's canonical byte format id, where the layout is canonical. Each is in the
    digest only when it applies, so other namespaces keep theirs."""
    par = config.parallel
    agnostic = bool(par.is_parallelism_agnostic)
    extra: dict[str, Any] = {}
    if fp8_format and "fp8" in str(config.model.dtype).lower():
        extra["fp8_format"] = fp8_format
    if canonical_format and getattr(config, "canonical_layout", False):
        extra["canonical_format"] = canonical_format
    return extra | {
        "format": NAMESPACE_VERSION,
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        # A row holds every worker's page side by side: another topology is other bytes, unless vLLM
        # says the concatenation is the same under any topology.
        "topology": "agnostic" if agnostic else [par.tp_size, par.pp_size, par.pcp_size, par.dcp_size, par.world_size],
        "replicated_layout": bool(getattr(config, "replicated_layout", False)),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
        "device": device,
    }


def tokens_per_chunk(config: Any) -> dict[int, int]:
    """Tokens one offload chunk covers, by KV-cache group id (the group index in an ``OffloadKey``)."""
    return {g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}


@dataclass(frozen=True)
class TierIdentity:
    """The context the tier registers: model string, layout and chunk size (tokens)."""

    model: str
    layout: KVLayout
    chunk_tokens: int
    digest: str

    @classmethod
    def of(cls, fields: Mapping[str, Any], row_bytes: int, tokens: Sequence[int], model_name: str = "") -> TierIdentity:
        """``fields`` from ``namespace_fields``; ``row_bytes`` the primary tier's row stride; ``tokens`` the
        tokens per chunk of each group; ``model_name`` replaces vLLM's model name in the readable prefix
        and in the digest (engines that load one model from different paths share under one name)."""
        if row_bytes <= 0:
            raise ValueError(f"the primary tier's rows must hold bytes, got {row_bytes}")
        fields = dict(fields)
        if model_name:
            fields["model"] = model_name
        # The row size follows from the fields above but for the host's page size (rows are page-aligned):
        # named too, so engines that disagree on it never meet (the server would refuse the second).
        fields["row_bytes"] = row_bytes
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]
        distinct = set(tokens)
        t = distinct.pop() if len(distinct) == 1 else 1
        if t <= 0 or row_bytes % t:
            t = 1
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=row_bytes // t, dtype="uint8", use_mla=True)
        return cls(f"{fields['model']}|vllm-offload-{digest}", layout, t, digest)

    @property
    def row_bytes(self) -> int:
        return self.layout.chunk_bytes(self.chunk_tokens)


def lookup_chains(keys: Sequence[bytes], positions: Sequence[int | None], tokens: Mapping[int, int]) -> list[list[int]]:
    """Indices of ``keys`` in the groups one LOOKUP each can answer exactly.

    A LOOKUP answers how many of its keys are stored *from the first on*. The keys of one group that end
    on that group's chunk boundaries are asked together, in prompt order (by ``positions``, their end
    tokens): the answer is a prefix, and vLLM wants no key past a prefix's first miss there. A key
    without a position, or off a chunk boundary (vLLM's partial-tail probes), is asked alone, so no other
    key's absence hides it."""
    chains: dict[int, list[tuple[int, int]]] = {}
    alone: list[list[int]] = []
    for i, (key, pos) in enumerate(zip(keys, positions)):
        group = group_of(key)
        step = tokens.get(group, 0)
        if pos is None or step <= 0 or pos % step:
            alone.append([i])
        else:
            chains.setdefault(group, []).append((pos, i))
    return [[i for _, i in sorted(chain)] for _, chain in sorted(chains.items())] + alone
