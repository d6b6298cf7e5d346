"""The vLLM connector's settings, read from ``kv_connector_extra_config``: the connectors' common
settings (``ClientSettings``) and vLLM's own, in one constrained struct; defaults here only."""

from __future__ import annotations

from typing import Annotated

from kvdepot.config import ConfigError, option
from kvdepot.connectors.common import ClientSettings
from kvdepot.connectors.vllm.paged_layout import CpuKVLayout

DEFAULT_CHUNK_TOKENS = 256


class ConnectorConfig(ClientSettings, frozen=True, kw_only=True):
    load_async: Annotated[
        bool,
        option("load hits between scheduler steps (the request waits in WAITING_FOR_REMOTE_KVS) instead of in the step that computes the rest"),
    ] = False
    layerwise: Annotated[
        bool, option("synchronous loads go layer by layer on a helper thread: layer N+1 loads while layer N computes")
    ] = False
    async_saves: Annotated[
        bool,
        option("saves run on a saver thread while the next step computes; vLLM frees a finished request's blocks once its saves have read them"),
    ] = True
    async_save_limit: Annotated[
        int, option("saves handed to the saver thread and not yet run, at most; a step past it waits for room", ge=1)
    ] = 32
    copy_threads: Annotated[
        int,
        option("threads copying a synchronous load into vLLM's blocks while the engine waits for it (0: one per usable core, at most 4)",
               ge=0, le=64),
    ] = 0  # fmt: skip
    layerwise_saves: Annotated[
        bool, option("with async_saves: a step's saves are handed over by the forward's first layer and copy layer N while layer N+1 computes")
    ] = False
    hash_cache: Annotated[
        bool, option("reuse kvdepot's chunk hashes of prefixes this engine saw before, keyed by vLLM's own sha256 prefix hashes")
    ] = True
    save_decode: Annotated[bool, option("also store chunks that generated tokens complete, not only prompt chunks")] = True
    kv_events_token_ids: Annotated[
        bool, option("send each saved chunk's token ids, so the server's KV events name them (for routers that hash tokens themselves)")
    ] = False
    prefetch_timeout_s: Annotated[
        float, option("how long a request may wait for the server's L2 prefetch before it is served without the hit", gt=0)
    ] = 30.0
    cpu_kv_layout: Annotated[
        CpuKVLayout,
        option("vLLM on CPU: native (vLLM's own block layout, copies at memcpy speed) or shared (per-token K/V that SGLang reads too)"),
    ] = CpuKVLayout.NATIVE
    staging_mb: Annotated[
        int, option("vLLM on a GPU, shm and inline paths: the worker's device staging in MiB, half for saves and half for loads (at least one chunk each)", ge=1, le=1 << 20)
    ] = 256
    pin_arena: Annotated[
        bool, option("vLLM on a GPU, shm path: pin this process's mapping of the arena (cudaHostRegister), so copies into it are DMA")
    ] = True
    debug_load_delay_s: Annotated[float, option("for tests: sleep this long inside every load, holding its locks", ge=0)] = 0.0
    debug_save_delay_s: Annotated[
        float, option("for tests: sleep this long before every save reads its blocks (on the saver thread with async_saves)", ge=0)
    ] = 0.0
    debug_dump_dir: Annotated[
        str, option("for tests: write what each step's loads left in vLLM's paged cache (and what saves stored) here")
    ] = ""

    def _check_together(self) -> None:
        super()._check_together()
        if self.layerwise_saves and not self.async_saves:
            raise ConfigError("layerwise_saves needs async_saves (a layer is copied on the saver thread while the next computes)")

    def chunk_tokens(self, block_size: int) -> int:
        size = self.chunk_size or -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
        if size % block_size:
            raise ValueError(f"chunk_size {size} is not a multiple of vLLM's block size {block_size}")
        return size
