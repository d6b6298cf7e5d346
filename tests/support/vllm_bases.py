"""vLLM's two connector metadata base classes, for a GPU machine that has torch with CUDA and no vLLM.

The worker half of kvdepot's vLLM connector imports nothing of vLLM at module level but the two base
classes its step metadata subclasses (``KVConnectorMetadata`` and ``KVConnectorWorkerMetadata``: empty
abstract markers in vLLM). Where vLLM is missing, ``stand_in`` puts classes of the same names and shape
under vLLM's module path, so the connector's worker half can be driven on CUDA against a real server
(``tests/e2e/test_connector_device.py`` under ``scripts/test-gpu.sh --connector``); ``remove`` takes them away again.
Nothing else of vLLM is stood in: a test that needs more of it still skips or fails.
"""

from __future__ import annotations

import abc
import importlib.util
import sys
import types

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


class KVConnectorMetadata(abc.ABC):  # noqa: B024 (vLLM's is an empty marker too)
    """Scheduler half -> worker half, as vLLM declares it."""


class KVConnectorWorkerMetadata(abc.ABC):
    """Worker half -> scheduler half, as vLLM declares it."""

    @abc.abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata: ...


def vllm_installed() -> bool:
    module = sys.modules.get("vllm")
    if module is not None:
        return getattr(module, "__file__", None) is not None  # a stand-in has no file
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module without a spec
        return False


def stand_in() -> list[str]:
    """Put the two classes at vLLM's path (vLLM must not be installed); the module names it added."""
    if vllm_installed():
        raise RuntimeError("vLLM is installed: use it, not a stand-in")
    parts = BASE.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            module = types.ModuleType(name, "kvdepot's test stand-in for vLLM's connector metadata bases")
            module.__path__ = []  # a package, so the next level imports under it
            sys.modules[name] = module
            added.append(name)
    base = sys.modules[BASE]
    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    return added


def remove(added: list[str]) -> None:
    for name in reversed(added):
        sys.modules.pop(name, None)
    for name in [m for m in sys.modules if m.startswith("kvdepot.connectors.vllm")]:
        sys.modules.pop(name)  # they hold the stand-in classes: a later import under real vLLM starts afresh
