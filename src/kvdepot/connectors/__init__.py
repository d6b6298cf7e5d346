"""Engine connectors: the code that plugs kvdepot into an inference engine.

``kvdepot.connectors.vllm`` is vLLM's (``KVConnectorBase_V1``). Each connector imports its engine, so
import only the one you use.
"""
