"""``KVDepotConnector``: kvdepot as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(kv_connector="KVDepotConnector", kv_connector_module_path="kvdepot.connectors.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"url": "tcp://127.0.0.1:5555"})

or the same JSON as ``--kv-transfer-config`` of vLLM's OpenAI server. Options: ``ConnectorConfig``.
Add ``"kv_load_failure_policy": "recompute"`` to have vLLM recompute chunks that vanished between
lookup and load (evicted after a lock expired, server gone) rather than fail those requests.

vLLM builds one instance per role. The scheduler's (in the engine-core process) answers lookups and
plans loads and saves (``scheduler.SchedulerSide``); each worker's moves the bytes
(``worker.WorkerSide``). The hooks map onto kvdepot as follows:

=================================  ====================================================================
vLLM hook                          kvdepot
=================================  ====================================================================
get_num_new_matched_tokens         LOOKUP with the request id as session (locks the hit; None while the
                                   server prefetches from L2, then QUERY_PREFETCH_STATUS)
update_state_after_alloc           plan the load; FREE_LOOKUP_LOCKS for chunks vLLM has itself
build_connector_meta               this step's loads and the saves of the chunks it completes
update_connector_output            FREE_LOOKUP_LOCKS of loads the workers finished
request_finished                   END_SESSION; with async saves pending, its blocks wait for them
register_kv_caches                 probe the cache layout; REGISTER the worker's context
start_load_kv / wait_for_layer_..  PREPARE_RETRIEVE, scatter into the blocks, COMMIT_RETRIEVE
wait_for_save                      PREPARE_STORE, gather into the slots, COMMIT_STORE (on the saver
                                   thread with async_saves: the step does not wait)
save_kv_layer                      layerwise_saves: the saver gathers this layer while the next computes
handle_preemptions                 let pending saves read preempted requests' blocks first
get_finished / ..._load_errors     finished requests whose saves ran; asynchronous loads done;
                                   blocks that could not be loaded
=================================  ====================================================================
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot.connectors.common import ensure_logging
from kvdepot.connectors.vllm.config import ConnectorConfig
from kvdepot.connectors.vllm.hash_cache import SAFE_VLLM_HASHES, ChunkHashCache
from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata
from kvdepot.connectors.vllm.paged_layout import cache_dtype_tag, choose_format, make_layout, probe_cpu_layout
from kvdepot.connectors.vllm.scheduler import SchedulerSide
from kvdepot.connectors.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVDepotConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST  # kvdepot's L1 is host memory

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ensure_logging()  # vLLM handles only its own logger: each request's hit line would be lost
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        model_config = vllm_config.model_config
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if not (on_cpu or current_platform.is_cuda()):
            raise NotImplementedError(f"kvdepot's vLLM connector runs on vLLM's CPU backend and on NVIDIA GPUs, not {current_platform.device_name}")
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("kvdepot's vLLM connector does not support pipeline parallelism yet")
        if model_config is not None and model_config.use_mla:
            raise NotImplementedError(
                "kvdepot's vLLM connector does not support MLA models yet (their cache is one latent tensor per layer, with no K/V "
                "split, which kvdepot's chunks do not describe): serve this model without the connector"
            )
        block_size = vllm_config.cache_config.block_size
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        # Both halves name chunks alike: the model, and how a quantized cache encodes them.
        model = (self.config.model_name or (model_config.model if model_config is not None else "")) + cache_dtype_tag(
            cache_dtype, getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", ()) or ()
        )
        tp = parallel.tensor_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if kv_cache_config is None:
                raise ValueError("the kvdepot scheduler connector needs vLLM's kv_cache_config")
            groups = kv_cache_config.kv_cache_groups
            if len(groups) != 1:
                raise NotImplementedError(f"kvdepot supports one KV cache group, got {len(groups)}")
            spec = groups[0].kv_cache_spec
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            if not isinstance(spec, FullAttentionSpec):
                # A model whose every layer slides: vLLM frees a running request's blocks that leave the
                # window, while an asynchronous save may still read them, and prefix hits hold null blocks.
                # (A model that mixes window and full layers arrives here as full attention: this connector
                # does not take vLLM's hybrid KV-cache manager, so vLLM allocates every layer that way.)
                raise NotImplementedError(
                    f"kvdepot's vLLM connector supports models with full-attention layers (alone, or mixed with sliding-window "
                    f"ones); this model's KV cache is {type(spec).__name__} in every layer: serve it without the connector"
                )
            # On a GPU the cache is per-token K/V already: chunks keep the shared layout and the plain model id
            # (the worker decides the same, from the tensors it is given).
            suffix = ""
            if on_cpu:
                suffix = choose_format(probe_cpu_layout(str(spec.dtype), block_size, spec.head_size, cache_dtype), self.config.cpu_kv_layout).model_suffix
            layout = make_layout(len(groups[0].layer_names), spec.num_kv_heads, spec.head_size, spec.dtype)
            cache = _hash_cache(self.config, vllm_config, kv_cache_config, block_size)
            self._scheduler = SchedulerSide(self.config, model + suffix, layout, block_size, world_size=tp, hash_cache=cache)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(self.config, model, block_size, cache_dtype, get_tensor_model_parallel_rank(), tp)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads make the forward wait per layer (``wait_for_layer_load``); a full CUDA
        graph's replay skips that Python call, and attention would read blocks still being loaded."""
        return ConnectorConfig.from_extra(extra_config or {}).layerwise

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a future miss, nothing more

    def __repr__(self) -> str:
        return f"KVDepotConnector({self._scheduler or self._worker!r})"

    # --- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDepotConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self._worker is not None:
            meta = self._connector_metadata  # (vLLM calls this hook only while the step's is bound)
            step = meta if isinstance(meta, KVDepotConnectorMetadata) else None
            self._worker.save_kv_layer(layer_name, step)  # layerwise_saves: this layer's part may go now

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVDepotConnectorMetadata)
        self._worker.wait_for_save(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVDepotConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.take_finished_saves(finished_req_ids) or None, self._worker.take_finished_async() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)


def _hash_cache(config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, block_size: int) -> ChunkHashCache | None:
    """The scheduler's map from vLLM's prefix hashes to kvdepot's, where vLLM's are sha256 (else None)."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    if not config.hash_cache or algo not in SAFE_VLLM_HASHES:
        if config.hash_cache:
            log.info("kvdepot: vLLM's prefix hashes are %r, not sha256: every prompt is hashed afresh", algo)
        return None
    try:  # the granularity of request.block_hashes, as vLLM's engine core resolves it
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        _, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    except Exception as exc:
        log.info("kvdepot: vLLM's prefix hash granularity is unknown (%s): every prompt is hashed afresh", exc)
        return None
    chunk = config.chunk_tokens(block_size)
    if not hash_block or chunk % hash_block:
        return None
    return ChunkHashCache(chunk, hash_block)
