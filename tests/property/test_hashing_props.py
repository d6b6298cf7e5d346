"""Properties of the hash chain: every hash depends on all earlier tokens and on nothing later."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.hashing import chunk_hashes

token = st.integers(min_value=0, max_value=2**32 - 1)
tokens_lists = st.lists(token, min_size=0, max_size=40)
chunk_sizes = st.integers(min_value=1, max_value=8)
algorithms = st.sampled_from(["sha256", "blake3", "xxh3_128"])


@settings(max_examples=150, deadline=None)
@given(st.lists(token, min_size=1, max_size=40), chunk_sizes, algorithms, st.data())
def test_changing_one_token_changes_exactly_the_hashes_from_its_chunk_on(tokens, chunk_size, algorithm, data):
    t = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1), label="position")
    new = data.draw(token.filter(lambda v: v != tokens[t]), label="new value")
    changed = list(tokens)
    changed[t] = new
    a = chunk_hashes(tokens, chunk_size, algorithm)
    b = chunk_hashes(changed, chunk_size, algorithm)
    assert len(a) == len(b) == len(tokens) // chunk_size
    first = t // chunk_size
    for i, (x, y) in enumerate(zip(a, b)):
        if i < first:
            assert x == y, f"chunk {i} < {first} changed"
        else:
            assert x != y, f"chunk {i} >= {first} did not change"


@settings(max_examples=100, deadline=None)
@given(tokens_lists, chunk_sizes, algorithms, st.data())
def test_prefix_continuation_equals_hashing_the_whole(tokens, chunk_size, algorithm, data):
    whole = chunk_hashes(tokens, chunk_size, algorithm)
    n_chunks = len(tokens) // chunk_size
    k = data.draw(st.integers(min_value=0, max_value=n_chunks), label="split chunk")
    head = chunk_hashes(tokens[: k * chunk_size], chunk_size, algorithm)
    tail = chunk_hashes(tokens[k * chunk_size :], chunk_size, algorithm, prefix=head[-1] if head else b"")
    assert head + tail == whole


@settings(max_examples=100, deadline=None)
@given(tokens_lists, chunk_sizes, algorithms)
def test_list_and_numpy_agree_and_extension_keeps_prefix(tokens, chunk_size, algorithm):
    a = chunk_hashes(tokens, chunk_size, algorithm)
    assert chunk_hashes(np.array(tokens, dtype=np.uint64), chunk_size, algorithm) == a
    longer = chunk_hashes(tokens + [1] * chunk_size, chunk_size, algorithm)
    assert longer[: len(a)] == a and len(longer) == len(a) + 1
