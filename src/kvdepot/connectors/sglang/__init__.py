"""kvdepot as SGLang HiCache's storage backend (L3), loaded by SGLang's own dynamic loader:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvdepot",
        "module_path": "kvdepot.connectors.sglang", "class_name": "KVDepotHiCacheStorage",
        "interface_v1": 1, "url": "tcp://127.0.0.1:5555"}'

The backend class imports SGLang, so it is loaded on first use (SGLang's loader asks for it by name);
``settings`` and ``pages`` import without SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdepot.connectors.sglang.backend import KVDepotHiCacheStorage, page_hash

__all__ = ["KVDepotHiCacheStorage", "page_hash"]


def __getattr__(name: str):
    if name in __all__:
        from kvdepot.connectors.sglang import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
