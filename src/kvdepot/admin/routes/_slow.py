"""Endpoints that may wait long (a clear or delete waits up to 30 s per tier, a prefetch up to its
``wait_s``) run on a few threads of their own, not on the pool every other endpoint shares: forty
warm-up calls against a slow tier would otherwise hold all of that pool, and ``/healthcheck`` would
queue behind them until a liveness probe restarted the server."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

SLOW_CALL_THREADS = 8  # more slow calls wait for one of these (on the event loop, holding no thread)

T = TypeVar("T")
_limiter: anyio.CapacityLimiter | None = None


async def run_slow(work: Callable[[], T]) -> T:
    global _limiter
    if _limiter is None:  # made on the event loop's thread, as anyio wants
        _limiter = anyio.CapacityLimiter(SLOW_CALL_THREADS)
    return await anyio.to_thread.run_sync(work, limiter=_limiter)
