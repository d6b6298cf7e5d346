"""An extra pool's page as a kvdepot object (SGLang's hybrid models): the bytes, and nothing else."""

from __future__ import annotations

import numpy as np

from kvdepot.connectors.sglang.pools import gather, scatter


def test_a_page_object_holds_the_page_and_zeros_after_it():
    """The object is rounded up to whole rows; its tail kept what L1 held there before (another object's
    bytes, maybe another tenant's), and took it to every tier and peer."""
    rng = np.random.default_rng(0)
    page = [rng.integers(0, 255, (3, 5), dtype=np.uint8), rng.standard_normal((2, 3)).astype(np.float32)]
    flat = np.full(15 + 24 + 9, 0xAB, np.uint8)  # a slot that held another object's bytes
    gather(page, flat)
    assert not flat[39:].any()
    back = [np.zeros_like(v) for v in page]
    scatter(flat, back)
    assert all(np.array_equal(a, b) for a, b in zip(page, back, strict=True))
