"""``connectors/vllm/device.py`` (``DeviceKV``), the parts that decide and hold things rather than copy:
the path chosen when registering the GPU cache fails otherwise than by a refusal of the server's, and the
worker's pin of the arena mapping across a server restart (a new arena, maybe mapped at the old address).

On the CPU the cache is CPU tensors, CUDA's host registration a fake (``FakeCudart``, as the runtime
behaves), and ``on_gpu`` is set by hand. What only a GPU shows (torch's ``_share_cuda_`` refusing memory of
vLLM's CuMemAllocator; a pin that CUDA really drops before the munmap) is not in tests/gpu: it needs vLLM's
allocator, or a server restarted under a live worker."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvdepot.client.options import Transport
from kvdepot.client.transfer import ShmPath
from kvdepot.connectors.vllm.device import DeviceKV
from kvdepot.errors import TransportUnavailable
from kvdepot.gpu import runtime
from kvdepot.layout import PagedFormat

from support.cudart import FakeCudart


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


class Arena:
    """A mapped arena as a worker's ShmPath holds it: its nonce, its bytes, and the unmap at close."""

    forked = False

    def __init__(self, nonce: bytes, buffer: np.ndarray, calls: list[str]) -> None:
        self.nonce, self.buffer, self.calls = nonce, buffer, calls

    def close(self) -> None:
        self.calls.append("unmap")
        self.buffer = np.empty(0, dtype=np.uint8)


@pytest.fixture
def cuda_pins(monkeypatch):
    calls: list[str] = []
    fake = FakeCudart(calls)
    monkeypatch.setattr(runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(runtime, "_clear_last_error", lambda: None)
    monkeypatch.setattr(runtime, "_pins", {})
    return fake


def shm_client(path: ShmPath) -> SimpleNamespace:
    client = SimpleNamespace(transport="shm", link=SimpleNamespace(path=path))
    client.arena_memory = lambda: client.link.path.arena.buffer
    return client


def test_a_restarted_servers_arena_at_the_old_address_is_pinned_anew_after_the_old_pin_is_let_go(cuda_pins):
    """The worker's pin is of one arena, not of an address: the old mapping's registration goes before
    it is unmapped (else CUDA keeps the old pages registered under the address), and the new arena,
    mapped where the old one was, is registered afresh (else copies DMA into the old pages)."""
    calls = cuda_pins.calls
    kv = device_kv(Transport.SHM)
    kv.on_gpu = True  # the CPU tensors stand for a GPU cache
    memory = np.zeros(1 << 16, dtype=np.uint8)
    address = memory.__array_interface__["data"][0]
    old = ShmPath(None, Arena(b"old", memory, calls), None)
    client = shm_client(old)
    kv.host_path(client)
    kv.host_path(client)  # the same arena: held, not registered twice
    assert calls == ["register"] and cuda_pins.registered == {address: memory.nbytes}

    old.close()  # the server restarted: the client closes the old path (choose_path)
    assert calls == ["register", "unregister", "unmap"]  # let go while still mapped
    client.link.path = ShmPath(None, Arena(b"new", memory, calls), None)  # mapped at the same address
    kv.host_path(client)
    assert calls == ["register", "unregister", "unmap", "register"] and cuda_pins.registered == {address: memory.nbytes}

    kv.unpin()
    assert cuda_pins.registered == {}
    client.link.path.close()  # nothing pinned any more: nothing to let go
    assert calls[-2:] == ["unregister", "unmap"]


def test_a_pin_of_another_arena_is_let_go_even_if_its_path_never_said(cuda_pins):
    calls = cuda_pins.calls
    kv = device_kv(Transport.SHM)
    kv.on_gpu = True
    memory = np.zeros(1 << 16, dtype=np.uint8)
    client = shm_client(ShmPath(None, Arena(b"one", memory, calls), None))
    kv.host_path(client)
    client.link.path = ShmPath(None, Arena(b"two", memory, calls), None)
    kv.host_path(client)
    assert calls == ["register", "unregister", "register"]
    closed = ShmPath(None, Arena(b"three", memory, calls), None)
    closed.close()
    client.link.path = closed  # a path that closed before the pin: nothing pinned, nothing kept
    assert kv.host_path(client) is None and cuda_pins.registered == {}
    assert not closed.before_close(lambda: None)
