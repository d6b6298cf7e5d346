"""kvdepot as a secondary tier of vLLM's native KV offloading (``KVDepotTier``, see ``tier``).

vLLM loads it by class name from this module, as an out-of-tree tier of ``TieringOffloadingSpec``::

    --kv-offloading-backend native --kv-offloading-size 8
    --kv-transfer-config '{"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": "KVDepotTier", "module_path": "kvdepot.connectors.vllm_tier",
                             "url": "tcp://127.0.0.1:5555"}]}}'

The tier class imports vLLM, so it is loaded on first use; ``config``, ``identity`` and ``transfers``
import without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdepot.connectors.vllm_tier.tier import KVDepotTier

__all__ = ["KVDepotTier"]


def __getattr__(name: str):
    if name == "KVDepotTier":  # vLLM's tier factory looks the class up by name on this module
        from kvdepot.connectors.vllm_tier.tier import KVDepotTier

        return KVDepotTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
