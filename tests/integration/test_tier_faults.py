"""A failing L2 tier never takes L1 down with it (ARCHITECTURE.md §6): when a backend dies, hangs, fills
up or refuses writes, stores and lookups go on from L1 (every call returns), /status says the tier is
unhealthy and why, and once the backend is back the tier recovers by itself. The store queue is
bounded: what a stuck tier cannot take is dropped and counted, never waited for.

Each test owns its backend (its own valkey-server, weed, tmpfs or file-size limit), because it breaks it.
"""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest

from kvdepot.bench.serverproc import free_port

from support.backends import resize_tmpfs
from support.plugin import RemoteBackend
from support.servers import pause, wait_until
from support.tiers import (
    BIG_CHUNK,
    assert_consistent,
    assert_prefix_bytes,
    assert_served_whole,
    fs_spec,
    make_prompt,
    start_tier_server,
    store_full,
    store_stats,
    tier_of,
    valkey_spec,
    wait_store_idle,
    wait_tier,
)

RECOVERY_TIMEOUT_S = 30.0  # the tier is probed again every retry_interval_s (2 s) while tasks arrive


def _store_until_recovered(srv, c, tier: str, seed: int, chunk: int) -> None:
    """A down tier is probed by the next task after its retry interval: keep storing small prompts
    (each a fresh object to push) until one push gets through and the tier is healthy again."""
    count = [0]

    def recovered() -> bool:
        count[0] += 1
        store_full(c, make_prompt(1, seed + count[0], chunk))
        wait_store_idle(srv)
        return tier_of(srv.status(), tier)["healthy"]

    wait_until(recovered, timeout_s=RECOVERY_TIMEOUT_S, interval_s=0.2, what=f"tier {tier} to recover")


def test_a_remote_tier_that_dies_degrades_to_l1_and_recovers(remote_backend: RemoteBackend, make_server, seed):
    srv = start_tier_server(make_server, remote_backend.spec)
    before, during, after, final = (make_prompt(n, seed + i) for i, n in enumerate([3, 4, 5, 6]))
    with srv.client() as c:
        store_full(c, before)
        t = tier_of(wait_store_idle(srv), "remote")
        assert (t["healthy"], t["objects"], t["stored"]) == (True, 3, 3)

        remote_backend.kill()
        store_full(c, during)  # L1 takes it at once; only its push fails
        t = wait_tier(srv, "remote", lambda t: not t["healthy"], "the tier to be marked down")
        assert t["last_error"] and t["failures"] >= 1
        s = store_stats(wait_store_idle(srv))
        assert (s["submitted"], s["stored"], s["failed"]) == (7, 3, 4)
        assert_served_whole(c, during)

        # L1 emptied and the only tier down: a lookup is a miss (promptly: it returns), not an error.
        srv.clear()
        assert c.lookup(before.tokens) == 0
        assert_prefix_bytes(c.retrieve(during.tokens), during, 0)
        store_full(c, after)
        assert_served_whole(c, after)
        assert not tier_of(srv.status(), "remote")["healthy"]

        remote_backend.restart()
        _store_until_recovered(srv, c, "remote", seed * 100, 16)
        stored = tier_of(wait_store_idle(srv), "remote")["stored"]
        store_full(c, final)
        t = tier_of(wait_store_idle(srv), "remote")
        assert (t["healthy"], t["stored"]) == (True, stored + 6)

        srv.clear()
        assert_served_whole(c, final)  # from the recovered tier
        if remote_backend.keeps_data:
            assert_served_whole(c, before)  # weed kept its data across the restart
        else:
            assert c.lookup(before.tokens) == 0  # valkey came back empty: a miss
        assert tier_of(srv.status(), "remote")["corrupt"] == 0


def test_an_fs_tier_that_cannot_write_degrades_to_l1_and_recovers(make_server, tmp_path, seed):
    """The server process gets RLIMIT_FSIZE below an object's size (EFBIG; works without root), later
    lifted: every write fails, the tier is down (L1 serves), and it recovers by itself."""
    tier_dir = tmp_path / "disk"
    srv = start_tier_server(make_server, fs_spec(tier_dir), chunk=BIG_CHUNK)
    pid = srv.proc.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (16 << 10, hard))  # a 32 KiB object no longer fits

    prompts: list = []
    with srv.client() as c:

        def tier_failed() -> bool:
            p = make_prompt(4, seed * 1000 + len(prompts), BIG_CHUNK)
            prompts.append(p)
            store_full(c, p)  # L1 always takes it
            wait_store_idle(srv)
            return not tier_of(srv.status(), "disk")["healthy"]

        wait_until(tier_failed, timeout_s=60, interval_s=0, what="the fs tier to fail its writes")
        t = tier_of(srv.status(), "disk")
        assert "File too large" in t["last_error"]
        assert store_stats(srv.status())["failed"] >= 1
        for p in prompts:
            assert_served_whole(c, p)  # L1 serves all of it
        assert [f for f in tier_dir.glob("??/.tmp-*")] == []  # failed writes leave nothing behind

        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        _store_until_recovered(srv, c, "disk", seed * 1000 + 500, BIG_CHUNK)
        final = make_prompt(4, seed * 1000 + 999, BIG_CHUNK)
        store_full(c, final)
        wait_store_idle(srv)

        srv.clear()
        assert_served_whole(c, final)  # from the tier
        for p in prompts:
            assert_consistent(c, p)  # what reached the tier before the failure is whole, or absent
        t = tier_of(srv.status(), "disk")
        assert (t["healthy"], t["corrupt"]) == (True, 0)


def test_an_fs_tier_on_a_disk_that_fills_keeps_what_fits_and_grows_back(small_tmpfs, make_server, seed):
    """The tier (size_gb 1) on a 1 MiB tmpfs (ENOSPC long before its size), later grown to 64 MiB. A
    full disk is not a failure: the write that meets it is refused alone, the tier stays up and keeps
    at most what the disk holds (its newest objects), and it grows back once the disk has room. (It
    used to go down on every write, its objects on disk unreadable, until the disk grew.)"""
    from kvdepot.storage.l2.fs_adapter import ROOM_CHECK_S

    srv = start_tier_server(make_server, fs_spec(small_tmpfs), chunk=BIG_CHUNK)
    prompts = [make_prompt(4, seed * 1000 + i, BIG_CHUNK) for i in range(24)]  # 3 MiB through a 1 MiB disk
    with srv.client() as c:
        for p in prompts:
            store_full(c, p)
            wait_store_idle(srv)
        t = tier_of(srv.status(), "disk")
        assert t["healthy"] and t["failures"] == 0, t
        assert 0 < t["used_bytes"] <= t["capacity_bytes"] < 1 << 20, t  # size_gb was 1 GiB
        assert [f for f in small_tmpfs.glob("??/.tmp-*")] == []  # refused writes leave nothing behind
        for p in prompts:
            assert_served_whole(c, p)  # L1 took everything
        srv.clear()
        for p in prompts:
            assert_consistent(c, p)  # from the tier: whole, or absent
        assert c.lookup(prompts[-1].tokens) > 0, "the newest objects stay on the tier"

        resize_tmpfs(small_tmpfs, "64m")
        time.sleep(ROOM_CHECK_S)  # a write looks for room again at most this often
        big = make_prompt(64, seed * 1000 + 999, BIG_CHUNK)  # 2 MiB: more than the 1 MiB disk ever held
        store_full(c, big)
        wait_store_idle(srv)
        t = tier_of(srv.status(), "disk")
        assert t["capacity_bytes"] > 2 << 20 and t["healthy"], t
        srv.clear()
        assert_served_whole(c, big)  # from the tier
        assert tier_of(srv.status(), "disk")["corrupt"] == 0


@pytest.mark.parametrize("how", ["hung", "dead"])
def test_a_stuck_tier_never_blocks_stores_and_drops_beyond_the_queue_limit(how, own_valkey, make_server, seed):
    """``hung``: the valkey-server is SIGSTOPped (connections accepted, nothing answered; operations wait
    for the 60 s socket timeout). ``dead``: nothing listens on the tier's port at all."""
    url = own_valkey.url if how == "hung" else f"redis://127.0.0.1:{free_port()}/0"
    queue_limit = 4
    srv = start_tier_server(
        make_server, valkey_spec(url, name="stuck", socket_timeout_s=60), extra=("--l2-queue-limit", str(queue_limit))
    )
    prompts = [make_prompt(4, seed + i) for i in range(30)]
    total = 4 * len(prompts)
    with srv.client() as c:
        if how == "hung":
            pause(own_valkey.proc.pid)
        try:
            # (no /status while the tier hangs: its usage() would wait on the backend too)
            for p in prompts:
                store_full(c, p)  # returns: the push is queued or dropped, never waited for
            for p in prompts:
                assert_served_whole(c, p)
        finally:
            if how == "hung":
                os.kill(own_valkey.proc.pid, signal.SIGCONT)
        status = wait_store_idle(srv, accounted=total)
        s = store_stats(status)
        t = tier_of(status, "stuck")
        assert s["skipped_gone"] == 0
        assert s["submitted"] + s["dropped"] == total
        if how == "hung":
            # While it hung, at most max_in_flight (8) batches were open, each popped from a queue of at
            # most queue_limit objects, and queue_limit more waited: everything else was dropped.
            assert s["dropped"] >= total - (8 + 1) * queue_limit
            assert (s["stored"], s["failed"]) == (s["submitted"], 0)  # what was taken, was stored
            assert (t["healthy"], t["objects"]) == (True, s["submitted"])
        else:
            assert (s["stored"], s["failed"]) == (0, s["submitted"])
            assert not t["healthy"] and t["last_error"]
        for p in prompts:
            assert_served_whole(c, p)


def test_a_prefetch_too_slow_for_its_window_is_that_requests_miss_not_a_transport_failure(own_valkey, make_server, seed):
    """The server answers every poll while its prefetch from a hung tier runs past the caller's window:
    that is the request's miss (PrefetchTooSlow), not a failure of the server, so a connector keeps its
    breaker closed and goes on reading what L1 holds."""
    from kvdepot.connectors.common import is_transport_failure
    from kvdepot.errors import PrefetchTooSlow
    from kvdepot.hashing import chunk_hashes

    srv = start_tier_server(make_server, valkey_spec(own_valkey.url, name="slow", socket_timeout_s=30), extra=("--l2-placement", "skip_l1"))
    gone, kept = make_prompt(3, seed), make_prompt(2, seed + 1)
    with srv.client(timeout_s=1.0) as c:
        store_full(c, gone)
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, timeout_s=30)  # only the tier holds them now
        pause(own_valkey.proc.pid)
        try:
            with pytest.raises(PrefetchTooSlow) as raised:
                c.link.stored_chunks(chunk_hashes(gone.tokens, gone.chunk), "")
            assert not is_transport_failure(raised.value)
            store_full(c, kept)  # the server itself serves on: (skip_l1 keeps it in L1 while the tier hangs)
            assert c.lookup(kept.tokens) == kept.n_tokens
        finally:
            os.kill(own_valkey.proc.pid, signal.SIGCONT)


def test_a_prefetch_whose_lookup_gave_up_loads_nothing_and_holds_no_l1_space(own_valkey, make_server, seed):
    """Lookups whose prefetch from a hung tier ran past their window ended their sessions (SGLang's
    budget ran out, vLLM aborted the request). Their prefetches went on all the same once the tier
    answered: each reserved L1 space and loaded its prefix from the tier, for nobody, ahead of the
    prefetches somebody still waited for. A prefetch whose session ended does no more tier work."""
    from kvdepot.errors import PrefetchTooSlow
    from kvdepot.hashing import chunk_hashes

    from support.tiers import prefetch_stats

    srv = start_tier_server(make_server, valkey_spec(own_valkey.url, name="slow", socket_timeout_s=30), extra=("--l2-placement", "skip_l1"))
    given_up = [make_prompt(3, seed + i) for i in range(4)]
    with srv.client(timeout_s=0.5) as c:
        for p in given_up:
            store_full(c, p)
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, timeout_s=30)  # only the tier holds them now
        pause(own_valkey.proc.pid)
        try:
            for p in given_up:
                with pytest.raises(PrefetchTooSlow):
                    c.link.stored_chunks(chunk_hashes(p.tokens, p.chunk), "")  # ends its session
        finally:
            os.kill(own_valkey.proc.pid, signal.SIGCONT)
        wait_until(lambda: prefetch_stats(srv.status())["running"] == 0, timeout_s=60, what="the prefetches to end")
        st = srv.status()
        assert tier_of(st, "slow")["loaded"] == 0, "prefetches nobody waited for loaded from the tier"
        assert (st["l1"]["objects"], st["leases"], st["sessions"]) == (0, 0, 0)
        assert prefetch_stats(st)["chunks_loaded"] == 0
    with srv.client(timeout_s=30) as c:  # a lookup that waits still gets its prefix
        assert_served_whole(c, given_up[0])


def test_a_poll_whose_timer_fires_a_hair_before_the_window_ends_is_still_that_requests_miss(own_valkey, make_server, seed):
    """ZeroMQ's receive timer counts whole milliseconds, so a poll whose wait ends at the lookup's
    deadline can give up just before it: that too is the slow prefetch (PrefetchTooSlow), not a server
    that does not answer (it read as a transport failure, and SGLang's backend stopped all lookups for
    ``retry_after_s``; flaky under load). Here every poll times out 2 ms before the time it was given."""
    from kvdepot.connectors.common import is_transport_failure
    from kvdepot.errors import KVDepotTimeout, PrefetchTooSlow
    from kvdepot.hashing import chunk_hashes
    from kvdepot.protocol import messages as m

    srv = start_tier_server(make_server, valkey_spec(own_valkey.url, name="slow", socket_timeout_s=30), extra=("--l2-placement", "skip_l1"))
    gone = make_prompt(3, seed)
    with srv.client(timeout_s=1.0) as c:
        store_full(c, gone)
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, timeout_s=30)
        channel = c.link.channel
        real_call, polls = channel.call, []

        def early_timer(body, *args, timeout_s: float = 10.0, **kwargs):
            if isinstance(body, m.QueryPrefetchStatusRequest):
                polls.append(timeout_s)
                time.sleep(max(0.0, timeout_s - 0.002))
                raise KVDepotTimeout(f"{type(body).__name__} got no reply in time")
            return real_call(body, *args, timeout_s=timeout_s, **kwargs)

        channel.call = early_timer
        pause(own_valkey.proc.pid)
        try:
            with c.deadline(0.3), pytest.raises(PrefetchTooSlow) as raised:
                c.link.stored_chunks(chunk_hashes(gone.tokens, gone.chunk), "")
            assert not is_transport_failure(raised.value)
            assert polls, "the lookup did not wait for a prefetch"
        finally:
            os.kill(own_valkey.proc.pid, signal.SIGCONT)
            channel.call = real_call


def test_skip_l1_keeps_in_l1_what_a_tier_failed_to_take(make_server, tmp_path, seed):
    """``skip_l1`` drops an object from L1 only once *every* tier has it: with one tier dead, nothing
    leaves L1, so nothing is lost."""
    dead = valkey_spec(f"redis://127.0.0.1:{free_port()}/0", name="dead")
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), dead, extra=("--l2-placement", "skip_l1"))
    prompts = [make_prompt(n, seed + i) for i, n in enumerate([2, 3, 4])]
    with srv.client() as c:
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv, accounted=9)
        s = store_stats(status)
        assert (s["submitted"], s["stored"], s["failed"]) == (9, 9, 9)  # per tier: disk took all, dead none
        assert (tier_of(status, "disk")["objects"], tier_of(status, "dead")["healthy"]) == (9, False)
        assert status["l1"]["objects"] == 9
        for p in prompts:
            assert_served_whole(c, p)
