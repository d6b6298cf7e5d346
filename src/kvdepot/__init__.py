"""kvdepot: a standalone KV-cache server for LLM inference engines."""

__version__ = "0.1.0"

from kvdepot.client.options import ClientOptions, Transport  # noqa: E402
from kvdepot.errors import ErrorCode, KVDepotError  # noqa: E402
from kvdepot.layout import KVLayout  # noqa: E402


def __getattr__(name: str):
    # The client pulls in ZeroMQ; import it lazily so `import kvdepot` stays cheap for pure helpers.
    if name == "KVClient":
        from kvdepot.client.client import KVClient

        return KVClient
    if name == "CurveClientKeys":
        from kvdepot.rpc.security import CurveClientKeys

        return CurveClientKeys
    raise AttributeError(name)


__all__ = ["ClientOptions", "CurveClientKeys", "ErrorCode", "KVClient", "KVDepotError", "KVLayout", "Transport", "__version__"]
