"""The SGLang backend's settings, from ``--hicache-storage-backend-extra-config``: the connectors' common
settings (``ClientSettings``), the keys SGLang's own loader reads from the same JSON, and SGLang's own."""

from __future__ import annotations

from typing import Annotated

from kvdepot.config import option
from kvdepot.connectors.common import ClientSettings


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
    # Below SGLang's own prefetch timeout (2 s + 0.1 s per 1,024 tokens): a slow kvdepot is a miss, in time.
    timeout_s: Annotated[float, option("deadline of one request to the server", gt=0)] = 2.0
