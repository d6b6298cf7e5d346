"""Failure classes, the per-direction circuit breaker and the failure tally shared by the connectors."""

from __future__ import annotations

import logging

from kvdepot.connectors.common import CircuitBreaker, FailureTally, failure_class, is_transport_failure
from kvdepot.errors import (
    BadRequest,
    ErrorCode,
    KVDepotError,
    KVDepotTimeout,
    LeaseExpired,
    LeaseRevoked,
    ServerUnreachable,
)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_transport_failures_are_told_from_a_requests_own_problem():
    for exc in (KVDepotTimeout("t"), ServerUnreachable("u"), KVDepotError("x", ErrorCode.SHUTTING_DOWN), OSError("zmq")):
        assert is_transport_failure(exc) and failure_class(exc) == "transport"
    for exc, name in ((LeaseExpired("e"), "lease_expired"), (LeaseRevoked("r"), "lease_revoked"), (BadRequest("b"), "bad_request")):
        assert not is_transport_failure(exc) and failure_class(exc) == name


def test_the_breaker_opens_one_direction_for_a_while():
    clock = Clock()
    b = CircuitBreaker(5.0, clock=clock)
    assert b.allows("load") and b.allows("save")
    b.trip("load")
    assert not b.allows("load") and b.allows("save") and b.allows("lookup")
    clock.now += 4.9
    assert not b.allows("load")
    clock.now += 0.2
    assert b.allows("load")


def test_the_tally_counts_and_logs_each_class_once_then_in_summaries(caplog):
    tally = FailureTally(logging.getLogger("t"), "kvdepot test", every_s=0.0)
    with caplog.at_level(logging.INFO, logger="t"):
        tally.add("load", LeaseExpired("gone"), "the load for r1")
        tally.add("load", LeaseExpired("gone"), "the load for r2")
        tally.add("save", KVDepotTimeout("slow"), "the save for r3", retry_after_s=5)
    assert tally.snapshot() == {"load/lease_expired": 2, "save/transport": 1}
    text = caplog.text
    assert text.count("lease_expired: [LEASE_EXPIRED] gone") == 1  # the first of its class, in words
    assert "no saves for 5.0s" in text
    assert "failures so far: load lease_expired: 2" in text
