"""Where CUDA graphs are wanted, read without a GPU: the environment's switch, and that a CPU mover
never makes any (its copies are synchronous, straight into host memory)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdepot.gpu.graphs import graphs_enabled
from kvdepot.gpu.mover import BlockMover
from kvdepot.gpu.paged import DevicePagedCache


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("on", True), ("0", False), ("off", False), (" False ", False), ("no", False)])
def test_the_environment_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("KVDEPOT_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("KVDEPOT_CUDA_GRAPHS", value)
    assert graphs_enabled() is on


def test_a_cpu_mover_of_layers_apart_makes_no_graphs():
    layers = [torch.arange(2 * 8 * 4 * 2 * 4, dtype=torch.int16).view(2, 8, 4, 2, 4) + i for i in range(4)]
    mover = BlockMover(DevicePagedCache(layers, "kv_first", 4), 1, 1 << 20, graphs=True)
    out = [np.zeros((2, 4, 4, 2, 4), dtype=np.int16) for _ in range(3)]
    mover.save(mover.cache.check_ids([[5, 1, 7]], 3), out).wait()
    assert mover.graphs is None
    assert np.array_equal(out[1][:, 2], layers[2][:, 1].numpy())
