"""Failure classes, the per-direction circuit breaker and the failure tally shared by the connectors."""

from __future__ import annotations

import logging

from kvdepot.breaker import BreakerState
from kvdepot.connectors.common import DIRECTION_OF, Breakers, Direction, FailureTally, failure_class, is_transport_failure
from kvdepot.errors import (
    BadRequest,
    ErrorCode,
    KVDepotError,
    KVDepotTimeout,
    LeaseExpired,
    LeaseRevoked,
    ServerUnreachable,
)
from kvdepot.protocol import messages as m


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_transport_failures_are_told_from_a_requests_own_problem():
    for exc in (KVDepotTimeout("t"), ServerUnreachable("u"), KVDepotError("x", ErrorCode.SHUTTING_DOWN), OSError("zmq")):
        assert is_transport_failure(exc) and failure_class(exc) == "transport"
    for exc, name in ((LeaseExpired("e"), "lease_expired"), (LeaseRevoked("r"), "lease_revoked"), (BadRequest("b"), "bad_request")):
        assert not is_transport_failure(exc) and failure_class(exc) == name


def test_a_transport_failure_switches_one_direction_off_until_a_probe_is_answered():
    clock = Clock()
    b = Breakers(5.0, clock=clock)
    assert b.admit(Direction.LOAD) and b.admit(Direction.SAVE)
    b.failed(Direction.LOAD, "timeout")
    assert not b.admit(Direction.LOAD) and b.admit(Direction.SAVE) and b.admit(Direction.LOOKUP)
    clock.now += 4.9
    assert not b.admit(Direction.LOAD)
    clock.now += 0.2
    assert b.admit(Direction.LOAD)  # one probe
    assert not b.admit(Direction.LOAD)  # the others stay misses until the probe is answered
    b.answered(m.RequestType.LOOKUP)  # a reply in another direction proves nothing about loads
    assert b[Direction.LOAD].state is BreakerState.PROBING
    b.answered(m.RequestType.PREPARE_RETRIEVE)
    assert b[Direction.LOAD].up and b.admit(Direction.LOAD) and b.admit(Direction.LOAD)


def test_every_request_a_connector_sends_closes_its_own_direction():
    # the requests of each direction (what the vLLM and SGLang connectors send for it; the vLLM worker's
    # server-driven path sends RETRIEVE_BLOCKS and STORE_BLOCKS)
    assert {t.name for t, d in DIRECTION_OF.items() if d is Direction.LOAD} == {"PREPARE_RETRIEVE", "COMMIT_RETRIEVE", "RETRIEVE_INLINE",
                                                                                "RETRIEVE_BLOCKS"}  # fmt: skip
    assert {t.name for t, d in DIRECTION_OF.items() if d is Direction.SAVE} == {"PREPARE_STORE", "COMMIT_STORE", "STORE_INLINE", "STORE_BLOCKS"}
    assert DIRECTION_OF[m.RequestType.REGISTER_CONTEXT] is Direction.CONNECT
    assert DIRECTION_OF[m.RequestType.LOOKUP] is Direction.LOOKUP


def test_the_tally_counts_and_logs_each_class_once_then_in_summaries(caplog):
    tally = FailureTally(logging.getLogger("t"), "kvdepot test", every_s=0.0)
    with caplog.at_level(logging.INFO, logger="t"):
        tally.add(Direction.LOAD, LeaseExpired("gone"), "the load for r1")
        tally.add(Direction.LOAD, LeaseExpired("gone"), "the load for r2")
        tally.add(Direction.SAVE, KVDepotTimeout("slow"), "the save for r3", retry_after_s=5)
    assert tally.snapshot() == {"load/lease_expired": 2, "save/transport": 1}
    text = caplog.text
    assert text.count("lease_expired: [LEASE_EXPIRED] gone") == 1  # the first of its class, in words
    assert "no saves for 5.0s" in text
    assert "failures so far: load lease_expired: 2" in text


def test_a_log_level_typo_in_the_environment_is_a_warning_not_an_engine_that_fails_to_start():
    """Both connectors call ensure_logging() when the engine builds them: KVDEPOT_LOG_LEVEL=verbose raised
    logging's ValueError("Unknown level") there, and vLLM's start failed with a traceback. (In a process of
    its own: pytest's handlers on the root logger would make ensure_logging() do nothing.)"""
    import os
    import subprocess
    import sys

    code = "import logging; from kvdepot.connectors.common import ensure_logging; ensure_logging(); print(logging.getLogger('kvdepot').level)"
    for value, level in (("verbose", logging.INFO), ("", logging.INFO), ("debug", logging.DEBUG), ("warning", logging.WARNING)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, KVDEPOT_LOG_LEVEL=value))  # fmt: skip
        assert r.returncode == 0 and "Traceback" not in r.stderr, (value, r.stderr[-1500:])
        assert r.stdout.split() == [str(level)], (value, r.stdout)
        if value == "verbose":
            assert "KVDEPOT_LOG_LEVEL" in r.stderr and "'verbose'" in r.stderr, r.stderr
