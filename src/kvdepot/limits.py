"""Limits both ends of the wire agree on, and that the server's configuration bounds (one source each)."""

from __future__ import annotations

MAX_FRAME_BYTES = 16 << 20
"""Payload frames are at most this large by default (glibc stops reusing heap for blocks >= 32 MiB);
``--max-frame-mib`` may lower or raise it, and every frame limit check reads the configured value."""

MAX_CHUNK_TOKENS = 1 << 16
"""The largest chunk a context may register (and ``--chunk-size`` may set)."""

MAX_KEYS = 1 << 16
"""The most chunk keys (or leases to renew) one request may name."""

MAX_UNSENT_BYTES = 1 << 30
"""Payload bytes of one client's replies that ZeroMQ may still hold unsent (each pins the L1 objects it
sends from) before that client's next request of such a reply is refused (REPLIES_UNREAD): a client
that stops reading cannot pin the cache. A reader pipelining inline retrieves keeps ~4 x 32 MiB."""

MAX_QUEUED_REQUESTS = 8
MAX_QUEUED_BYTES = 256 << 20
"""A client with at least MAX_QUEUED_REQUESTS requests waiting for (or running on) the server's worker
threads, whose frames hold at least MAX_QUEUED_BYTES, has its next such request refused (OVERLOADED)
until they are done. ZeroMQ hands the server every request as it arrives, and each one waiting keeps its
payload in memory: a client that pipelines inline stores without waiting for replies grew the server's
memory without bound. A KVClient keeps at most 4 requests of ~32 MiB in flight, so it is never refused;
the count lets a client whose single chunk is larger than the byte limit still pipeline."""
