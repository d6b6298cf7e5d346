"""Strings that are not valid UTF-8 inside a request body get BAD_REQUEST, like any malformed body.

(Found by the fuzz test: msgspec raises UnicodeDecodeError, not DecodeError, for them, and that used to
escape the codec and kill the RPC loop. Each case runs on its own server so a regression shows per case.)
"""

from __future__ import annotations

import httpx
import msgspec
import pytest

from kvdepot.errors import ErrorCode
from kvdepot.protocol import messages as m

from support.servers import RawPeer, raw_header

BAD_STR = b"\xa2\xff\xfe"  # msgpack fixstr of two bytes that are not UTF-8
enc = msgspec.msgpack.encode


def _map(*items: bytes) -> bytes:
    assert len(items) % 2 == 0
    return bytes([0x80 | (len(items) // 2)]) + b"".join(items)


CASES = {
    "lookup-salt": (m.RequestType.LOOKUP, _map(enc("context_id"), enc(1), enc("keys"), enc([]), enc("cache_salt"), BAD_STR)),
    "ping-key": (m.RequestType.PING, _map(BAD_STR, enc(1))),
    "end-session-id": (m.RequestType.END_SESSION, _map(enc("context_id"), enc(1), enc("session_id"), BAD_STR)),
    "register-model": (
        m.RequestType.REGISTER_CONTEXT,
        _map(
            enc("protocol_version"), enc(m.PROTOCOL_VERSION),
            enc("model"), BAD_STR,
            enc("layout"), enc({"num_layers": 2, "num_kv_heads": 2, "head_dim": 32}),
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_utf8_in_a_body_gets_bad_request(make_server, case):
    srv = make_server()
    rtype, body = CASES[case]
    with RawPeer(srv.url) as p:
        rid = p.next_id()
        code, got_rid, _ = p.error_of([raw_header(m.PROTOCOL_VERSION, rid, int(rtype)), body], timeout_s=3)
        assert code == ErrorCode.BAD_REQUEST
        assert got_rid == rid
    with RawPeer(srv.url) as q:
        assert q.ping(timeout_s=3)
    r = httpx.get(f"{srv.http}/healthcheck", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
