"""Peer nodes over links that are slow, lossy or odd rather than dead.

A node runs in a network namespace whose only link to this host goes through ``support.slowlink``'s
forwarder (``tc netem`` is not available everywhere): its packets are delayed, jittered or dropped
there, rates are the kernel's ``tbf``. The head and the reader run in this process, on the link's
other end. These tests need root, as the namespace tests do.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
from support import netns
from support.peer_cluster import NodeProcess, check_pages, wait_for
from support.slowlink import SlowLink

from kvdepot.peer import PeerStore

SECRET = "slow-links"
# The shipped timings: what a deployment over a long link runs with.
DEFAULTS = {"heartbeat_interval_s": 1.0, "member_ttl_s": 5.0, "control_timeout_s": 1.0, "timeout_s": 2.0, "metrics_port": 0}

_why = netns.available()
if _why and os.environ.get("KVDEPOT_SKIP_NETNS") == "1":
    pytestmark = pytest.mark.skip(reason=f"network namespaces unavailable: {_why}")
_links = itertools.count()


@pytest.fixture
def link():
    assert not _why, f"network namespaces are needed for these tests: {_why} (set KVDEPOT_SKIP_NETNS=1 to skip them loudly)"
    n = next(_links)
    made = SlowLink(f"{os.getpid() % 100000}{n}", 20 + (os.getpid() + n) % 200)
    started: list[NodeProcess] = []

    def node(discovery: str, **extra) -> NodeProcess:
        proc = NodeProcess(discovery=discovery, secret=SECRET, host=made.address, port=31995, data_port=31996, netns=made.ns,
                           extra={**DEFAULTS, "join_timeout_s": 0, **extra})  # fmt: skip
        started.append(proc)
        return proc.start()

    made.node = node
    yield made
    for proc in started:
        proc.kill()
    made.close()


def test_a_node_across_a_200ms_round_trip_joins_publishes_and_serves(link):
    """A round trip of 200 ms (a link between regions): a call on an open connection takes 0.2 s, well
    within the 1 s control timeout, but a new control connection (TCP, then CurveZMQ's handshake) takes
    about five round trips. The node's first heartbeat timed out while its connection was still coming
    up, the channel was closed with it, and the next one started from scratch: the node never joined,
    and no publish or lookup to the far side ever got through."""
    link.set(delay_s=0.1)
    with PeerStore(host=link.gateway, port=0, data_port=0, secret=SECRET, pool_size_mb=16, **DEFAULTS) as head:
        far = link.node(head.node_id)
        wait_for(lambda: len(head.status()["members"]) == 2 and len(far.command("status")["members"]) == 2, 30, "the far node to join")
        assert far.command("set f 8 65536") == {"stored": 8}
        wait_for(lambda: check_pages(head, "f", 8, 65536)["hit"] == 8, 30, "the far node's pages, read here")
        assert check_pages(head, "f", 8, 65536)["wrong"] == 0


def test_a_read_across_a_long_round_trip_ends_at_its_deadline(link):
    """A data connection's handshake (three round trips after the connect) was bounded per receive by
    the connect timeout, not by the read's deadline: across a 1.8 s round trip a 2 s read returned
    after more than 5 s. It must be a miss by its deadline (plus a margin for a busy machine)."""
    with PeerStore(host=link.gateway, port=0, data_port=0, secret=SECRET, pool_size_mb=16, **{**DEFAULTS, "member_ttl_s": 30.0}) as head:
        far = link.node(head.node_id, member_ttl_s=30.0)
        wait_for(lambda: len(head.status()["members"]) == 2 and len(far.command("status")["members"]) == 2, 30, "the far node to join")
        assert far.command("set d 4 65536") == {"stored": 4}
        names = [f"d{i}" for i in range(4)]
        wait_for(lambda: head.batch_exists(names) == 4, 10, "the far node's records")  # remembered: the read asks no directory
        link.set(delay_s=0.9)
        t0 = time.monotonic()
        got = head.batch_get(names, timeout_s=2.0)
        took = time.monotonic() - t0
        assert got == [None] * 4
        assert took < 2.0 + 2.0, f"a read with a 2 s deadline returned after {took:.1f} s (more than 5 s before the fix)"
        link.set()
        wait_for(lambda: check_pages(head, "d", 4, 65536)["hit"] == 4, 30, "the pages once the link is fast again")



BIG = 32 << 20


def _far_big_page(link, head) -> NodeProcess:
    far = link.node(head.node_id, pool_size_mb=128)
    wait_for(lambda: len(head.status()["members"]) == 2 and len(far.command("status")["members"]) == 2, 30, "the far node to join")
    assert far.command(f"set big 1 {BIG}") == {"stored": 1}
    wait_for(lambda: head.batch_exists(["big0"]) == 1, 10, "the far node's record")
    return far


def test_a_page_arriving_slowly_is_a_miss_at_the_deadline_and_reads_again_once_the_link_is_fast(link):
    """20 Mbit/s and a 32 MiB page: 13 s of steady arrival against a 2 s deadline. The receive timeout
    was armed once per page and bounds one receive call, not the page, so as long as every 256 KiB
    piece came within it the read ran on to the end (13 s for a 2 s get). It must be a miss by the
    deadline, its connection dropped (never reused half-read), and the page must read once the link
    is fast again."""
    with PeerStore(host=link.gateway, port=0, data_port=0, secret=SECRET, pool_size_mb=16, **DEFAULTS) as head:
        _far_big_page(link, head)
        link.rate("20mbit")
        dropped = head.node._transport.dropped
        t0 = time.monotonic()
        got = head.batch_get(["big0"])
        took = time.monotonic() - t0
        assert got == [None]
        assert took < 2.0 + 3.0, f"a get with a 2 s deadline returned after {took:.1f} s (13 s before the fix)"
        assert head.node._transport.dropped > dropped  # the half-read connection is closed, never reused
        link.rate(None)
        wait_for(lambda: check_pages(head, "big", 1, BIG)["hit"] == 1, 30, "the page once the link is fast again")
        assert check_pages(head, "big", 1, BIG) == {"hit": 1, "miss": 0, "wrong": 0}


def test_a_link_too_slow_for_any_read_to_complete_teaches_the_planner_to_recompute(link, monkeypatch):
    """20 Mbit/s and 32 MiB pages: no read completes within its 2 s deadline. Only completed reads were
    samples, so the planner never had an estimate, let every pull through as a probe, and each lost the
    whole deadline, for good. A read cut short mid-page measures the link; the pulls that lose are then
    skipped (counted), and once the link is fast again and the slow estimate has aged, a probe pulls
    the page whole."""
    from kvdepot.peer import planner

    with PeerStore(host=link.gateway, port=0, data_port=0, secret=SECRET, pool_size_mb=16, **DEFAULTS) as head:
        _far_big_page(link, head)
        link.rate("20mbit")
        buf = bytearray(BIG)
        assert head.batch_get_into(["big0"], [buf], recompute_s=0.5) == [False]  # no estimate yet: pulled, cut at the deadline
        assert head.batch_get_into(["big0"], [buf], recompute_s=0.5) == [False]
        decisions = head.status()["pull_decisions"]
        assert decisions == {"pull/no_estimate": 1, "recompute/pull_slower": 1}, decisions  # the second would lose: skipped
        link.rate(None)
        monkeypatch.setattr(planner, "STALE_S", 1.0)  # the slow estimate ages (30 s in production) and a probe goes through
        wait_for(lambda: head.batch_get_into(["big0"], [buf], recompute_s=0.5) == [True], 30, "the page once the link is fast again")
        assert check_pages(head, "big", 1, BIG) == {"hit": 1, "miss": 0, "wrong": 0}
