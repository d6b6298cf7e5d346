"""The soak client's self-checking data: every chunk's bytes follow from its id, so a chunk served for
another id, or partly overwritten, is caught; and its workload keeps its ids apart from every other client's."""

from __future__ import annotations

import numpy as np

from kvdepot.bench.soak_client import SYSTEM_CHUNKS, SYSTEM_PROMPTS, Tally, Workload, _check, chunk_pattern


def test_patterns_of_two_ids_differ_almost_everywhere():
    for a, b in [(0, 1), (5, 5 + (1 << 16)), (1 << 16 | 1, 2 << 16 | 1)]:
        same = np.count_nonzero(chunk_pattern(a) == chunk_pattern(b))
        assert same < chunk_pattern(a).size // 1000, (a, b, same)
    assert np.array_equal(chunk_pattern(7), chunk_pattern(7))


def test_check_counts_a_wrong_chunk_and_a_partly_overwritten_one():
    tally = Tally()
    good, wrong, torn = chunk_pattern(3), chunk_pattern(9), chunk_pattern(5).copy()  # 9 served for 4
    torn.reshape(-1)[-1] ^= 1  # one bit of the last element
    _check(tally, [3, 4, 5], [good, wrong, torn.view(np.float16)], "test")
    assert tally.counts["verified_chunks"] == 1 and tally.counts["mismatched_chunks"] == 2
    assert len(tally.mismatch_examples) == 2


def test_workload_ids_are_the_clients_own_past_the_shared_system_prompts():
    a, b = Workload(uid=1, seed=0), Workload(uid=2, seed=0)
    shared = set(range(SYSTEM_PROMPTS * SYSTEM_CHUNKS))
    seen_a = {cid for _ in range(200) for cid in a.next_prompt()}
    seen_b = {cid for _ in range(200) for cid in b.next_prompt()}
    assert seen_a & seen_b <= shared and seen_a - shared and seen_b - shared
    assert all(cid >> 16 == 1 for cid in seen_a - shared)
