"""The tier's transfer threads: vLLM's scheduler hands a job over and returns at once; a thread moves the
bytes; the scheduler collects the outcome on a later step.

Two ``JobQueue``s, one for loads (promotions into vLLM's CPU tier, which a request waits for) and one
for stores (cascades out of it, which nobody waits for), so a backlog of stores never delays a load.
Each queue has one thread, started with its first job (never in a constructor). Both report into one
``Completions``: the outcomes in the order jobs ended, each taken once, and the count of jobs not yet
ended, which ``wait_idle`` waits on (vLLM's ``drain_jobs``: after it, no thread touches vLLM's memory).
At shutdown the jobs not started yet end without running, as failures (vLLM allows it); a running one
always finishes.

A job is a callable returning ``(done, nbytes)``: how many of its keys it moved (a leading run) and how
many bytes. One that raises moved nothing; the error is logged, never raised into vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Work = Callable[[], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one job ended: ``done`` of its ``total`` keys moved (the leading ones), in ``seconds``."""

    job_id: int
    done: int
    total: int
    nbytes: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.done == self.total


class Completions:
    """Outcomes of ended jobs and the count of jobs not yet ended. Thread-safe."""

    def __init__(self) -> None:
        self._ended: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._open = 0

    def __repr__(self) -> str:
        return f"Completions(open={self._open})"

    @property
    def open(self) -> int:
        return self._open

    def opened(self) -> None:
        with self._cond:
            self._open += 1

    def ended(self, outcome: Outcome) -> None:
        self._ended.put(outcome)  # before the count drops: wait_idle's caller finds every outcome
        with self._cond:
            self._open -= 1
            if self._open == 0:
                self._cond.notify_all()

    def take(self) -> list[Outcome]:
        """Every outcome not taken yet (each is handed out once)."""
        out = []
        while True:
            try:
                out.append(self._ended.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every job handed over has ended; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._open == 0, timeout_s)


class JobQueue:
    """Jobs run one at a time, in the order given, on one thread of their own."""

    def __init__(self, name: str, completions: Completions) -> None:
        self.name = name
        self._completions = completions
        self._jobs: queue.SimpleQueue[tuple[int, int, Work] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._cancelled = False  # close(cancel=True): jobs not started end without running

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._thread is not None else "idle"
        return f"JobQueue({self.name!r}, {state})"

    def submit(self, job_id: int, total: int, work: Work) -> None:
        """Hand ``work`` (for ``total`` keys) over; never blocks. After ``close`` it ends at once, with
        nothing moved."""
        self._completions.opened()
        with self._lock:
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"kvdepot-{self.name}", daemon=True)
                    self._thread.start()
                self._jobs.put((job_id, total, work))
                return
        self._completions.ended(Outcome(job_id, 0, total, 0, 0.0))

    def close(self, timeout_s: float | None = None, cancel: bool = False) -> bool:
        """Stop the thread once the jobs handed over have ended: run (or, with ``cancel``, ended without
        running: a job already running always finishes, since it may be writing vLLM's memory).
        True once the thread has ended (no job of this queue runs any more); False if ``timeout_s``
        passed first. Idempotent."""
        with self._lock:
            self._closed = True
            self._cancelled = self._cancelled or cancel
            thread = self._thread
        if thread is None:
            return True
        self._jobs.put(None)
        thread.join(timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job_id, total, work = item
            t0 = time.perf_counter()
            try:
                done, nbytes = (0, 0) if self._cancelled else work()
            except Exception:  # noqa: BLE001 - a failed transfer is a miss, never an error in vLLM
                log.exception("kvdepot tier: %s job %d failed", self.name, job_id)
                done, nbytes = 0, 0
            self._completions.ended(Outcome(job_id, max(0, min(done, total)), total, nbytes, time.perf_counter() - t0))
