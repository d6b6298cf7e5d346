"""Limits both ends of the wire agree on, and that the server's configuration bounds (one source each)."""

from __future__ import annotations

MAX_FRAME_BYTES = 16 << 20
"""Payload frames are at most this large by default (glibc stops reusing heap for blocks >= 32 MiB);
``--max-frame-mib`` may lower or raise it, and every frame limit check reads the configured value."""

MAX_CHUNK_TOKENS = 1 << 16
"""The largest chunk a context may register (and ``--chunk-size`` may set)."""

MAX_KEYS = 1 << 16
"""The most chunk keys (or leases to renew) one request may name."""
