"""What an operator is told about an L2 tier with no engine traffic: right after start, and while the
server idles. A tier whose backend cannot be reached (nothing listens, a wrong password, a bucket that
is not there) is down in /status, /healthcheck and /metrics within seconds of start, with the error,
and comes back by itself once the backend answers; a backend that dies while the server idles is
noticed within the tier's retry interval, not at the next request. The server starts and serves L1
whatever its tiers do.
"""

from __future__ import annotations

import httpx
import pytest

from support.plugin import RemoteBackend
from support.servers import wait_until
from support.tiers import assert_served_whole, make_prompt, start_tier_server, store_full, tier_of

NOTICE_S = 15.0  # the retry interval is 2 s; a connect timeout of 1 s: well within this


def _down(srv, tier: str) -> dict:
    def seen() -> dict | None:
        t = tier_of(srv.status(), tier)
        return None if t["healthy"] else t

    t = wait_until(seen, timeout_s=NOTICE_S, interval_s=0.2, what=f"tier {tier} reported down without traffic")
    assert t["last_error"], t
    hc = httpx.get(f"{srv.http}/healthcheck", timeout=5).json()
    assert hc["status"] == "degraded" and tier in hc["reason"], hc
    assert srv.metric("kvdepot_l2_healthy", tier=tier) == 0.0
    return t


def _up(srv, tier: str) -> None:
    wait_until(lambda: tier_of(srv.status(), tier)["healthy"], timeout_s=NOTICE_S, interval_s=0.2,
               what=f"tier {tier} back up by itself, without traffic")  # fmt: skip
    assert httpx.get(f"{srv.http}/healthcheck", timeout=5).json()["status"] == "ok"
    assert srv.metric("kvdepot_l2_healthy", tier=tier) == 1.0


def test_a_tier_whose_backend_is_not_there_at_start_is_down_and_comes_back(remote_backend: RemoteBackend, make_server, seed):
    remote_backend.kill()
    srv = start_tier_server(make_server, remote_backend.spec)
    t = _down(srv, "remote")
    assert f"L2 remote ({remote_backend.kind}) failed, serving from L1 only" in srv.log_text(), t  # the start-up log says it too
    with srv.client() as c:  # L1 serves all along
        p = make_prompt(2, seed)
        store_full(c, p)
        assert_served_whole(c, p)
    remote_backend.restart()
    _up(srv, "remote")


def test_a_backend_that_dies_while_the_server_idles_is_noticed(remote_backend: RemoteBackend, make_server):
    srv = start_tier_server(make_server, remote_backend.spec)
    _up(srv, "remote")
    remote_backend.kill()
    _down(srv, "remote")
    remote_backend.restart()
    _up(srv, "remote")
