"""The connector's settings, read from ``kv_connector_extra_config``: one dataclass, defaults here only."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ConnectorConfig:
    url: str = "tcp://127.0.0.1:5555"
    """The kvdepot server's ZeroMQ endpoint (``tcp://`` or ``ipc://``)."""
    model_name: str = ""
    """The model part of every key; empty: vLLM's model (path or hub name). Engines share chunks only
    when they agree on it."""
    chunk_size: int = 0
    """Tokens per chunk; a multiple of vLLM's block size. 0: 256 rounded up to a multiple of it."""
    transport: str = "auto"
    """``auto`` | ``shm`` | ``inline`` (see KVClient)."""
    timeout_s: float = 5.0
    """Deadline of one request to the server (the scheduler waits this long at most per request
    before it serves uncached)."""
    load_async: bool = False
    """Load hits between scheduler steps (the request waits in WAITING_FOR_REMOTE_KVS) instead of
    inside the step that computes the rest of its prompt."""
    layerwise: bool = False
    """Synchronous loads go layer by layer on a helper thread; attention of layer N waits only for
    layer N, so layer N+1 loads while layer N computes."""
    save_decode: bool = True
    """Also store chunks that generated tokens complete, not only prompt chunks."""
    prefetch_timeout_s: float = 30.0
    """How long a request may wait for the server's L2 prefetch before it is served without the hit."""
    retry_after_s: float = 5.0
    """After a failed request, how long the scheduler leaves the server alone (requests run uncached)."""
    debug_load_delay_s: float = 0.0
    """Fault injection for tests: sleep this long inside every load, holding its locks."""
    debug_dump_dir: str = ""
    """For tests: after each step, write what that step's loads left in vLLM's paged cache to this
    directory (one ``HASH.npy`` per chunk), to compare with what was stored."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kvdepot connector option(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if isinstance(default, bool):
                if isinstance(value, str):
                    value = value.strip().lower() in ("1", "true", "yes", "on")
                values[name] = bool(value)
            elif isinstance(default, (int, float, str)):
                values[name] = type(default)(value)
        config = cls(**values)
        if config.transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {config.transport!r}")
        if config.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0, got {config.chunk_size}")
        return config

    def chunk_tokens(self, block_size: int) -> int:
        size = self.chunk_size or -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
        if size % block_size:
            raise ValueError(f"chunk_size {size} is not a multiple of vLLM's block size {block_size}")
        return size
