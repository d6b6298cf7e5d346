"""What the scheduler half tells the worker half each step, and what the workers report back.

Both travel through vLLM's executor (pickled), so they are plain dataclasses of builtins. Block ids
always cover whole chunks, in token order: chunk ``i`` of an op is blocks
``block_ids[i*blocks_per_chunk:(i+1)*blocks_per_chunk]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(slots=True)
class LoadOp:
    """Scatter the stored chunks ``hashes`` into ``block_ids``, except the first ``skip_blocks`` blocks
    (vLLM holds those already, possibly shared with other requests)."""

    req_id: str
    hashes: list[bytes]
    cache_salt: str
    block_ids: list[int]
    skip_blocks: int = 0
    is_async: bool = False
    # Which of the scheduler's loads this is (unique per scheduler): the workers' reports name it, so a
    # report of an earlier admission's load (preempted and admitted again) is told apart from this one's.
    attempt: int = 0


@dataclass(slots=True)
class SaveOp:
    """Gather ``block_ids`` into new chunks ``hashes`` (the server skips chunks it already has)."""

    req_id: str
    hashes: list[bytes]
    cache_salt: str
    block_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # the chunks' tokens, with kv_events_token_ids; else none
    # Blocks in the request's table before these chunks' end that a synchronous load of this step or the
    # last one wrote (the request's own, or another's it shares): the chunks' KV was computed over them,
    # so if any of those loads failed on any rank the save must not be committed (see worker.py).
    over_loaded_blocks: list[int] = field(default_factory=list)


@dataclass
class KVDepotConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests whose blocks vLLM freed for this step


@dataclass
class KVDepotWorkerMetadata(KVConnectorWorkerMetadata):
    """The requests whose synchronous load ran in this step (on every worker: the step is collective),
    each with its ``LoadOp.attempt``: the scheduler frees a request's locks only for the load in flight."""

    loaded: dict[str, int] = field(default_factory=dict)  # request id -> attempt

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVDepotWorkerMetadata):
            return KVDepotWorkerMetadata({**self.loaded, **other.loaded})
        return self

    @classmethod
    def of(cls, ops: Iterable[LoadOp]) -> KVDepotWorkerMetadata:
        """The report of these loads, done."""
        return cls({op.req_id: op.attempt for op in ops})
