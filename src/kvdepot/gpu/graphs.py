"""A mover's per-layer kernels, captured as CUDA graphs: one launch a piece instead of one per layer.

A cache whose layers were allocated apart (vLLM allocates each layer's cache on its own) is gathered and
scattered with one indexing kernel per layer (``DevicePagedCache``). Measured on an H200, launching those
from Python costs about 20 µs each, so a 32-layer model spends more host time launching a piece's
kernels than the copy engine spends moving it, and the copies wait for the host. A graph of a piece's
kernels is replayed with one launch.

A graph is bound to the memory it was captured over, so each one is captured for a staging slot and a
piece length (``(direction, slot, chunks)``), over that slot's part of a static index buffer: a replay
first copies the piece's block ids there (on the stream the replay runs on, so in order), then launches
the graph. There are at most a few dozen keys for a mover (its slots times its piece lengths).

Only the plain shapes are captured: a whole-piece gather, and a scatter of a whole piece into every
layer. A scatter that skips blocks inside the piece, or the last piece of a layer-by-layer load (an
event after each layer), runs the kernels one by one as before.

States of a ``PieceGraphs``::

    cold --(first piece each way: eager, loads the kernels)--> warm --(a new key: capture, then replay)--> warm
      any state --(a capture or replay raises)--> off (eager for good, said once in the log)

``KVDEPOT_CUDA_GRAPHS=0`` in the environment keeps every mover eager (an escape hatch for a driver that
misbehaves; the default is on).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


def graphs_enabled() -> bool:
    """The environment's word (``KVDEPOT_CUDA_GRAPHS``: 0, off, false or no turn graphs off)."""
    return os.environ.get("KVDEPOT_CUDA_GRAPHS", "1").strip().lower() not in ("0", "off", "false", "no")


class PieceGraphs:
    """The graphs of one mover: ``cache`` (a ``DevicePagedCache`` on a CUDA device), the mover's
    ``staging`` buffer ``[slots, K, L, T, H, D]``, and its ``blocks_per_chunk``. Called by the mover
    under its lock, inside its kernel stream's context."""

    def __init__(self, cache, staging, blocks_per_chunk: int) -> None:
        self.torch = torch = cache.torch
        self.cache = cache
        self.staging = staging
        self.bpc = blocks_per_chunk
        self.ids = torch.zeros((cache.num_groups, staging.shape[0] * blocks_per_chunk), dtype=torch.int64, device=cache.device)
        self.capture_stream = torch.cuda.Stream(cache.device)
        self.graphs: dict[tuple[str, int, int], object] = {}
        self.warm: set[str] = set()
        self.on = True
        self.replays = 0  # pieces moved by a replay (tests and benchmarks read it)

    def __repr__(self) -> str:
        return f"PieceGraphs({len(self.graphs)} captured, {self.replays} replays, {'on' if self.on else 'off'})"

    def close(self) -> None:
        self.graphs.clear()
        self.on = False

    def gather(self, at: int, n: int, ids: Sequence) -> bool:
        """Gather ``n`` chunks (``ids``: per group, their block ids on the device) into staging slots
        ``at..at+n`` by a replay: True, or False where the caller runs the kernels itself."""
        return self._replay("gather", at, n, ids, lambda static: self.cache.gather(static, self.staging[at : at + n]))

    def scatter(self, at: int, n: int, ids: Sequence) -> bool:
        """Scatter staging slots ``at..at+n`` into every layer of ``n`` chunks' blocks (nothing skipped)."""
        self.cache.check_write_mode()  # the refusal eager scatters make, at every replay too
        return self._replay("scatter", at, n, ids, lambda static: self.cache.scatter(self.staging[at : at + n], static, 0))

    def _replay(self, direction: str, at: int, n: int, ids: Sequence, kernels: Callable[[list], None]) -> bool:
        if not self.on:
            return False
        if direction not in self.warm:  # the first piece each way runs eagerly: the kernels are loaded before any capture
            self.warm.add(direction)
            return False
        start, end = at * self.bpc, (at + n) * self.bpc
        static = [self.ids[g, start:end] for g in range(self.cache.num_groups)]
        key = (direction, at, n)
        try:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(lambda: kernels(static))
            for g, piece in enumerate(ids):
                static[g].copy_(piece.reshape(-1), non_blocking=True)
            graph.replay()
        except Exception as exc:  # a capture the driver or this torch refuses: eager from now on
            self.graphs.pop(key, None)
            self.on = False
            log.warning("kvdepot: CUDA graphs off for %r (%s: %s); its pieces launch one kernel per layer", self.cache, type(exc).__name__, exc)
            return False
        self.replays += 1
        return True

    def _capture(self, kernels: Callable[[], None]):
        """A graph of what ``kernels`` launches (nothing runs now). Captured on a stream of its own, in
        thread-local mode: the engine's threads keep launching their own work meanwhile."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.capture_stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                kernels()
            finally:
                graph.capture_end()
        return graph
