"""A pin id is its pin's capability (whoever holds it may unpin it: a pin outlives the client that made
it), so ids must not be guessable: with a counter any client could end every other client's pins by
counting. Ids are random; a guessed one is no pin, and the pins stay."""

from __future__ import annotations

import httpx
import pytest

from kvdepot.errors import IllegalTransition, UnknownLease

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens


def pins(srv) -> dict[int, dict]:
    r = httpx.get(f"{srv.http}/cache/pins", timeout=10)
    assert r.status_code == 200, r.text
    return {p["id"]: p for p in r.json()["pins"]}


def test_pin_ids_cannot_be_guessed_and_their_holder_unpins(server, seed):
    tokens = make_tokens(2 * CHUNK, seed)
    with server.client() as maker, server.client() as other:
        assert maker.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == len(tokens)
        ids = [maker.pin(tokens).pin_id for _ in range(4)]
        assert len(set(ids)) == 4 and all(0 < i < 2**53 for i in ids)  # exact in a browser's JSON
        ends = sorted(ids)
        # What a client without the ids would try: small numbers, and (had it seen one id) its neighbours.
        for guess in sorted(set(range(1, 65)) | {ids[0] + d for d in (-2, -1, 1, 2)}):
            with pytest.raises(UnknownLease, match=f"no pin {guess}"):
                other.unpin(guess)
        assert sorted(pins(server)) == ends, "a guessed id ended a pin"
        # The id is the capability: another process of the application that was handed it may end it.
        assert other.unpin(ids[0]).state == "released"
        with pytest.raises(IllegalTransition, match="released"):
            maker.unpin(ids[0])
        assert maker.unpin(ids[1]).state == "released"
        r = httpx.request("DELETE", f"{server.http}/cache/pins/{ids[2]}", json={}, timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "released", r.text  # the operator unpins any pin
        assert sorted(pins(server)) == [ids[3]]
