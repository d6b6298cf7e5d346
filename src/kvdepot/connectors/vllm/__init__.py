"""kvdepot's vLLM integration: ``KVDepotConnector`` (see ``connector``).

vLLM loads it by name from this module::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "tcp://127.0.0.1:5555"}}'
"""

from kvdepot.connectors.vllm.connector import KVDepotConnector

__all__ = ["KVDepotConnector"]
