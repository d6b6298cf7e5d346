"""The one thread that owns the tiers' completions.

``TierDriver`` sleeps in ``poll`` on a wake-up eventfd and the tiers' eventfds, and hands every
completion to each controller's ``step`` (each ignores task ids it does not own; a tier's results can
be drained only once, so one thread must own that). No backend I/O happens on it: the adapters'
threads do that.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable, Sequence

from kvdepot.storage.l2.contract import L2Adapter, TaskResult

log = logging.getLogger(__name__)

Step = Callable[[list[tuple[int, TaskResult]]], None]  # (tier index, result) pairs


class TierDriver:
    """The one thread that drains tier completions and runs the controllers' steps."""

    def __init__(self, tiers: Sequence[L2Adapter]) -> None:
        self._tiers = list(tiers)
        self._steps: list[Step] = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, step: Step) -> None:
        self._steps.append(step)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdepot-l2-driver", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        os.close(self._wake_fd)
        self._wake_fd = -1

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        index_of_fd = {}
        for i, tier in enumerate(self._tiers):
            poller.register(tier.eventfd, select.POLLIN)
            index_of_fd[tier.eventfd] = i
        while not self._stop.is_set():
            events = poller.poll(500)
            results: list[tuple[int, TaskResult]] = []
            for fd, _ in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                elif fd in index_of_fd:
                    i = index_of_fd[fd]
                    results.extend((i, r) for r in self._tiers[i].completed())
            for step in self._steps:
                try:
                    step(results)
                except Exception:
                    log.exception("L2 controller step failed")
