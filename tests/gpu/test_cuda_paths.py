"""The CUDA-only parts of the GPU paths, on a real GPU (``bash scripts/test-gpu.sh``): CUDA IPC handles
and events between a worker (this process) and a real server process, bit-exact in both layouts and
every cache dtype, the ordering both ways (a test that reads stale bytes if either wait were missing),
a worker killed with its handles registered, a registration whose declared range reaches past the
allocation its handle maps (refused by the driver's extent of the mapping), and a mover's ``settled``
and a load stopped at its deadline on real streams. Skipped, and counted, where there is no CUDA; the
same code's CPU form runs everywhere (tests/integration/test_block_transfer.py, tests/e2e/test_connector_device.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.errors import BadRequest, KVDepotTimeout
from kvdepot.gpu.memory import EventRing, ExportedCache, allocation_range, export_cache
from kvdepot.types import SlotStatus

from support.devices import gpu

pytestmark = gpu

CHUNK, BS, NB = 32, 16, 64
H, D = 4, 64
HERE = Path(__file__).resolve().parent
DTYPES = ["float16", "bfloat16"] + (["float8_e4m3fn"] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.fixture
def gpu_server(make_server):
    return make_server("--gpu-transfer", "on", base=("--chunk-size", str(CHUNK), "--l1-size-gb", "1", "--no-prefault"))


def layout(layers: int, dtype: str) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=H, head_dim=D, dtype=dtype)


def cuda_layers(n: int, fmt: str, dtype: str, seed: int | None):
    shape = (2, NB, BS, H, D) if fmt == "kv_first" else (NB, 2, BS, H, D)
    torch_dtype = getattr(torch, dtype)
    item = torch.empty((), dtype=torch_dtype).element_size()
    if seed is None:
        return [torch.zeros(shape, dtype=torch_dtype, device="cuda") for _ in range(n)]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (*shape[:-1], D * item), generator=gen, dtype=torch.uint8, device="cuda").view(torch_dtype) for _ in range(n)]


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()])


def kv(t, fmt):
    return t if fmt == "kv_first" else t.transpose(0, 1)


@pytest.mark.parametrize("fmt", ["kv_first", "block_first"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ipc_store_and_retrieve_are_bit_exact(gpu_server, fmt, dtype):
    lay = layout(4, dtype)
    with KVClient(gpu_server.url, f"ipc-{dtype}", lay, options=ClientOptions(chunk_size=CHUNK, timeout_s=30)) as c:
        assert c.registration.blocks is not None and c.registration.blocks.devices, "the server offers no GPU"
        src, dst = cuda_layers(4, fmt, dtype, seed=1), cuda_layers(4, "block_first" if fmt == "kv_first" else "kv_first", dtype, None)
        ring = EventRing()
        write = c.register_kv_cache(src, fmt, BS)
        read = c.register_kv_cache(dst, "block_first" if fmt == "kv_first" else "kv_first", BS)
        assert write.kind == "cuda_ipc" and len(read._layer_events) == 4
        hashes = c.hashes(list(range(3 * CHUNK)))
        src_ids, dst_ids = [5, 9, 1, 33, 2, 60], [0, 1, 2, 3, 4, 5]
        _, handle = ring.record()
        assert write.store(hashes, [src_ids], ready_event=handle) == [SlotStatus.ALLOCATED] * 3
        assert read.retrieve(hashes, [dst_ids]) == 3
        read.wait_all()
        torch.cuda.current_stream().synchronize()
        other = "block_first" if fmt == "kv_first" else "kv_first"
        for a, b in zip(src, dst):
            assert torch.equal(bits(kv(a, fmt)[:, src_ids]), bits(kv(b, other)[:, dst_ids]))
        arrays = c.retrieve(list(range(3 * CHUNK)))  # the host path sees the same chunks
        for layer, a in enumerate(src):
            want = bits(kv(a, fmt)[:, src_ids].reshape(2, 3 * CHUNK, H, D)).cpu().numpy()
            assert (arrays[:, layer].view(want.dtype) == want).all()


def test_a_store_waits_for_the_event_the_worker_recorded(gpu_server):
    """The worker writes its blocks after a long kernel on its stream and sends STORE at once: the server
    must gather the new bytes. Without its wait on the worker's event it would read the zeros."""
    with KVClient(gpu_server.url, "order-store", layout(2, "bfloat16"), options=ClientOptions(chunk_size=CHUNK, timeout_s=30)) as c:
        src = cuda_layers(2, "kv_first", "bfloat16", None)
        rc = c.register_kv_cache(src, "kv_first", BS)
        ring = EventRing()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # about a second of a busy GPU before the write
            for t in src:
                t[:, :2].fill_(3.0)
            _, handle = ring.record(stream)
        assert rc.store(c.hashes(list(range(CHUNK))), [[0, 1]], ready_event=handle) == [SlotStatus.ALLOCATED]
        arrays = c.retrieve(list(range(CHUNK)))
        assert (arrays.view("int16") == torch.tensor(3.0, dtype=torch.bfloat16).view(torch.int16).item()).all()


def test_a_retrieve_waits_for_the_worker_and_the_worker_waits_for_it(gpu_server):
    """Both directions of a load's ordering: the server writes the blocks only after the worker's event
    (the worker fills them with a sentinel after a long kernel: if the server did not wait, the sentinel
    would land last), and the worker's stream reads them only after the server's per-layer events (a
    large load, read at once: without the wait, stale)."""
    n_chunks = 8
    with KVClient(gpu_server.url, "order-load", layout(2, "float16"), options=ClientOptions(chunk_size=CHUNK, timeout_s=30)) as c:
        src, dst = cuda_layers(2, "kv_first", "float16", seed=2), cuda_layers(2, "kv_first", "float16", None)
        write, read = c.register_kv_cache(src, "kv_first", BS), c.register_kv_cache(dst, "kv_first", BS)
        hashes = c.hashes(list(range(n_chunks * CHUNK)))
        ids = list(range(2 * n_chunks))
        torch.cuda.synchronize()
        assert write.store(hashes, [ids]) == [SlotStatus.ALLOCATED] * n_chunks
        ring = EventRing()
        main = torch.cuda.current_stream()
        torch.cuda._sleep(2_000_000_000)
        for t in dst:
            t.fill_(-7.0)  # the sentinel, queued behind the long kernel
        _, handle = ring.record(main)
        assert read.retrieve(hashes, [ids], ready_event=handle) == n_chunks
        read.wait_layer(0)
        first = dst[0][:, ids].clone()  # on the main stream, right after the wait
        read.wait_all()
        second = dst[1][:, ids].clone()
        torch.cuda.synchronize()
        assert torch.equal(bits(first), bits(src[0][:, ids]))
        assert torch.equal(bits(second), bits(src[1][:, ids]))


def test_a_worker_killed_with_its_handles_registered(gpu_server):
    worker = subprocess.Popen([sys.executable, str(HERE / "_cuda_worker.py"), gpu_server.url], stdout=subprocess.PIPE, text=True)
    said = json.loads(worker.stdout.readline())
    assert said == {"kind": "cuda_ipc", "stored": ["ALLOCATED", "ALLOCATED"]}
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    st = gpu_server.wait_status(lambda st: st["contexts"] == 0 and st["leases"] == 0)
    assert (st["contexts"], st["leases"]) == (0, 0)
    assert "kv cache 1 of context" in gpu_server.log_text() and "closed" in gpu_server.log_text()
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    with KVClient(gpu_server.url, "gpu-worker-model", lay, options=ClientOptions(chunk_size=32)) as c:
        assert c.lookup(list(range(64))) == 64  # what it stored before it died stays
        fresh = [torch.zeros(2, 16, 16, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        rc = c.register_kv_cache(fresh, "kv_first", 16)
        assert rc.retrieve(c.hashes(list(range(64))), [[4, 5, 6, 7]]) == 2
        rc.wait_all()
        torch.cuda.synchronize()
        assert fresh[0][:, 4:8].abs().sum().item() > 0


def test_a_registered_range_must_lie_inside_the_allocation_its_handle_maps(gpu_server):
    """The driver's extent of an allocation holds torch's tensor in it; a worker that declares more than
    its handle maps (a larger size, an offset past its end) is refused, and a true registration of the
    same memory is taken after."""
    t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    base, extent = allocation_range(torch.cuda.current_device(), t.data_ptr())
    assert base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + extent
    with KVClient(gpu_server.url, "doctored", layout(2, "bfloat16"), options=ClientOptions(chunk_size=CHUNK, timeout_s=30)) as c:
        layers = cuda_layers(2, "kv_first", "bfloat16", None)
        exported = export_cache(layers, "kv_first")
        mem = exported.memories[0]
        for doctored in (msgspec.structs.replace(mem, size=mem.size + (64 << 20)), msgspec.structs.replace(mem, offset=mem.offset + (64 << 20))):
            request = ExportedCache([doctored, *exported.memories[1:]], exported.layers).request(BS)
            with pytest.raises(BadRequest, match="inside the allocation|does not place it"):
                c.link.request(request, timeout_s=60)
        assert c.register_kv_cache(layers, "kv_first", BS).kind == "cuda_ipc"


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_the_workers_own_path_moves_gpu_blocks_through_the_arena_bit_exact(gpu_server, transport):
    """The worker-driven path the connector takes where the server cannot copy itself (``DeviceKV`` with
    no server-driven path): a GPU gather into staging, one DMA into the pinned arena slot, and back."""
    from kvdepot.client.options import Transport
    from kvdepot.connectors.vllm.device import DeviceKV
    from kvdepot.layout import PagedFormat

    lay = layout(3, "bfloat16")
    with KVClient(gpu_server.url, f"mover-{transport}", lay, options=ClientOptions(chunk_size=CHUNK, timeout_s=30, transport=transport)) as c:
        src, dst = cuda_layers(3, "kv_first", "bfloat16", seed=3), cuda_layers(3, "kv_first", "bfloat16", None)
        write = DeviceKV(src, PagedFormat.KV_FIRST, BS, CHUNK // BS, Transport(transport), 8 << 20)
        read = DeviceKV(dst, PagedFormat.KV_FIRST, BS, CHUNK // BS, Transport(transport), 8 << 20)
        assert write.server_path(c) is None and read.server_path(c) is None
        assert write.path == ("shm (pinned)" if transport == "shm" else "inline")
        hashes = c.hashes(list(range(4 * CHUNK)))
        src_ids = [7, 3, 11, 2, 40, 41, 9, 8]
        event, _ = write.ready()
        with c.prepare_store(hashes) as slots:
            write.mover.save(write.ids(src_ids), list(slots), ready=event).wait()
        with c.prepare_retrieve(hashes) as views:
            assert len(views) == 4
            read.mover.load(views, read.ids(list(range(8))), 0, ready=read.ready()[0]).wait()
        torch.cuda.synchronize()
        for a, b in zip(src, dst):
            assert torch.equal(bits(a[:, src_ids]), bits(b[:, :8]))
        write.unpin()
        read.unpin()


def test_two_holders_of_one_pinned_range_and_a_refused_pin_leave_cuda_usable():
    """A writer and a reader in one process pin one arena mapping: CUDA registers it once (a second
    cudaHostRegister of the range is refused, and that refusal would surface as the error of torch's next
    allocation). A refused overlapping pin leaves the range pageable and CUDA working."""
    import mmap

    from kvdepot.gpu import runtime

    size = 16 << 20
    memory = mmap.mmap(-1, size)
    host = torch.frombuffer(memory, dtype=torch.uint8)
    address = host.data_ptr()
    first, second = runtime.pin(address, size), runtime.pin(address, size)
    assert first.pinned and second.pinned
    refused = runtime.pin(address + 4096, 4096)
    assert not refused.pinned
    device = torch.arange(size, dtype=torch.int64, device="cuda").to(torch.uint8)  # no stale error raised here
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, device.cpu())
    first.close()
    assert runtime.pin(address + 4096, 4096).pinned is False  # still registered: the second holder has it
    second.close()
    again = runtime.pin(address, size)
    assert again.pinned  # unregistered by the last holder, so it registers anew
    again.close()
    del host
    memory.close()


def test_settled_waits_for_queued_copies_and_a_load_past_its_deadline_queues_no_piece():
    """``settled`` is done only once what the mover's streams already hold is (a store that raised part
    way keeps its slots until then, a retrieve its locks); a load past its deadline queues no piece,
    leaves the blocks alone, and still records every layer event (a waiter is never left without one)."""
    from kvdepot.gpu.mover import BlockMover
    from kvdepot.gpu.paged import DevicePagedCache

    layers = cuda_layers(2, "kv_first", "bfloat16", None)
    cache = DevicePagedCache(layers, "kv_first", BS)
    mover = BlockMover(cache, CHUNK // BS, 8 << 20)
    with torch.cuda.stream(mover.copies.stream):
        torch.cuda._sleep(1_000_000_000)  # a copy still running, about half a second
    settled = mover.settled()
    assert not settled.done()
    assert settled.wait(30) and settled.done()

    host = torch.ones((1, *mover.chunk_shape), dtype=mover.bits).pin_memory()
    events = [torch.cuda.Event(enable_timing=True) for _ in layers]
    start = torch.cuda.Event(enable_timing=True)
    start.record(mover.lane.stream)
    with pytest.raises(KVDepotTimeout, match="after 0 of its 1 chunks"):
        mover.load([host[0]], cache.check_ids([[0, 1]], 2), 0, events, deadline=time.monotonic() - 1)
    mover.settled().wait()
    torch.cuda.synchronize()
    assert all(start.elapsed_time(e) >= 0 for e in events)  # raises for an event never recorded
    assert not any(t.any() for t in layers)
