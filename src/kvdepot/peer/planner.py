"""Pull or recompute: is reading these pages from their nodes faster than computing them again?

What no peer system ships (an L3 hit slower than recompute is a loss its users met: llm-d-router #1929,
#2443; SGLang #26305). For each node read from, the node keeps a moving estimate of that peer's
bandwidth (bytes over seconds of past reads) and of its round trip (control calls); a batch's pull is
estimated as its bytes over that bandwidth plus one round trip per node. The caller says what
recomputing would cost (its tokens over the engine's measured prefill rate). Pull only when it wins;
with no estimate yet, pull (and so learn one). Every decision is counted with its reason.

Only reads that completed are samples (one cut short by its deadline or a failure measures the wait,
not the bandwidth). An estimate ages: one without a new sample for ``STALE_S`` counts as none, so a
pull goes through as a probe and its sample starts the estimate afresh. Otherwise one bad estimate
refused every pull, and with no pulls there were no samples to correct it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import Enum

EWMA_WEIGHT = 0.2  # of each new sample
MIN_SAMPLE_BYTES = 256 << 10  # reads smaller than this say more about latency than bandwidth
STALE_S = 30.0  # a bandwidth estimate with no sample this long is none: the next pull probes


class Reason(Enum):
    FASTER = "pull_faster"  # the estimate beats recomputing
    NO_ESTIMATE = "no_estimate"  # nothing measured for one of the peers yet, or not lately: pull, and learn
    SLOWER = "pull_slower"  # recomputing is faster: skipped


@dataclass(frozen=True, slots=True)
class Decision:
    pull: bool
    reason: Reason
    pull_s: float  # the estimate (0 when none)
    recompute_s: float


class _Ewma:
    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0  # when the last sample came (monotonic)

    def add(self, sample: float, now: float) -> None:
        """A sample after ``STALE_S`` without one replaces the estimate: the old one says little now."""
        fresh = self.value == 0.0 or not self.current(now)
        self.value = sample if fresh else (1 - EWMA_WEIGHT) * self.value + EWMA_WEIGHT * sample
        self.at = now

    def current(self, now: float) -> bool:
        return self.value > 0 and now - self.at <= STALE_S


class PullPlanner:
    def __init__(self) -> None:
        self._bandwidth: dict[str, _Ewma] = {}  # bytes per second, per peer
        self._rtt: dict[str, _Ewma] = {}  # seconds, per peer
        self._lock = threading.Lock()

    def read_measured(self, node: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``node`` that completed (every page arrived) in ``seconds``."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        with self._lock:
            self._bandwidth.setdefault(node, _Ewma()).add(nbytes / seconds, time.monotonic())

    def call_measured(self, node: str, seconds: float) -> None:
        with self._lock:
            self._rtt.setdefault(node, _Ewma()).add(seconds, time.monotonic())

    def forget(self, node: str) -> None:
        """``node`` left the cluster: its estimates go (a restarted pod comes back under a new address,
        so a long-lived node would otherwise keep one per node it ever read from)."""
        with self._lock:
            self._bandwidth.pop(node, None)
            self._rtt.pop(node, None)

    def estimate(self, bytes_by_node: dict[str, int]) -> float | None:
        """Seconds to pull these bytes from these nodes (None: a node has no current bandwidth estimate:
        none yet, or none sampled for ``STALE_S``)."""
        total = 0.0
        now = time.monotonic()
        with self._lock:
            for node, nbytes in bytes_by_node.items():
                bw = self._bandwidth.get(node)
                if bw is None or not bw.current(now):
                    return None
                rtt = self._rtt.get(node)
                total += nbytes / bw.value + (rtt.value if rtt is not None else 0.0)
        return total

    def decide(self, bytes_by_node: dict[str, int], recompute_s: float) -> Decision:
        pull_s = self.estimate(bytes_by_node)
        if pull_s is None:
            return Decision(True, Reason.NO_ESTIMATE, 0.0, recompute_s)
        if pull_s <= recompute_s:
            return Decision(True, Reason.FASTER, pull_s, recompute_s)
        return Decision(False, Reason.SLOWER, pull_s, recompute_s)

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            nodes = set(self._bandwidth) | set(self._rtt)
            return {n: {"bandwidth_bytes_per_s": self._bandwidth[n].value if n in self._bandwidth else 0.0,
                        "rtt_s": self._rtt[n].value if n in self._rtt else 0.0} for n in sorted(nodes)}  # fmt: skip
