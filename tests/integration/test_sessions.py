"""Lookup sessions (engine connectors): a LOOKUP with a session id locks its hits until the session
retrieves them, frees them, or ends."""

from __future__ import annotations

import pytest

from kvdepot.errors import ErrorCode, KVDepotError

from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens, wait_until


@pytest.fixture
def srv(make_server):
    return make_server()


def _stored(c, n, seed):
    tokens = make_tokens(n * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    assert c.store(tokens, kv) == n * CHUNK
    return tokens, kv


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_lookup_locks_and_retrieve_reuses_them(srv, transport, seed):
    with srv.client(transport=transport) as c:
        tokens, kv = _stored(c, 4, seed)
        hashes = c.hashes(tokens)
        assert srv.status()["leases"] == 0

        assert c.lookup_chunks(hashes, session_id="r1") == 4
        st = srv.status()
        assert st["leases"] == 1
        assert st["sessions"] == 1
        assert st["l1"]["read_locked"] == 4
        assert c.query_prefetch_status("r1") == 4
        # Locked objects survive a clear until the session lets go.
        assert srv.clear()["removed"] == 0

        with c.prepare_retrieve(hashes, session_id="r1") as views:
            assert len(views) == 4
            if transport == "shm":  # (inline: the bytes were already sent and the lease released)
                assert srv.status()["leases"] == 1, "the retrieve must reuse the lookup's lease, not take another"
            for i, v in enumerate(views):
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        st = srv.status()  # had the retrieve taken a fresh lease, the session's would still be held
        assert st["leases"] == 0
        assert st["l1"]["read_locked"] == 0
        assert st["l1"]["objects"] == 0, "the cleared objects went with the last lock"
        c.end_session("r1")
        assert srv.status()["sessions"] == 0


def test_free_lookup_locks_releases_all_or_part(srv, seed):
    with srv.client() as c:
        tokens, _ = _stored(c, 5, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="s") == 5
        assert srv.status()["l1"]["read_locked"] == 5
        assert c.free_lookup_locks("s", start=3) == 2
        st = srv.status()
        assert st["leases"] == 1 and st["l1"]["read_locked"] == 3
        assert c.free_lookup_locks("s", start=3) == 0  # already released
        assert c.free_lookup_locks("s", start=0, end=1) == 1
        assert srv.status()["l1"]["read_locked"] == 2
        assert c.free_lookup_locks("s") == 2
        st = srv.status()
        assert st["leases"] == 0 and st["l1"]["read_locked"] == 0
        assert c.free_lookup_locks("s") == 0
        assert c.free_lookup_locks("no-such-session") == 0
        c.end_session("s")
        assert srv.status()["sessions"] == 0


def test_end_session_releases_locks(srv, seed):
    with srv.client() as c:
        tokens, kv = _stored(c, 3, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="a") == 3
        assert c.lookup_chunks(hashes[:2], session_id="b") == 2
        st = srv.status()
        assert st["leases"] == 2 and st["sessions"] == 2
        c.end_session("a")
        st = srv.status()
        assert st["leases"] == 1 and st["sessions"] == 1
        assert st["l1"]["read_locked"] == 2
        c.end_session("b")
        st = srv.status()
        assert st["leases"] == 0 and st["sessions"] == 0 and st["l1"]["read_locked"] == 0
        c.end_session("never-existed")  # ending an unknown session is harmless
        assert_bytes_equal(c.retrieve(tokens), kv)


def test_a_new_lookup_in_the_same_session_replaces_its_locks(srv, seed):
    with srv.client() as c:
        tokens, _ = _stored(c, 4, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="x") == 4
        assert c.lookup_chunks(hashes[:1], session_id="x") == 1
        st = srv.status()
        assert st["leases"] == 1 and st["l1"]["read_locked"] == 1
        assert c.query_prefetch_status("x") == 1
        c.end_session("x")
        assert srv.status()["leases"] == 0


def test_session_with_a_miss_and_partial_hit(srv, seed):
    with srv.client() as c:
        tokens, _ = _stored(c, 2, seed)
        longer = list(tokens) + list(make_tokens(2 * CHUNK, seed + 1))
        assert c.lookup_chunks(c.hashes(longer), session_id="p") == 2
        assert c.query_prefetch_status("p") == 2
        miss = make_tokens(3 * CHUNK, seed + 2)
        assert c.lookup_chunks(c.hashes(miss), session_id="m") == 0
        assert c.query_prefetch_status("m") == 0
        assert srv.status()["leases"] == 1  # a miss locks nothing
        c.end_session("p")
        c.end_session("m")
        st = srv.status()
        assert st["leases"] == 0 and st["sessions"] == 0


def test_unknown_session_is_an_error(srv):
    with srv.client() as c:
        with pytest.raises(KVDepotError) as exc_info:
            c.query_prefetch_status("nobody")
        assert exc_info.value.code == ErrorCode.UNKNOWN_SESSION
        # Sessions belong to a context: another client cannot see this one's.
        assert c.lookup_chunks(c.hashes(make_tokens(CHUNK, 1)), session_id="mine") == 0
        with srv.client() as other:
            with pytest.raises(KVDepotError) as exc_info:
                other.query_prefetch_status("mine")
            assert exc_info.value.code == ErrorCode.UNKNOWN_SESSION
        assert c.query_prefetch_status("mine") == 0


def test_closing_the_client_drops_its_sessions(srv, seed):
    with srv.client() as c:
        tokens, kv = _stored(c, 3, seed)
        assert c.lookup_chunks(c.hashes(tokens), session_id="z") == 3
        assert srv.status()["leases"] == 1
    st = srv.status()  # UNREGISTER released the session's locks
    assert st["leases"] == 0 and st["sessions"] == 0 and st["contexts"] == 0
    with srv.client() as c:
        assert_bytes_equal(c.retrieve(tokens), kv)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_retrieve_from_after_the_freed_locks(srv, transport, seed):
    """The engine frees the locks of the chunks it already has and retrieves the rest (start=k)."""
    with srv.client(transport=transport) as c:
        tokens, kv = _stored(c, 5, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="e") == 5
        assert c.free_lookup_locks("e", 0, 2) == 2
        with c.prepare_retrieve(hashes, session_id="e", start=2) as views:
            assert len(views) == 3
            for i, v in enumerate(views, start=2):
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        c.end_session("e")
        st = srv.status()
        assert st["leases"] == 0 and st["l1"]["read_locked"] == 0


_FREED_FIRST_REASON = (
    "TransferModule._lock_for_retrieve reuses the session's lease whenever _same_prefix holds, and "
    "ObjectTable.read_lease_offsets stops at the first released key, so after free_lookup_locks(s, 0, 1) a "
    "session retrieve from chunk 0 gets 0 offsets"
)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_retrieve_after_freeing_the_first_lock_still_finds_the_data(srv, transport, seed):
    with srv.client(transport=transport) as c:
        tokens, kv = _stored(c, 4, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="f") == 4
        assert c.free_lookup_locks("f", 0, 1) == 1
        with c.prepare_retrieve(hashes, session_id="f") as views:
            assert len(views) == 4
            for i, v in enumerate(views):
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        c.end_session("f")


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_session_retrieve_never_leaks_its_lease(srv, transport, seed):
    with srv.client(transport=transport) as c:
        tokens, _ = _stored(c, 4, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="g") == 4
        assert c.free_lookup_locks("g", 0, 1) == 1
        with c.prepare_retrieve(hashes, session_id="g"):
            pass
        c.end_session("g")
        st = srv.status()
        assert st["leases"] == 0, "a read lease outlived its session and its retrieve"
        assert st["l1"]["read_locked"] == 0


@pytest.mark.parametrize("limit,expected", [(0, 4), (2, 2), (9, 4)])
def test_prepare_retrieve_limit_caps_the_chunks_locked(srv, seed, limit, expected):
    from kvdepot.protocol import messages as m

    with srv.client(transport="shm") as c:
        tokens, _ = _stored(c, 4, seed)
        req = m.PrepareRetrieveRequest(context_id=0, keys=list(c.hashes(tokens)), limit=limit)
        reply = c.link.request(req)
        assert len(reply.offsets) == expected
        assert srv.status()["leases"] == 1
        c.link.request(m.CommitRetrieveRequest(context_id=0, lease_id=reply.lease_id))
        assert srv.status()["leases"] == 0


def test_a_session_whose_client_freed_every_lock_is_not_counted_as_expired(srv, seed):
    """The vLLM connector frees a hit's locks once its workers have loaded it (or vLLM's own cache had
    it all), and ends the session when the request finishes, often long after. The server's sweep
    took such a session, whose lease ended with its last freed lock, for one nobody ended and counted
    it in ``request_failures.sessions_expired``: a failure on every hit, though no request recomputed."""
    with srv.client() as c:
        tokens, _ = _stored(c, 3, seed)
        hashes = c.hashes(tokens)
        assert c.lookup_chunks(hashes, session_id="loaded") == 3
        assert c.free_lookup_locks("loaded", 0, 1) == 1
        assert c.free_lookup_locks("loaded", 1) == 2  # the last lock: the lease ends
        wait_until(lambda: srv.status()["sessions"] == 0, 10, what="the freed session to go")
        st = srv.status()
        assert st["request_failures"]["sessions_expired"] == 0, st["request_failures"]
        assert (st["leases"], st["l1"]["read_locked"]) == (0, 0)
        c.end_session("loaded")  # the request finishes
        assert srv.status()["request_failures"]["sessions_expired"] == 0


def test_a_session_nobody_ends_goes_with_its_lock_and_a_renewed_one_stays(make_server, seed):
    """An engine that gave up on a LOOKUP's reply never ends its session: the server drops it once its
    lock has expired (it used to keep it for the client's lifetime), while a session whose locks the
    client renews stays however long the request queues."""
    srv = make_server("--lease-ttl-s", "1", "--heartbeat-interval-s", "0.2")
    with srv.client() as c:
        tokens, kv = _stored(c, 3, seed)
        hashes = c.hashes(tokens)
        c.renew_sessions = lambda: ["kept"]
        assert c.lookup_chunks(hashes, session_id="lost") == 3
        assert c.lookup_chunks(hashes[:2], session_id="kept") == 2
        assert srv.status()["sessions"] == 2
        wait_until(lambda: srv.status()["sessions"] == 1, 10, what="the abandoned session to be dropped")
        st = srv.status()
        assert st["leases"] == 1 and st["l1"]["read_locked"] == 2  # the renewed one holds its locks still
        assert c.query_prefetch_status("kept") == 2
        with pytest.raises(KVDepotError) as err:
            c.query_prefetch_status("lost")
        assert err.value.code == ErrorCode.UNKNOWN_SESSION
        with c.prepare_retrieve(hashes, session_id="lost") as views:  # a late retrieve locks afresh
            assert len(views) == 3
            for i, v in enumerate(views):
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        c.end_session("kept")
        st = srv.status()
        assert (st["sessions"], st["leases"], st["l1"]["read_locked"]) == (0, 0, 0)
