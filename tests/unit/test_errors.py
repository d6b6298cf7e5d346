"""ErrorCode values (wire contract) and rebuilding exceptions from codes."""

from __future__ import annotations

import pytest

from kvdepot.errors import (
    BadRequest,
    ErrorCode,
    IllegalTransition,
    KVDepotError,
    KVDepotTimeout,
    LeaseExpired,
    PayloadMismatch,
    TransportUnavailable,
    UnknownContext,
    UnknownKVCache,
    UnknownLease,
    error_from_code,
)


def test_error_code_values_are_pinned():
    assert [(c.name, c.value) for c in ErrorCode] == [
        ("OK", 0),
        ("INTERNAL", 1),
        ("BAD_REQUEST", 2),
        ("UNKNOWN_REQUEST_TYPE", 3),
        ("VERSION_MISMATCH", 4),
        ("UNKNOWN_CONTEXT", 5),
        ("PAYLOAD_MISMATCH", 6),
        ("MESSAGE_TOO_LARGE", 7),
        ("NO_SPACE", 8),
        ("ILLEGAL_STATE", 9),
        ("UNKNOWN_LEASE", 10),
        ("LEASE_EXPIRED", 11),
        ("TIMEOUT", 12),
        ("DEADLINE_EXCEEDED", 13),
        ("TRANSPORT_UNAVAILABLE", 14),
        ("SHUTTING_DOWN", 15),
        ("CONNECTION", 16),
        ("UNKNOWN_SESSION", 17),
        ("LEASE_REVOKED", 18),
        ("INCOMPATIBLE", 19),
        ("UNKNOWN_KV_CACHE", 20),
        ("PREFETCH_TOO_SLOW", 21),
        ("REPLIES_UNREAD", 22),
        ("OVERLOADED", 23),
    ]


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (ErrorCode.BAD_REQUEST, BadRequest),
        (ErrorCode.UNKNOWN_CONTEXT, UnknownContext),
        (ErrorCode.PAYLOAD_MISMATCH, PayloadMismatch),
        (ErrorCode.ILLEGAL_STATE, IllegalTransition),
        (ErrorCode.UNKNOWN_LEASE, UnknownLease),
        (ErrorCode.LEASE_EXPIRED, LeaseExpired),
        (ErrorCode.TIMEOUT, KVDepotTimeout),
        (ErrorCode.TRANSPORT_UNAVAILABLE, TransportUnavailable),
        (ErrorCode.UNKNOWN_KV_CACHE, UnknownKVCache),
    ],
)
def test_error_from_code_picks_the_subclass(code, cls):
    err = error_from_code(int(code), "what happened")
    assert type(err) is cls
    assert err.code is code
    assert err.message == "what happened"
    assert str(err) == f"[{code.name}] what happened"
    assert cls("x").code is code  # the class default agrees


@pytest.mark.parametrize(
    "code",
    [ErrorCode.INTERNAL, ErrorCode.NO_SPACE, ErrorCode.SHUTTING_DOWN, ErrorCode.UNKNOWN_SESSION, ErrorCode.VERSION_MISMATCH],
)
def test_known_codes_without_a_subclass_give_the_base_error_with_that_code(code):
    err = error_from_code(int(code), "m")
    assert type(err) is KVDepotError
    assert err.code is code


@pytest.mark.parametrize("code", [999, -1, 99])
def test_unknown_codes_give_a_generic_internal_error(code):
    err = error_from_code(code, "odd")
    assert type(err) is KVDepotError
    assert err.code is ErrorCode.INTERNAL
    assert err.message == f"odd (unknown error code {code})"


def test_explicit_code_overrides_the_class_default():
    err = BadRequest("m", ErrorCode.MESSAGE_TOO_LARGE)
    assert err.code is ErrorCode.MESSAGE_TOO_LARGE
    assert BadRequest("m").code is ErrorCode.BAD_REQUEST  # the class attribute is untouched


def test_every_error_is_a_kvdepot_error():
    for cls in (BadRequest, UnknownContext, PayloadMismatch, IllegalTransition, UnknownLease, LeaseExpired,
                KVDepotTimeout, TransportUnavailable):
        assert issubclass(cls, KVDepotError)
