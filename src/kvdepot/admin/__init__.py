"""The HTTP side door: health, status, cache control (FastAPI, same process as the RPC server)."""
