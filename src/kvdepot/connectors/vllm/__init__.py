"""kvdepot's vLLM integration: ``KVDepotConnector`` (see ``connector``).

vLLM loads it by name from this module::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "tcp://127.0.0.1:5555"}}'

The connector (and vLLM with it) is imported on first use, so the parts that need no vLLM (the
scheduler's request state machine, the settings) import without it.
"""

from __future__ import annotations

__all__ = ["KVDepotConnector"]


def __getattr__(name: str):
    if name == "KVDepotConnector":  # vLLM looks the class up by name on this module
        from kvdepot.connectors.vllm.connector import KVDepotConnector

        return KVDepotConnector
    raise AttributeError(name)
