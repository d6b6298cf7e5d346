"""The SGLang backend's settings, from ``--hicache-storage-backend-extra-config``: the connectors' common
settings (``ClientSettings``), the keys SGLang's own loader reads from the same JSON, and SGLang's own."""

from __future__ import annotations

from typing import Annotated, Any

from kvdepot.config import option
from kvdepot.connectors.common import ClientSettings

# Keys SGLang adds to every backend's extra-config itself: ``file_storage_path`` (its ``--file-storage-path``,
# the file backend's folder; ``unified_radix_cache``). Not the user's and nothing to kvdepot: dropped, so
# that they never stop SGLang's start as unknown keys.
SGLANG_ADDED_KEYS = frozenset({"file_storage_path"})


def without_sglang_keys(extra: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (extra or {}).items() if k not in SGLANG_ADDED_KEYS}


class SGLangSettings(ClientSettings, frozen=True, kw_only=True):
    # Read by SGLang itself (its dynamic loader and HiCacheController), accepted here so that the one
    # JSON object can carry them.
    backend_name: Annotated[str, option("SGLang's name for the backend (its dynamic loader reads it)")] = "kvdepot"
    module_path: Annotated[str, option("for SGLang's dynamic loader: kvdepot.connectors.sglang")] = "kvdepot.connectors.sglang"
    class_name: Annotated[str, option("for SGLang's dynamic loader: KVDepotHiCacheStorage")] = "KVDepotHiCacheStorage"
    interface_v1: Annotated[
        int, option("1: SGLang calls batch_get_v1/batch_set_v1 with host-pool indices (the one-copy path); 0: flat page tensors", ge=0, le=1)
    ] = 0
    prefetch_threshold: Annotated[int, option("SGLang's: the fewest uncached tokens worth an L3 lookup", ge=0)] = 256
    # (SGLang takes these two out of the JSON before the backend sees it; accepted for one that does not.)
    prefetch_timeout_base: Annotated[float, option("SGLang's: its prefetch budget's fixed part, s (1)", ge=0)] | None = None
    prefetch_timeout_per_ki_token: Annotated[float, option("SGLang's: its prefetch budget per 1,024 tokens, s (0.25)", ge=0)] | None = None
    # The most any call may take. A lookup or load is also held inside SGLang's own prefetch budget
    # (``runtime.SGLangRuntime``: 1 s + 0.25 s per 1,024 tokens by default): a slow kvdepot is a miss in time.
    timeout_s: Annotated[float, option("the most one request to the server may take (lookups and loads: also budget_share)", gt=0)] = 2.0
    budget_share: Annotated[
        float,
        option("the share of SGLang's prefetch budget (policy timeout) one lookup or load may use before it is a miss", gt=0, le=1),
    ] = 0.4

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, what: str = "kvdepot SGLang backend option") -> SGLangSettings:
        return super().from_extra(without_sglang_keys(extra), what)
