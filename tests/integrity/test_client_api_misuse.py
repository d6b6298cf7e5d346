"""The public client API misused as users do: what it must never do is store bytes the caller did not
mean under the caller's tokens (another prompt's KV is a wrong answer, and across tenants a leak)."""

from __future__ import annotations

import numpy as np
import pytest

from support.servers import CHUNK, LAYOUT, as_bits, make_kv, make_tokens


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_replacing_a_slot_instead_of_filling_it_is_refused(server, transport, seed):
    # ``slots[i] = chunk`` swaps the list's entry and writes nothing: the slot (an arena slot, or a reused
    # staging buffer) kept whatever an earlier object left there, and the commit stored that under these
    # tokens. Here the earlier object is another prompt's, whose KV was then served for this prompt.
    other, mine = make_tokens(2 * CHUNK, seed), make_tokens(2 * CHUNK, seed + 1)
    other_kv, my_kv = make_kv(LAYOUT, 2 * CHUNK, seed), make_kv(LAYOUT, 2 * CHUNK, seed + 1)
    with server.client(transport=transport) as c:
        assert c.store(other, other_kv) == 2 * CHUNK
        c.clear()  # its slots (or staging buffer) go back to be handed out again
        with pytest.raises(TypeError, match=r"slots\[i\]\[\.\.\.\]"):
            with c.prepare_store(mine) as slots:
                for i in range(len(slots)):
                    slots[i] = my_kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup(mine) == 0, "the block raised: nothing may be stored"
        got = c.retrieve(mine)
        assert got.shape[2] == 0 or not np.array_equal(as_bits(got), as_bits(other_kv[:, :, : got.shape[2]]))
        # Filled in place, the same chunks are stored as given.
        with c.prepare_store(mine) as slots:
            for i, slot in enumerate(slots):
                slot[...] = my_kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert np.array_equal(as_bits(c.retrieve(mine)), as_bits(my_kv))
