"""A tier that flaps with one error (reads work, writes fail) says so once a window, not at every probe."""

from __future__ import annotations

import logging

from kvdepot.storage.l2 import backend
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig


def test_a_tier_that_recovers_and_fails_with_one_error_warns_once_a_window(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(backend.time, "monotonic", lambda: now[0])
    tier = MemoryAdapter("flappy", MemoryConfig(size_gb=0.01))
    tier._said = backend._FlapDamper(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger=backend.__name__)

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and "flappy" in r.getMessage()]

    for _ in range(30):  # a read-only filesystem: each probe (a lookup) recovers it, each store fails it
        tier._mark_down(OSError(30, "Read-only file system"))
        tier._mark_up()
        now[0] += 2.0  # the retry interval
    assert len(said(logging.WARNING)) == 1 and len(said(logging.INFO)) == 1, caplog.text
    now[0] += backend.FLAP_WINDOW_S
    tier._mark_down(OSError(30, "Read-only file system"))
    warnings = said(logging.WARNING)
    assert len(warnings) == 2 and "29 more times" in warnings[-1], warnings
    tier._mark_down(OSError(28, "No space left on device"))  # while down: the breaker says nothing new
    tier._mark_up()
    tier._mark_down(OSError(28, "No space left on device"))  # another error is said at once
    assert len(said(logging.WARNING)) == 3 and "No space left" in said(logging.WARNING)[-1]
    assert tier.usage().failures == 33


def test_a_hushed_failure_that_turns_into_an_outage_is_said_within_a_window(caplog, monkeypatch):
    """A failure hushed as a flap (the same error again within the window), after which the tier stays
    down: its log must not end on "recovered" for as long as the outage lasts."""
    now = [1000.0]
    monkeypatch.setattr(backend.time, "monotonic", lambda: now[0])
    tier = MemoryAdapter("flappy", MemoryConfig(size_gb=0.01))
    tier._said = backend._FlapDamper(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger=backend.__name__)
    error = OSError(30, "Read-only file system")
    tier._mark_down(error)  # said
    now[0] += 2.0
    tier._mark_up()  # said
    now[0] += 2.0
    tier._mark_down(error)  # hushed: the same error within the window
    for _ in range(300):  # then every probe fails, for 10 minutes
        now[0] += 2.0
        tier._breaker.admit()  # the probe let through
        tier._mark_down(error)
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and "flappy" in r.getMessage()]
    assert "failed" in shown[-1], f"the tier has been down for 10 minutes, its log says: {shown}"
