"""The server's own lease owners (the L2 controllers), and how long their leases may live."""

from __future__ import annotations

from kvdepot.types import ClientId

STORE_OWNER = ClientId(b"\x00kvdepot-l2-store")
PREFETCH_OWNER = ClientId(b"\x00kvdepot-l2-prefetch")
BACKGROUND_LEASE_TTL_S = 600.0  # L2 I/O has its own timeouts; this only bounds a stuck backend
