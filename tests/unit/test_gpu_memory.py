"""``kvdepot.gpu.memory`` and ``runtime``: what a worker exports of its cache, and the checks the server
makes before it maps a byte of it. A host cache in a ``HostCacheFile`` is the CPU form of the same path
(CUDA IPC handles are exercised on a GPU, in tests/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvdepot.errors import BadRequest, TransportUnavailable
from kvdepot.gpu.memory import HOST_FILE_PREFIX, HostCacheFile, export_cache, layer_tensor, open_memory
from kvdepot.protocol import messages as m

SHAPE = (2, 6, 4, 2, 8)  # kv_first: [K, blocks, block_size, H, D]


@pytest.fixture
def host_cache(tmp_path):
    cache = HostCacheFile.create(str(tmp_path), 3, SHAPE, torch.bfloat16)
    for i, t in enumerate(cache.layers):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + i)
    yield cache
    cache.close()


def test_a_host_cache_is_exported_as_its_file_and_the_server_maps_the_same_bytes(host_cache, tmp_path):
    exported = export_cache(host_cache.layers, "kv_first")
    assert len(exported.memories) == 1  # three layers, one file
    mem = exported.memories[0]
    assert isinstance(mem, m.HostFileMemory) and mem.path == host_cache.path and mem.offset == 0
    layer_bytes = host_cache.layers[0].numel() * 2
    assert [s.offset for s in exported.layers] == [0, layer_bytes, 2 * layer_bytes]
    assert exported.layers[2].shape == list(SHAPE) and exported.layers[2].dtype == "bfloat16"

    opened = open_memory(mem, {}, str(tmp_path))
    views = [layer_tensor(opened, spec) for spec in exported.layers]
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(views, host_cache.layers))
    views[1][1, 5, 3, 1, 7] = 42.0  # the server's writes are the worker's blocks
    assert host_cache.layers[1][1, 5, 3, 1, 7].item() == 42.0
    opened.close()


def test_a_cpu_tensor_outside_a_kvdepot_file_cannot_be_exported():
    with pytest.raises(TransportUnavailable, match="HostCacheFile"):
        export_cache([torch.zeros(SHAPE)], "kv_first")


def test_the_server_maps_only_kvdepot_files_in_its_own_directory(host_cache, tmp_path):
    mem = export_cache(host_cache.layers, "kv_first").memories[0]
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    with pytest.raises(BadRequest, match="directly in"):
        open_memory(mem, {}, str(elsewhere))  # not in this server's shm dir
    other = tmp_path / "secrets"
    other.write_bytes(b"x" * 4096)
    with pytest.raises(BadRequest, match=HOST_FILE_PREFIX):
        open_memory(m.HostFileMemory(path=str(other), size=4096), {}, str(tmp_path))
    link = tmp_path / f"{HOST_FILE_PREFIX}link"
    os.symlink(other, link)
    with pytest.raises(BadRequest, match="directly in|cannot open"):
        open_memory(m.HostFileMemory(path=str(link), size=4096), {}, str(tmp_path))
    with pytest.raises(BadRequest, match="holds"):
        open_memory(m.HostFileMemory(path=mem.path, size=mem.size + 1), {}, str(tmp_path))
    with pytest.raises(TransportUnavailable, match="does not map host"):
        open_memory(mem, {}, None)


def test_a_layer_must_lie_inside_its_memory(host_cache, tmp_path):
    exported = export_cache(host_cache.layers, "kv_first")
    opened = open_memory(exported.memories[0], {}, str(tmp_path))
    spec = exported.layers[2]
    for bad in (
        m.PagedLayerSpec(memory=0, offset=spec.offset + 2, shape=spec.shape, stride=spec.stride, dtype="bfloat16", format="kv_first"),
        m.PagedLayerSpec(memory=0, offset=0, shape=[2, 600, 4, 2, 8], stride=spec.stride, dtype="bfloat16", format="kv_first"),
        m.PagedLayerSpec(memory=0, offset=0, shape=spec.shape, stride=[-1, 1, 1, 1, 1], dtype="bfloat16", format="kv_first"),
        m.PagedLayerSpec(memory=0, offset=1, shape=spec.shape, stride=spec.stride, dtype="bfloat16", format="kv_first"),
        m.PagedLayerSpec(memory=0, offset=0, shape=spec.shape, stride=spec.stride, dtype="complex_thing", format="kv_first"),
    ):
        with pytest.raises(BadRequest):
            layer_tensor(opened, bad)


def test_cuda_memory_on_a_gpu_the_server_does_not_see_is_refused_by_name():
    mem = m.CudaIpcMemory(device_uuid="GPU-not-here", handle=b"\x00" * 64, size=4096, offset=0)
    with pytest.raises(TransportUnavailable, match="GPU-not-here"):
        open_memory(mem, {"GPU-other": 0}, "/dev/shm")


def test_without_torch_the_path_says_what_to_install():
    """A process without torch (the server's core needs none): a clear refusal naming the extra."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvdepot.gpu import runtime\n"
        "assert runtime.torch_or_none() is None and runtime.cuda_devices() == {}\n"
        "try:\n    runtime.require_torch('the server-driven path')\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TransportUnavailable" in out.stdout and "kvdepot[gpu]" in out.stdout


class FakeCudart:
    """CUDA's host registration as the runtime behaves: a range registered twice, or overlapping another
    registration, is refused (712) and the refusal becomes the thread's last error."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append("register")
        if any(a < address + size and address < a + s for a, s in self.registered.items()):
            return 712
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append("unregister")
        return 0 if self.registered.pop(address, None) is not None else 713


def test_a_range_is_registered_once_per_process_and_unregistered_by_its_last_holder(monkeypatch):
    from kvdepot.gpu import runtime

    fake = FakeCudart()
    cleared = []
    monkeypatch.setattr(runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(runtime, "_clear_last_error", lambda: cleared.append(True))
    monkeypatch.setattr(runtime, "_pins", {})

    writer, reader = runtime.pin(4096, 1 << 20), runtime.pin(4096, 1 << 20)  # two holders of one arena mapping
    assert writer.pinned and reader.pinned and fake.calls == ["register"]
    writer.close()
    writer.close()  # a second close is no second let-go
    assert fake.registered == {4096: 1 << 20} and fake.calls == ["register"]
    reader.close()
    assert fake.registered == {} and fake.calls == ["register", "unregister"]
    assert not cleared

    whole = runtime.pin(4096, 1 << 20)
    overlapping = runtime.pin(8192, 4096)  # CUDA refuses it: pageable, and its error is consumed at once
    assert whole.pinned and not overlapping.pinned and cleared == [True]
    overlapping.close()  # an unpinned holder unregisters nothing
    assert fake.registered == {4096: 1 << 20}
    whole.close()
    assert fake.registered == {}
