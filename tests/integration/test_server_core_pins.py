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


ADMIN_TOKEN = "pins-admin-token"


def test_an_open_read_of_the_pins_hands_out_no_ids_when_a_token_guards_the_admin_port(make_server, seed):
    """With an admin token, ``DELETE /cache/pins/{id}`` needs it, but ``GET /cache/pins`` (open to anyone
    who may read /status) listed every pin's id, and an id is all an UNPIN over RPC asks for: any client
    (another tenant's engine) read the ids and ended every pin. The open listing shows the pins without
    their ids; the operator's token still reads them."""
    srv = make_server("--admin-token", ADMIN_TOKEN)
    tokens = make_tokens(2 * CHUNK, seed)
    with srv.client() as owner, srv.client() as other:
        assert owner.store(tokens, make_kv(LAYOUT, len(tokens), seed), cache_salt="tenant-a") == len(tokens)
        pin_id = owner.pin(tokens, cache_salt="tenant-a").pin_id
        r = httpx.get(f"{srv.http}/cache/pins", timeout=10)
        assert r.status_code == 200, r.text
        listed = r.json()["pins"]
        assert [(p["cache_salt"], p["state"], p["pinned"]) for p in listed] == [("tenant-a", "hard", 2)]  # still shown
        assert pin_id not in [p.get("id") for p in listed], "an open GET hands out the pin's id, its capability"
        for stolen in {p.get("id") for p in listed} - {None}:  # what a stranger would do with one
            other.unpin(stolen)
        for wrong in ({}, {"Authorization": "Bearer not-the-token"}):
            assert pin_id not in [p.get("id") for p in httpx.get(f"{srv.http}/cache/pins", headers=wrong, timeout=10).json()["pins"]]
        r = httpx.get(f"{srv.http}/cache/pins", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        assert [(p["id"], p["state"]) for p in r.json()["pins"]] == [(pin_id, "hard")], "the operator reads the ids"
        assert owner.unpin(pin_id).state == "released"
