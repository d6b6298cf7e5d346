"""``Lifecycle.prefetch`` (``POST /cache/prefetch``): its ``wait_s`` bounds the whole wait."""

from __future__ import annotations

import threading

from kvdepot.keys import NamespaceSpec
from kvdepot.server.lifecycle import Lifecycle, Target
from kvdepot.types import ObjectKey


class _StaggeredTier:
    """A storage whose prefetches finish one after another, ``step_s`` apart (a slow tier serving a
    tensor-parallel model's ranks in turn)."""

    tier_count = 1

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.started = 0
        self.timers: list[threading.Timer] = []

    def lookup(self, keys) -> int:
        return 0

    def prefetch(self, keys, hits, chunk_bytes, salt, on_done) -> bool:
        self.started += 1
        timer = threading.Timer(self.started * self.step_s, on_done, args=(None,))
        timer.start()
        self.timers.append(timer)
        return True


def test_a_prefetch_of_several_ranks_waits_at_most_wait_s_in_all():
    """Each rank's prefetch was waited for up to ``wait_s`` after the one before it had finished: with
    prefetches finishing one after another, the request waited up to a rank count times ``wait_s``
    (an HTTP client with a timeout of ``wait_s`` gave up) and said "complete" although ``wait_s`` had
    passed with ranks still on their way."""
    tier = _StaggeredTier(step_s=0.4)
    targets = [Target(NamespaceSpec("m", 4, rank, "f16", 16), 4096, [ObjectKey(bytes([rank]) * 40)]) for rank in range(4)]
    try:
        out = Lifecycle(tier, None).prefetch(targets, "", wait_s=0.6)  # type: ignore[arg-type]
        # By 0.6 s only the first rank's prefetch (0.4 s) had finished; the second ends at 0.8 s.
        assert out["complete"] is False, out
    finally:
        for timer in tier.timers:
            timer.cancel()
