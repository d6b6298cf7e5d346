"""vLLM's own scheduler-side objects, built small for tests that drive the connector's halves in process:
requests, block lists and scheduler outputs, no engine. vLLM is imported inside each builder, so a suite
that skips without vLLM (``require_vllm``) can still import this module.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

BLOCK_SIZE = 128  # vLLM's CPU block size


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` reproducible token ids (no special tokens)."""
    return np.random.default_rng(seed).integers(3, 30000, size=n).tolist()


def request(req_id: str, toks: Sequence[int], salt: str | None = None, vllm_hashes: bool = False, block_size: int = BLOCK_SIZE,
            media: Sequence[tuple[str, int, int]] = (), lora_request: Any = None) -> Any:  # fmt: skip
    """A vLLM request; ``vllm_hashes``: with vLLM's own sha256 prefix hashes, as its engine core makes.
    ``media``: (identifier, offset, length) of image items whose placeholders ``toks`` holds there;
    ``lora_request``: vLLM's ``LoRARequest`` of the adapter that serves it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = None
    if vllm_hashes:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(block_size, sha256)
    return Request(req_id, list(toks), SamplingParams(max_tokens=8), None, cache_salt=salt, block_hasher=hasher,
                   mm_features=[image(*m) for m in media] or None, lora_request=lora_request)  # fmt: skip


def image(identifier: str, offset: int, length: int) -> Any:
    """vLLM's record of one image item of a request (its processed data left out, as for a cached item)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length))


def blocks(ids: Iterable[int]) -> Any:
    """vLLM's ``KVCacheBlocks`` of one group, holding blocks ``ids``."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def step(new: Iterable = (), cached: Iterable = (), scheduled: Mapping[str, int] | None = None, preempted: Iterable[str] = ()) -> Any:
    """A SchedulerOutput: ``new`` = [(req, block_ids, num_computed)], ``cached`` = [(req, new_block_ids,
    num_computed)], ``scheduled`` = {req_id: tokens this step}."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    for req, ids, computed in new:
        req.num_computed_tokens = computed
        so.scheduled_new_reqs.append(NewRequestData.from_request(req, (list(ids),)))
    cd = CachedRequestData.make_empty()
    for req, ids, computed in cached:
        cd.req_ids.append(req.request_id)
        cd.new_block_ids.append((list(ids),) if ids else None)
        cd.num_computed_tokens.append(computed)
        cd.num_output_tokens.append(req.num_output_tokens)
    so.scheduled_cached_reqs = cd
    so.num_scheduled_tokens = dict(scheduled or {})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    so.preempted_req_ids = set(preempted)
    return so


def run_step(w: Any, meta: Any) -> None:
    """A worker half's step as vLLM drives it: preemptions first, then the loads, the forward, the saves."""
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    w.wait_for_save(meta)


def reports(w: Any, finished: set[str], wait_s: float = 1.0) -> set[str]:
    """What a worker half reports finished (get_finished's first set) over a few steps."""
    got = w.take_finished_saves(finished)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        got |= w.take_finished_saves(set())
    return got
