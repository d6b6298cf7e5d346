"""``kvdepot.gpu.memory`` and ``runtime``: what a worker exports of its cache, and the checks the server
makes before it maps a byte of it. A host cache in a ``HostCacheFile`` is the CPU form of the same path
(CUDA IPC handles are exercised on a GPU, in tests/gpu).

A CUDA memory's checks run here with torch's two CUDA calls faked (``FakeIpc``: ``_new_shared_cuda``
hands back a CPU storage, and the driver's ``cuMemGetAddressRange`` answers from the test): the handle's
form, the offset's alignment, the declared range against the extent of the mapping, and the fields of
the worker's that never reach torch. What only a GPU shows (the driver's real extent of an IPC mapping,
a doctored registration refused by a real server) is in tests/gpu/test_cuda_paths.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from kvdepot.errors import BadRequest, TransportUnavailable
from kvdepot.gpu import memory
from kvdepot.gpu.memory import HOST_FILE_PREFIX, HostCacheFile, export_cache, layer_tensor, open_memory
from kvdepot.protocol import messages as m

from support.cudart import FakeCudart

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


HANDLE = bytes([2]) + b"c" + bytes(range(64))  # torch's shareable handle of cudaMalloc memory: version, kind, cudaIpcMemHandle_t


class FakeIpc:
    """torch's CUDA IPC open and the driver's extent query, on the CPU: ``_new_shared_cuda`` returns a CPU
    storage of the declared size (placed as torch places it: ``offset`` bytes past the mapping's start),
    and the allocation holding an address is ``extent`` bytes from that start (``base`` to move it)."""

    def __init__(self, monkeypatch, extent: int, base_shift: int = 0, fails: bool = False) -> None:
        self.opened: list[tuple] = []
        self.extent, self.base_shift, self.fails = extent, base_shift, fails
        self.mapping = 0
        monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", self.new_shared_cuda, raising=False)
        monkeypatch.setattr(memory, "allocation_range", self.allocation_range)

    def new_shared_cuda(self, index, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync):
        # torch's own argument check (THPStorage_newSharedCuda): bytes handles, ints, a bool, or a TypeError
        if not (isinstance(handle, bytes) and isinstance(rc_handle, bytes) and isinstance(event_handle, bytes)
                and isinstance(event_sync, bool) and all(isinstance(v, int) for v in (index, size, offset, rc_offset))):  # fmt: skip
            raise TypeError("_new_shared in CUDA mode received an invalid combination of arguments")
        if event_sync and len(event_handle) != 64:
            raise RuntimeError("incorrect handle size")
        self.opened.append((index, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync))
        storage = torch.UntypedStorage(size)
        self.mapping = storage.data_ptr() - offset
        return storage

    def allocation_range(self, index: int, address: int) -> tuple[int, int]:
        if self.fails:
            raise OSError("cuMemGetAddressRange failed (CUDA driver error 1)")
        return self.mapping + self.base_shift, self.extent


def cuda_memory(**fields) -> m.CudaIpcMemory:
    spec = {"device_uuid": "GPU-here", "handle": HANDLE, "size": 4096, "offset": 512} | fields
    return m.CudaIpcMemory(**spec)


def test_cuda_memory_inside_its_allocation_opens_as_the_declared_range(monkeypatch):
    fake = FakeIpc(monkeypatch, extent=8192)
    opened = open_memory(cuda_memory(), {"GPU-here": 0}, None)
    assert opened.data.numel() == 4096 and opened.device_index == 0 and len(fake.opened) == 1
    raw = FakeIpc(monkeypatch, extent=4096)  # torch before its shareable handles: the 64 bytes alone
    assert open_memory(cuda_memory(handle=bytes(64), offset=0), {"GPU-here": 0}, None).data.numel() == 4096
    assert raw.opened[0][1] == bytes(64)


@pytest.mark.parametrize(
    ("fields", "extent", "shift", "why"),
    [
        ({"size": 8192}, 8192, 0, "allocation"),  # declares more than the allocation holds past its offset
        ({"offset": 8192}, 8192, 0, "allocation"),  # starts at the end of it
        ({"offset": 1 << 40}, 1 << 50, 4096, "allocation"),  # walked out into another allocation of the server's
        ({"offset": 100}, 1 << 20, 0, "multiples of 256"),  # not where any allocation of torch's starts
        ({"size": 0}, 8192, 0, "4096|0 bytes"),
        ({"offset": -512}, 8192, 0, "-512"),
    ],
)
def test_cuda_memory_outside_its_allocation_is_refused_before_a_kernel_sees_it(monkeypatch, fields, extent, shift, why):
    """The server's kernels read and write wherever a registered range points: the worker's declared size
    and offset count only where the driver's extent of the mapping holds them."""
    FakeIpc(monkeypatch, extent=extent, base_shift=shift)
    with pytest.raises(BadRequest, match=why):
        open_memory(cuda_memory(**fields), {"GPU-here": 0}, None)


def test_cuda_memory_the_driver_cannot_place_is_refused(monkeypatch):
    FakeIpc(monkeypatch, extent=8192, fails=True)
    with pytest.raises(BadRequest, match="driver does not place it"):
        open_memory(cuda_memory(), {"GPU-here": 0}, None)


@pytest.mark.parametrize(
    ("handle", "error", "why"),
    [
        (bytes(63), BadRequest, "63 bytes"),
        (bytes([2]) + b"c" + bytes(63), BadRequest, "65 bytes"),
        (bytes([2]) + b"x" + bytes(64), BadRequest, "66 bytes"),
        (b"", BadRequest, "0 bytes"),
        (bytes([2]) + b"e" + bytes(200), TransportUnavailable, "expandable_segments"),
    ],
    ids=["short", "cut", "unknown-kind", "empty", "expandable-segment"],
)
def test_a_cuda_handle_of_another_form_is_refused_before_torch_opens_it(monkeypatch, handle, error, why):
    fake = FakeIpc(monkeypatch, extent=8192)
    with pytest.raises(error, match=why):
        open_memory(cuda_memory(handle=handle), {"GPU-here": 0}, None)
    assert fake.opened == []


def test_the_workers_reference_count_fields_never_reach_torch(monkeypatch):
    """torch's deleter of an opened storage shm_opens the reference count's name in the server and
    decrements an int64 at its offset: a worker could name the arena (its header) or any file of the
    server's user. The server hands torch no name (the deleter's failed open is caught) and offset 0."""
    fake = FakeIpc(monkeypatch, extent=8192)
    for name, offset in ((b"/kvdepot-arena-1234-abcdef", 3), (b"/torch_99_1_0", 1 << 40), (b"", 0)):
        open_memory(cuda_memory(ref_counter_handle=name, ref_counter_offset=offset), {"GPU-here": 0}, None)
    assert [(o[4], o[5]) for o in fake.opened] == [(b"", 0)] * 3


def test_a_memory_with_or_without_an_event_reaches_torch_as_torch_takes_it(monkeypatch):
    """torch takes the event handle as bytes only. torch's own sharing always sends 64 bytes (unset when
    no event is waited on); an empty one (a client of its own, with no event) used to go as None: a
    TypeError, and an internal-error reply instead of a registration or a clear refusal."""
    fake = FakeIpc(monkeypatch, extent=8192)
    open_memory(cuda_memory(), {"GPU-here": 0}, None)
    open_memory(cuda_memory(event_handle=b"\x07" * 64, event_sync_required=True), {"GPU-here": 0}, None)
    assert [(o[6], o[7]) for o in fake.opened] == [(b"", False), (b"\x07" * 64, True)]
    with pytest.raises(BadRequest, match="event handle of 0 bytes"):  # an event to wait on, and no handle of it
        open_memory(cuda_memory(event_sync_required=True), {"GPU-here": 0}, None)
    with pytest.raises(BadRequest, match="event handle of 10 bytes"):
        open_memory(cuda_memory(event_handle=bytes(10), event_sync_required=True), {"GPU-here": 0}, None)
    assert len(fake.opened) == 2


def test_the_extent_check_alone():
    spec = cuda_memory(size=4096, offset=512)
    memory.check_cuda_extent(spec, 10_512, 10_000, 4608)  # ends exactly at the allocation's end
    for address, base, extent in ((10_512, 10_000, 4607), (10_512, 10_256, 1 << 30), (10_000, 10_000, 1 << 30)):
        with pytest.raises(BadRequest):
            memory.check_cuda_extent(spec, address, base, extent)


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


def test_a_torch_that_does_not_import_is_no_torch_and_says_why(tmp_path):
    """An installed torch whose import fails otherwise than ImportError (a missing CUDA library is an
    OSError) must not stop a server on a GPU host: no torch, the GPU path not offered, the cause logged
    once and named by the refusal."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise OSError("libcudnn.so.9: cannot open shared object file")\n')
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from kvdepot.gpu import runtime\n"
        "runtime.nvidia_driver_present = lambda: True  # a GPU host: the server imports torch at start\n"
        "assert runtime.cuda_devices() == {} and runtime.torch_or_none() is None\n"
        "assert not runtime.torch_installed()\n"
        "try:\n    runtime.require_torch('the server-driven path')\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "TransportUnavailable" in out.stdout and "libcudnn.so.9" in out.stdout
    assert out.stderr.count("torch is installed but does not import (OSError: libcudnn.so.9") == 1


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
