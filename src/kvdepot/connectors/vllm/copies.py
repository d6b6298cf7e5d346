"""A synchronous load's copies into vLLM's blocks, spread over a few threads.

While ``start_load_kv`` copies a hit into the paged cache the engine waits and its own threads are
idle, so the chunks are copied in parallel: numpy's indexed copies let go of the GIL, and one thread
alone does not reach a server's memory bandwidth (on the 2-core development VM, two threads copy a
4k-token hit's 128 MiB into vLLM's block layout in 0.55-0.7 of one thread's time when nothing else
runs; inside a vLLM engine there, whose other processes keep both cores busy, they gain nothing
measurable). Chunks write disjoint blocks, so the threads never touch the same bytes.

vLLM on CPU pins each of its OpenMP threads to one core, the engine's main thread included, and a
thread inherits the mask of the thread that starts it: a helper left alone would share the main
thread's one core. Helpers therefore take the cores of every thread of the process (what vLLM was
given), and "one per core" counts those.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MAX_AUTO_THREADS = 4


def process_cores() -> set[int]:
    """The cores any thread of this process may run on (the union of their affinity masks)."""
    cores: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                cores |= os.sched_getaffinity(int(tid))
            except OSError:
                pass  # the thread ended meanwhile
        return cores or os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _widen_affinity(cores: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the helper keeps the mask it inherited


class ChunkCopier:
    """``each(count, copy)`` calls ``copy(i)`` for every chunk ``i`` on up to ``threads`` threads (this
    one and ``threads - 1`` helpers) and returns once all are done; the first error is raised then."""

    def __init__(self, threads: int = 0) -> None:
        cores = process_cores()
        self.threads = threads or min(MAX_AUTO_THREADS, len(cores))
        self._pool = None
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvdepot-copy", initializer=_widen_affinity, initargs=(cores,))

    def __repr__(self) -> str:
        return f"ChunkCopier(threads={self.threads})"

    def each(self, count: int, copy: Callable[[int], None]) -> None:
        groups = min(self.threads, count)
        if self._pool is None or groups < 2:
            for i in range(count):
                copy(i)
            return
        bounds = [count * g // groups for g in range(groups + 1)]

        def run(g: int) -> None:
            for i in range(bounds[g], bounds[g + 1]):
                copy(i)

        futures = [self._pool.submit(run, g) for g in range(1, groups)]
        error: BaseException | None = None
        try:
            run(0)
        except BaseException as exc:
            error = exc
        for f in futures:  # every helper is done before the caller's views and locks may end
            try:
                f.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
