"""Device code both sides of the server-driven and the pinned paths use: a worker's paged cache as torch
tensors (``paged``), moving chunks between it and host memory through a staging buffer on one stream
(``mover``), and the memory a worker shares with the server (``memory``: CUDA IPC handles, or a
shared-memory file for a host cache).

torch is imported lazily, only by code that moves blocks: a server without torch still starts and
refuses the server-driven path with a clear error (``runtime.require_torch``). This package sits beside
``rpc``: it knows the wire's structs, never the client, the server or storage.
"""
