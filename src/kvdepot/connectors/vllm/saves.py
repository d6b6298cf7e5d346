"""Asynchronous saves: ``wait_for_save`` hands each step's saves to one saver thread and returns, so
the next step's forward pass runs while they gather their blocks and commit. With layerwise saves
the step's job is handed over before the forward and gathers layer N as soon as ``save_kv_layer``
says its KV is written, while layer N+1 computes.

A save reads vLLM's paged blocks until its gather is done, and vLLM frees a request's blocks in two
ways; neither may happen under a save still reading them:

- the request finishes: the scheduler half answers ``request_finished`` with "free later" for every
  request it planned a save for, and this worker reports the request through ``get_finished`` once
  every save of it has run (``finished``);
- the request is preempted: vLLM calls ``handle_preemptions`` before the step that may reuse its
  blocks, and that waits until every save handed over so far has run (``drain``). Preemption is rare;
  waiting for all of them keeps the rule simple. vLLM freed its blocks itself, so no report is owed
  for those saves (``forget``); the scheduler half stops counting them too.

Per request, on this worker (a request is reported exactly once, only after its last save ran, and
only once vLLM has said it finished)::

    ──submit──► SAVING(n) ──its last save ran──► SAVED ──vLLM says finished──► reported
                   │                                 ▲
                   └──vLLM says finished──► FINISHING┘(its last save ran: reported at the next ask)

The queue is bounded (``limit`` jobs handed over and not yet run): a step that would pass it waits
for room, so a server that cannot keep up slows the engine down to synchronous saves, no further.
A job is one save, or one step's layerwise saves; it is run once, in the order handed over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveJob:
    req_ids: tuple[str, ...]  # the requests whose blocks it reads (one entry per save of each)
    run: Callable[[], None]


class SaveQueue:
    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._cond = threading.Condition()
        self._queue: deque[SaveJob] = deque()
        self._running = 0
        self._pending: dict[str, int] = {}  # SAVING / FINISHING: saves handed over and not yet run
        self._unreported: set[str] = set()  # every request with a save, until it is reported
        self._finishing: set[str] = set()  # vLLM said finished while saves were pending
        self._ready: set[str] = set()  # to report at the next ask
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvdepot-async-save", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        with self._cond:
            return f"SaveQueue(queued={len(self._queue)}, running={self._running}, requests={len(self._pending)})"

    def submit(self, req_ids: Sequence[str], run: Callable[[], None]) -> float:
        """Hand a job over: ``run`` reads the blocks of ``req_ids``. Returns the seconds spent waiting
        for room (0 unless the queue is full)."""
        job = SaveJob(tuple(req_ids), run)
        t0 = time.perf_counter()
        with self._cond:
            if self._closed:
                raise RuntimeError("the save queue is closed")
            self._cond.wait_for(lambda: len(self._queue) + self._running < self._limit)
            self._queue.append(job)
            for req_id in job.req_ids:
                self._pending[req_id] = self._pending.get(req_id, 0) + 1
                self._unreported.add(req_id)
            self._cond.notify_all()
        return time.perf_counter() - t0

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every save handed over so far has run; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout)

    def finished(self, finished_req_ids: set[str] | frozenset[str]) -> set[str]:
        """vLLM's finished requests of this step in; the requests whose blocks may now be freed out
        (each once, and only requests vLLM has said finished: this call or an earlier one)."""
        with self._cond:
            for req_id in finished_req_ids:
                if req_id not in self._unreported:
                    continue  # no save of ours: vLLM freed its blocks already
                if self._pending.get(req_id, 0):
                    self._finishing.add(req_id)
                else:
                    self._ready.add(req_id)
            out, self._ready = self._ready, set()
            self._unreported -= out
            return out

    def forget(self, req_ids: Sequence[str]) -> None:
        """Requests vLLM preempted, after ``drain``: it freed their blocks itself, and the scheduler half
        no longer counts their saves, so none of them is reported (a report of a request vLLM has
        already let go of is an error there). One with a save still pending, or that vLLM has said
        finished (it waits for the report), is kept."""
        with self._cond:
            for req_id in req_ids:
                if not self._pending.get(req_id, 0) and req_id not in self._finishing and req_id not in self._ready:
                    self._unreported.discard(req_id)

    def close(self, timeout: float) -> None:
        """Run what is queued (for up to ``timeout``), then stop the thread."""
        if not self.drain(timeout):
            log.warning("kvdepot: %r still had saves after %.0f s at shutdown; they are dropped", self, timeout)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running += 1
            try:
                job.run()
            except Exception:  # a failed save is a future miss; the request must still be reported
                log.exception("kvdepot: the save for %s failed", ", ".join(sorted(set(job.req_ids))))
            finally:
                with self._cond:
                    self._running -= 1
                    for req_id in job.req_ids:
                        left = self._pending[req_id] - 1
                        if left:
                            self._pending[req_id] = left
                            continue
                        del self._pending[req_id]
                        if req_id in self._finishing:
                            self._finishing.discard(req_id)
                            self._ready.add(req_id)
                    self._cond.notify_all()
