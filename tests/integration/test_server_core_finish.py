"""The end of a lease whose context is gone: a COMMIT, ABORT or retrieve's COMMIT that names a context
the client unregistered first still ends the lease (its space comes back now), and the client is told
what happened to it. Before, the request failed with UNKNOWN_CONTEXT and left the lease to its TTL, where
the quarantine kept its space for the life of the client's process."""

from __future__ import annotations

import pytest

from kvdepot.errors import LeaseExpired
from kvdepot.protocol import messages as m
from kvdepot.types import SlotStatus

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens


def held(srv) -> tuple[int, int, int]:
    status = srv.status()
    return status["leases"], status["quarantine"]["leases"], status["l1"]["used_bytes"]


def test_a_finish_after_its_context_was_unregistered_ends_the_lease(server, seed):
    n = 3
    tokens = make_tokens(n * CHUNK, seed)
    with server.client() as c:
        hashes = c.hashes(tokens)
        used = held(server)[2]

        def unregister() -> int:
            cid = c.context_id
            c.link.channel.call(m.UnregisterContextRequest(context_id=cid), timeout_s=10)
            return cid

        for abort in (False, True):  # a COMMIT and an ABORT of a write lease
            reply = c.link.request(m.PrepareStoreRequest(context_id=0, keys=hashes))
            assert reply.statuses == [int(SlotStatus.ALLOCATED)] * n
            cid = unregister()
            with pytest.raises(LeaseExpired) as told:
                c.link.finish(m.CommitStoreRequest(context_id=cid, lease_id=reply.lease_id, abort=abort))
            assert held(server) == (0, 0, used), "the write lease still holds its slots"
            assert f"lease {reply.lease_id} it names was not committed: it was aborted" in str(told.value)
            assert c.lookup(tokens) == 0  # nothing of it became visible (the client registers again here)

        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == n * CHUNK
        used = held(server)[2]
        lock = c.link.request(m.PrepareRetrieveRequest(context_id=0, keys=hashes))
        assert len(lock.offsets) == n
        cid = unregister()
        with pytest.raises(LeaseExpired) as told:
            c.link.finish(m.CommitRetrieveRequest(context_id=cid, lease_id=lock.lease_id))
        assert held(server) == (0, 0, used), "the read lease still holds its locks"
        assert "it was released" in str(told.value)
