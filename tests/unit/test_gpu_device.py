"""``connectors/vllm/device.py`` (``DeviceKV``), the parts that decide and hold things rather than copy:
the path chosen when registering the GPU cache fails otherwise than by a refusal of the server's.

On the CPU the cache is CPU tensors and the client a fake. What only a GPU shows (torch's ``_share_cuda_``
refusing memory of vLLM's CuMemAllocator) is not in tests/gpu: it needs vLLM's allocator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvdepot.client.options import Transport
from kvdepot.connectors.vllm.device import DeviceKV
from kvdepot.errors import TransportUnavailable
from kvdepot.layout import PagedFormat


def device_kv(transport: Transport) -> DeviceKV:
    return DeviceKV([torch.zeros(2, 8, 4, 1, 8) for _ in range(2)], PagedFormat.KV_FIRST, 4, 1, transport, 1 << 20)


def test_a_cache_torch_cannot_share_falls_back_under_auto_and_is_refused_by_name_under_cuda_ipc():
    """vLLM's sleep mode allocates the cache through its CuMemAllocator, which torch's ``_share_cuda_``
    refuses with a RuntimeError: auto takes the worker's own path, cuda_ipc says why it cannot be had,
    and neither stops the engine's start."""

    def register_kv_cache(*args):
        raise RuntimeError("cannot share memory not allocated by the CUDA caching allocator")

    client = SimpleNamespace(transport="inline", register_kv_cache=register_kv_cache, arena_memory=lambda: None)
    auto = device_kv(Transport.AUTO)
    assert auto.server_path(client) is None and auto.path == "inline"
    asked = device_kv(Transport.CUDA_IPC)
    for _ in range(2):  # said again at every transfer on that client
        with pytest.raises(TransportUnavailable, match="cuda_ipc: this cache cannot be shared.*RuntimeError: cannot share memory"):
            asked.server_path(client)
    assert asked.path == "cuda_ipc (refused)"
