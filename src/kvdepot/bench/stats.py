"""Small measurement helpers: repeat, take medians, measure the physical limits in the same run."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sample:
    median: float
    low: float
    high: float
    n: int

    def fmt(self, unit: str, scale: float = 1.0, digits: int = 2) -> str:
        return f"{self.median * scale:.{digits}f} {unit} ({self.low * scale:.{digits}f}-{self.high * scale:.{digits}f})"


def sample(values: list[float]) -> Sample:
    return Sample(statistics.median(values), min(values), max(values), len(values))


def timed(fn: Callable[[], object], reps: int, warmup: int = 1, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` runs after ``warmup`` runs; ``setup`` runs untimed before each."""
    out = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def gbps(nbytes: int, seconds: list[float]) -> Sample:
    return sample([nbytes / s / 1e9 for s in seconds])


def memcpy_gbps(object_bytes: int, count: int, reps: int) -> Sample:
    """Single-thread np.copyto of ``count`` distinct objects of ``object_bytes`` (as a transfer does)."""
    src = [np.full(object_bytes, 1, dtype=np.uint8) for _ in range(count)]
    dst = [np.full(object_bytes, 2, dtype=np.uint8) for _ in range(count)]

    def run() -> None:
        for s, d in zip(src, dst):
            np.copyto(d, s)

    return gbps(object_bytes * count, timed(run, reps, warmup=2))


def memcpy_gbps_threads(object_bytes: int, count: int, reps: int, threads: int) -> Sample:
    """Aggregate GB/s of ``threads`` threads each copying its own ``count`` objects of ``object_bytes``
    at once (np.copyto lets go of the GIL): the limit of that many processes copying side by side, as
    many clients of one server do. One thread is ``memcpy_gbps``."""
    if threads <= 1:
        return memcpy_gbps(object_bytes, count, reps)
    import threading

    bufs = [([np.full(object_bytes, 1, dtype=np.uint8) for _ in range(count)],
             [np.full(object_bytes, 2, dtype=np.uint8) for _ in range(count)]) for _ in range(threads)]  # fmt: skip
    go, done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
    stop: list[bool] = []

    def worker(src: list[np.ndarray], dst: list[np.ndarray]) -> None:
        while True:
            go.wait()
            if stop:
                return
            for s, d in zip(src, dst):
                np.copyto(d, s)
            done.wait()

    workers = [threading.Thread(target=worker, args=b, daemon=True) for b in bufs]
    for t in workers:
        t.start()

    def run() -> None:
        go.wait()
        done.wait()

    try:
        return gbps(object_bytes * count * threads, timed(run, reps, warmup=2))
    finally:
        stop.append(True)
        go.wait()
        for t in workers:
            t.join()


def memcpy_seconds(nbytes: int, repeats: int = 7) -> float:
    """How long one single-threaded copy of ``nbytes`` takes at this machine's memory bandwidth (the
    floor of any read of them): the median over ``repeats`` copies of at least 128 MiB between touched
    buffers, scaled to ``nbytes``, so a small size does not get the speed of a copy that stays in the
    CPU's caches (a hit's KV was written long before it is read)."""
    size = max(nbytes, 128 << 20)
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.ones_like(src)
    return statistics.median(timed(lambda: np.copyto(dst, src), repeats, warmup=0)) * nbytes / size


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
