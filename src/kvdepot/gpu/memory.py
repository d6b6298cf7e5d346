"""The memory a worker shares with the server for the server-driven path, and the events that order it.

- **CUDA** (``CudaIpcMemory``): each distinct allocation under the worker's layer tensors is exported with
  torch's CUDA IPC sharing (``UntypedStorage._share_cuda_``: the memory handle, the storage's place in the
  allocation, torch's cross-process reference count) as plain fields; the server opens it on its own
  device with the same UUID (``_new_shared_cuda``). Nothing is pickled either way. The reference count's
  fields are still sent (older servers read them) but ignored: the server never decrements the worker's
  count, so torch in the worker keeps a freed cache's memory (its "limbo") for the worker's life rather
  than reuse it while the server may still map it; a worker frees its cache at its end anyway.
- **Host files** (``HostFileMemory``): a host cache that lives in a shared-memory file the server may
  map: ``kvdepot-kvcache-*`` directly in the server's shm directory, owned by the server's user (the same
  trust the arena has). ``HostCacheFile`` makes one; ``export_cache`` finds the file under any CPU tensor
  from ``/proc/self/maps``. This is how the path runs on a machine without a GPU (the tests, a CPU engine
  that allocates its cache in shared memory).

The server checks what it is given before it reads a byte: a layer must lie inside its memory, the file
inside its directory, the device among its own, and a CUDA memory inside the allocation its handle maps
(the extent the driver reports for the mapping, never the size the worker declared: see
``check_cuda_extent``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from kvdepot.errors import BadRequest, TransportUnavailable
from kvdepot.gpu.runtime import bits_dtype, device_uuid, dtype_name, require_torch, torch_dtype
from kvdepot.layout import PagedFormat
from kvdepot.protocol import messages as m

log = logging.getLogger(__name__)

HOST_FILE_PREFIX = "kvdepot-kvcache-"
CUDA_IPC_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
CUDA_IPC_ALIGNMENT = 256  # cudaMalloc's least alignment (torch's blocks start at multiples of 512 bytes in a segment)
# torch's shareable handle (``_share_cuda_``): a version byte, a kind byte, then the kind's data; torch
# before it sent the 64 bytes of a cudaIpcMemHandle_t alone.
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")


@dataclass(frozen=True)
class ExportedCache:
    """A worker's paged cache as the wire describes it (REGISTER_KV_CACHE)."""

    memories: list[m.CacheMemory]
    layers: list[m.PagedLayerSpec]

    def request(self, block_size: int) -> m.RegisterKVCacheRequest:
        return m.RegisterKVCacheRequest(context_id=0, memories=self.memories, layers=self.layers, block_size=block_size)


# --- the worker's side ---------------------------------------------------------------------------------


def export_cache(layers: Sequence, fmt: PagedFormat | str, groups: Sequence[int] | None = None) -> ExportedCache:
    """Describe ``layers`` (model order) for the server: one memory per distinct storage under them."""
    fmt = PagedFormat(fmt)
    memories: list[m.CacheMemory] = []
    index: dict[int, int] = {}  # storage address -> memory index
    specs = []
    for i, t in enumerate(layers):
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address not in index:
            index[address] = len(memories)
            memories.append(_export_storage(t, storage))
        specs.append(
            m.PagedLayerSpec(
                memory=index[address], offset=t.storage_offset() * t.element_size(), shape=list(t.shape), stride=list(t.stride()),
                dtype=dtype_name(t.dtype), format=fmt.value, group=groups[i] if groups is not None else 0,
            )
        )  # fmt: skip
    return ExportedCache(memories, specs)


def _export_storage(t, storage) -> m.CacheMemory:
    if t.device.type == "cuda":
        device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
        return m.CudaIpcMemory(
            device_uuid=device_uuid(t.device.index if t.device.index is not None else device), handle=bytes(handle), size=int(size),
            offset=int(offset), ref_counter_handle=bytes(rc_handle or b""), ref_counter_offset=int(rc_offset),
            event_handle=bytes(ev_handle or b""), event_sync_required=bool(ev_sync),
        )  # fmt: skip
    if t.device.type == "cpu":
        path, file_offset = _mapped_file(storage.data_ptr(), storage.nbytes())
        return m.HostFileMemory(path=path, size=storage.nbytes(), offset=file_offset)
    raise TransportUnavailable(f"the server-driven path moves CUDA or host-file caches, not {t.device.type} memory")


def _mapped_file(address: int, size: int) -> tuple[str, int]:
    """The file (and offset in it) that memory at ``address`` is a shared mapping of (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                if parts[1][3] != "s" or not os.path.basename(path).startswith(HOST_FILE_PREFIX) or address + size > hi:
                    break
                return path, int(parts[2], 16) + (address - lo)
    raise TransportUnavailable(
        "this host cache is not in a kvdepot shared-memory file (HostCacheFile), so the server cannot reach it: "
        "use the worker-driven shm path, or allocate the cache with kvdepot.gpu.memory.HostCacheFile"
    )


class HostCacheFile:
    """A paged KV cache in host memory the server can map: one shared-memory file in the server's shm
    directory (mode 0600), one ``layer_shape`` tensor per layer inside it, unlinked at ``close``."""

    def __init__(self, path: str, layers: list, base) -> None:
        self.path = path
        self.layers = layers
        self._base = base

    def __repr__(self) -> str:
        return f"HostCacheFile({self.path}, {len(self.layers)} layers)"

    @classmethod
    def create(cls, shm_dir: str, num_layers: int, layer_shape: Sequence[int], dtype) -> HostCacheFile:
        torch = require_torch("a host cache file")
        dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        per = 1
        for n in layer_shape:
            per *= n
        layer_bytes = per * torch.empty((), dtype=dtype).element_size()
        path = os.path.join(shm_dir, f"{HOST_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, num_layers * layer_bytes)  # a full /dev/shm fails here, not as a SIGBUS later
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        base = torch.from_file(path, shared=True, size=num_layers * layer_bytes, dtype=torch.uint8)
        layers = [base[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(*layer_shape) for i in range(num_layers)]
        return cls(path, layers, base)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def new_event():
    """A CUDA event another process can wait on (its handle is ``event_handle(event)``)."""
    torch = require_torch("a CUDA event")
    return torch.cuda.Event(interprocess=True)


class EventRing:
    """A worker's few exported events, reused in turn: ``record`` marks "everything queued on this stream so
    far" and returns the event (this process may wait on it too) and the handle the server waits on. Reusing an event is safe: a wait on a later record of
    it waits for more of the same stream, never less."""

    def __init__(self, size: int = 16) -> None:
        self._events = [new_event() for _ in range(size)]
        self._handles = [event_handle(e) for e in self._events]
        self._next = 0
        self._lock = threading.Lock()

    def record(self, stream=None) -> tuple[object, bytes]:
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._events)
            self._events[i].record(stream)
        return self._events[i], self._handles[i]


def event_handle(event) -> bytes:
    return bytes(event.ipc_handle())


def open_event(handle: bytes, device_index: int):
    torch = require_torch("a CUDA event")
    return torch.cuda.Event.from_ipc_handle(device_index, handle)


# --- the server's side ---------------------------------------------------------------------------------


class OpenedMemory:
    """One registered memory, opened in the server: a flat byte tensor over it (on its device)."""

    def __init__(self, data, device_index: int | None, keep=None) -> None:
        self.data = data
        self.device_index = device_index  # None: host memory
        self._keep = keep  # the mapping a host file's tensor lives in

    def __repr__(self) -> str:
        where = f"cuda:{self.device_index}" if self.device_index is not None else "host file"
        return f"OpenedMemory({self.data.numel()} bytes, {where})"

    def close(self) -> None:
        """Drop the server's references; torch closes a CUDA IPC handle (and a mapping is unmapped) once
        the last tensor over it is gone."""
        self.data = None
        self._keep = None


def open_memory(spec: m.CacheMemory, devices: dict[str, int], shm_dir: str | None) -> OpenedMemory:
    """Open one memory a worker registered. ``devices``: UUID -> this process's CUDA index; ``shm_dir``:
    where host files may be (None: they are refused). BadRequest / TransportUnavailable say why not."""
    require_torch("the server-driven path")
    if isinstance(spec, m.CudaIpcMemory):
        index = devices.get(spec.device_uuid)
        if index is None:
            raise TransportUnavailable(
                f"this server does not see GPU {spec.device_uuid} (it sees {sorted(devices) or 'none'}): run it on the worker's "
                f"host with that GPU visible (CUDA_VISIBLE_DEVICES)"
            )
        return _open_cuda(spec, index)
    if shm_dir is None:
        raise TransportUnavailable("this server does not map host cache files (no torch, or the server-driven path is off)")
    return _open_host_file(spec, shm_dir)


def check_cuda_handle(handle: bytes) -> None:
    """A memory handle as torch's ``_share_cuda_`` makes one for memory from ``cudaMalloc`` (the caching
    allocator's segments): a cudaIpcMemHandle_t, alone or after torch's version and kind bytes. Memory of
    an expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is refused: the server
    could not check that a registered range lies inside what such a handle maps."""
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return
    kind = handle[1] if len(handle) > 1 else None
    if kind == _SHAREABLE_CUDA_MALLOC and len(handle) == 2 + CUDA_IPC_HANDLE_BYTES:
        return
    if kind == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise TransportUnavailable(
            "this cache is in torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which the "
            "server does not open: allocate the KV cache without them, or use the shm transport"
        )
    raise BadRequest(f"a CUDA memory handle of {len(handle)} bytes is not one torch makes for cudaMalloc memory")


def check_cuda_extent(spec: m.CudaIpcMemory, address: int, base: int, extent: int) -> None:
    """The registered range against the allocation CUDA mapped for its handle. torch put the storage at
    ``address`` (the mapping's start plus ``spec.offset``); ``base`` and ``extent`` are the allocation
    that holds ``address`` as the driver reports it. The storage must start ``spec.offset`` bytes into
    that allocation (else the offset walked out of the mapping, into other memory of this process: another
    worker's cache, the server's staging) and end inside it. Sizes and offsets a worker declares are never
    trusted alone: the server's kernels would read and write wherever they point."""
    if address - base != spec.offset or spec.offset + spec.size > extent:
        raise BadRequest(
            f"CUDA memory of {spec.size} bytes at offset {spec.offset} does not lie inside the allocation its handle maps "
            f"({extent} bytes)"
        )


@cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch loaded: the same library, mapped once
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    return lib


def _driver_call(code: int, what: str) -> None:
    if code != 0:
        raise OSError(f"{what} failed (CUDA driver error {code})")


def allocation_range(device_index: int, address: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation that holds ``address`` (``cuMemGetAddressRange``), asked in
    device ``device_index``'s primary context (torch's, where it opened the handle), pushed on this thread
    for the call. TransportUnavailable where the driver library cannot be loaded; OSError where the
    driver does not know the address."""
    try:
        lib = _libcuda()
    except (OSError, AttributeError) as exc:
        raise TransportUnavailable(f"the CUDA driver library cannot be used here to check registered memory ({exc})") from None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _driver_call(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _driver_call(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        _driver_call(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _driver_call(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)), "cuMemGetAddressRange")
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(device)
    return int(base.value), int(size.value)


def _open_cuda(spec: m.CudaIpcMemory, index: int) -> OpenedMemory:
    torch = require_torch("the server-driven path")
    check_cuda_handle(spec.handle)
    if spec.size <= 0 or spec.offset < 0 or spec.offset % CUDA_IPC_ALIGNMENT:
        raise BadRequest(f"CUDA memory of {spec.size} bytes at offset {spec.offset} (offsets are multiples of {CUDA_IPC_ALIGNMENT})")
    if spec.event_sync_required and len(spec.event_handle) != CUDA_IPC_HANDLE_BYTES:
        raise BadRequest(f"a CUDA event handle of {len(spec.event_handle)} bytes (a cudaIpcEventHandle_t has {CUDA_IPC_HANDLE_BYTES})")
    with torch.cuda.device(index):
        # torch's own reader of these fields: it maps the allocation once per handle in this process. The
        # worker's cross-process reference count is never handed on: torch's deleter would shm_open that
        # name in this process and decrement an int64 at that offset in it, both the worker's to choose (the
        # arena's header, any shared-memory file of the server's user). With no name its open fails, which
        # the deleter catches and ignores.
        storage = torch.UntypedStorage._new_shared_cuda(
            # (the event handle as bytes, empty when no event is waited on: torch takes nothing else)
            index, spec.handle, spec.size, spec.offset, b"", 0, bytes(spec.event_handle), bool(spec.event_sync_required),
        )  # fmt: skip
        # torch took the size and offset as given: nothing is read or written through the storage before
        # the driver's extent of the mapping confirms them (a refused storage is let go, unmapped).
        address = storage.data_ptr()
        try:
            base, extent = allocation_range(index, address)
        except OSError as exc:
            raise BadRequest(f"CUDA memory of {spec.size} bytes at offset {spec.offset}: the driver does not place it ({exc})") from None
        check_cuda_extent(spec, address, base, extent)
        data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (spec.size,), (1,))
    return OpenedMemory(data, index)


def _open_host_file(spec: m.HostFileMemory, shm_dir: str) -> OpenedMemory:
    torch = require_torch("the server-driven path")
    name = os.path.basename(spec.path)
    if "\0" in spec.path:  # no file has one; os calls raise ValueError (an INTERNAL reply) for it
        raise BadRequest(f"a host cache file path holds a NUL byte: {spec.path!r}")
    if os.path.dirname(os.path.realpath(spec.path)) != os.path.realpath(shm_dir) or not name.startswith(HOST_FILE_PREFIX):
        raise BadRequest(f"host cache files must be {HOST_FILE_PREFIX}* directly in {shm_dir}, not {spec.path!r}")
    if spec.size <= 0 or spec.offset < 0:
        raise BadRequest(f"a host cache file range of {spec.size} bytes at {spec.offset}")
    try:
        fd = os.open(spec.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadRequest(f"cannot open the host cache file {spec.path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise BadRequest(f"{spec.path} is not a regular file of this server's user")
        if spec.offset + spec.size > st.st_size:
            raise BadRequest(f"{spec.path} holds {st.st_size} bytes, not {spec.offset + spec.size}")
        start = spec.offset - spec.offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, spec.offset + spec.size - start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return OpenedMemory(flat[spec.offset - start :], None, mapping)


def layer_tensor(memory: OpenedMemory, spec: m.PagedLayerSpec):
    """One registered layer as a tensor over ``memory``, after checking it lies inside it."""
    torch = require_torch("the server-driven path")
    try:
        dtype = torch_dtype(spec.dtype)
    except ValueError:
        raise BadRequest(f"unknown dtype {spec.dtype!r}") from None
    try:
        bits_dtype(dtype)  # its bits are what a copy moves: a width without an integer dtype (16-byte complex) is no KV
    except KeyError:
        raise BadRequest(f"a layer of dtype {spec.dtype!r} cannot be copied as bits") from None
    item = torch.empty((), dtype=dtype).element_size()
    if len(spec.shape) != len(spec.stride) or not spec.shape or min(spec.shape) <= 0 or min(spec.stride) < 0:
        raise BadRequest(f"a layer of shape {spec.shape} and stride {spec.stride}")
    if max(*spec.shape, *spec.stride) >= 1 << 63:  # torch takes int64 sizes and strides (a size-1 axis adds nothing to span)
        raise BadRequest(f"a layer of shape {spec.shape} and stride {spec.stride} does not fit torch's 64-bit sizes")
    span = (sum((n - 1) * s for n, s in zip(spec.shape, spec.stride)) + 1) * item
    size = memory.data.numel()
    if spec.offset < 0 or spec.offset + span > size:
        raise BadRequest(f"a layer of {span} bytes at offset {spec.offset} does not fit its memory of {size} bytes")
    start = memory.data.storage_offset() + spec.offset  # bytes into the storage
    if start % item:
        raise BadRequest(f"a {spec.dtype} layer at byte {start} of its memory is not aligned to {item} bytes")
    storage = memory.data.untyped_storage()
    return torch.empty(0, dtype=dtype, device=memory.data.device).set_(storage, start // item, spec.shape, spec.stride)
