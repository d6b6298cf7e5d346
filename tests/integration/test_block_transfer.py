"""The server-driven path against a real server process: a worker registers its paged cache and the
server copies the blocks itself. Here the cache is host memory in a shared-memory file (the same module
code the CUDA path runs; tests/gpu runs it with CUDA IPC handles): every byte read back is compared with
what was written, bad input is that request's error and nothing else, and a worker killed with its
cache registered leaves nothing behind in the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.errors import BadRequest, TransportUnavailable, UnknownKVCache
from kvdepot.gpu.memory import HostCacheFile
from kvdepot.protocol import messages as m
from kvdepot.types import SlotStatus

from support.servers import wait_until

CHUNK, BS, NB = 32, 8, 24  # 4 blocks a chunk, 6 chunks' worth of blocks
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16")
MODEL = "blocks-model"
HERE = Path(__file__).resolve().parent


def tokens(seed: int, chunks: int) -> list[int]:
    return torch.randint(1, 30000, (chunks * CHUNK,), generator=torch.Generator().manual_seed(seed)).tolist()


def fill(layers, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in layers:
        t.copy_(torch.randint(-(1 << 15), 1 << 15, t.shape, generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


def bits(t):
    return t.view(torch.int16)


@pytest.fixture
def blocks_server(make_server, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    return make_server("--shm-dir", str(shm), base=("--chunk-size", str(CHUNK), "--l1-size-gb", "0.03125", "--no-prefault"))


def client_of(server, **options) -> KVClient:
    return KVClient(server.url, MODEL, LAYOUT, options=ClientOptions(chunk_size=CHUNK, timeout_s=10.0, **options))


def host_cache(client: KVClient, fmt: str = "kv_first", seed: int | None = None) -> HostCacheFile:
    shape = (2, NB, BS, 2, 16) if fmt == "kv_first" else (NB, 2, BS, 2, 16)
    cache = HostCacheFile.create(client.registration.blocks.shm_dir, LAYOUT.num_layers, shape, torch.bfloat16)
    if seed is not None:
        fill(cache.layers, seed)
    return cache


def kv_view(t, fmt: str):
    return t if fmt == "kv_first" else t.transpose(0, 1)


def test_the_registration_offers_the_path_and_a_store_is_read_back_bit_exact_everywhere(blocks_server):
    """A worker process stores through the server-driven path; this process reads the chunks back into
    other blocks of a cache in the other layout, and as plain arrays (KVClient.retrieve): the same bits."""
    worker = subprocess.Popen([sys.executable, str(HERE / "_block_worker.py"), blocks_server.url, "11", "3", str(HERE)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        said = json.loads(worker.stdout.readline())
        assert said["stored"] == ["ALLOCATED"] * 3
    finally:
        worker.kill()
        worker.wait()
    with client_of(blocks_server) as c:
        offer = c.registration.blocks
        assert offer is not None and offer.host_files and offer.devices == []  # no GPU on this machine
        src = HostCacheFile.create(offer.shm_dir, LAYOUT.num_layers, (2, NB, BS, 2, 16), torch.bfloat16)
        fill(src.layers, 11)  # what the worker wrote, made again from its seed
        dst = host_cache(c, "block_first")
        rc = c.register_kv_cache(dst.layers, "block_first", BS)
        assert rc.kind == "host_file" and rc.num_blocks == NB
        hashes = c.hashes(tokens(11, 3))
        targets = [20, 3, 17, 9, 0, 1, 2, 4, 23, 22, 21, 5]
        assert rc.retrieve(hashes, [targets]) == 3
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(bits(kv_view(dst.layers[layer], "block_first")[:, targets]), bits(src.layers[layer][:, list(range(12))]))
        arrays = c.retrieve(tokens(11, 3))  # [K, L, T, H, D]: the shared layout, per token
        for layer in range(LAYOUT.num_layers):
            want = src.layers[layer][:, :12].reshape(2, 3 * CHUNK, 2, 16)
            assert torch.equal(torch.from_numpy(arrays[:, layer].copy()).view(torch.int16), bits(want))
        src.close()
        dst.close()
    assert blocks_server.metric("kvdepot_transfer_bytes_total", path="host_file", direction="store") == 3 * LAYOUT.chunk_bytes(CHUNK)


def test_a_retrieve_leaves_the_engines_own_blocks_alone_and_takes_over_a_sessions_locks(blocks_server):
    with client_of(blocks_server) as c:
        src, dst = host_cache(c, seed=5), host_cache(c)
        write = c.register_kv_cache(src.layers, "kv_first", BS)
        read = c.register_kv_cache(dst.layers, "kv_first", BS)
        gpu = blocks_server.status()["gpu"]
        assert gpu["host_files"] and gpu["devices"] == [] and not gpu["arena_pinned"]
        assert [(x["path"], x["state"], x["layers"], x["blocks"], x["device"]) for x in gpu["caches"]] == [("host_file", "open", 3, NB, "host")] * 2
        hashes = c.hashes(tokens(5, 2))
        assert write.store(hashes, [[8, 9, 10, 11, 12, 13, 14, 15]]) == [SlotStatus.ALLOCATED] * 2
        assert write.store(hashes, [[8, 9, 10, 11, 12, 13, 14, 15]]) == [SlotStatus.EXISTS] * 2  # nothing copied twice
        session = c.session("req-1")
        assert session.lookup(hashes) == 2
        assert blocks_server.leases() == 1  # the lookup's locks
        found = read.retrieve(hashes, [[0, 1, 2, 3, 4, 5, 6, 7]], session_id="req-1", skip_first_n_tokens=2 * BS)
        assert found == 2
        for layer in range(LAYOUT.num_layers):
            assert not bits(dst.layers[layer][:, [0, 1]]).any()  # the engine's own prefix cache holds these
            assert torch.equal(bits(dst.layers[layer][:, 2:8]), bits(src.layers[layer][:, 10:16]))
        assert blocks_server.wait_status(lambda st: st["leases"] == 0)["leases"] == 0  # the session's locks ended with the copy
        with pytest.raises(BadRequest, match="whole number"):
            read.retrieve(hashes, [list(range(8))], skip_first_n_tokens=3)
        src.close()
        dst.close()
    assert blocks_server.status()["gpu"]["caches"] == []  # the client's goodbye closed them


def test_bad_block_ids_and_registrations_are_that_requests_error_and_nothing_else(blocks_server):
    with client_of(blocks_server) as c:
        src = host_cache(c, seed=7)
        rc = c.register_kv_cache(src.layers, "kv_first", BS)
        good, bad = c.hashes(tokens(7, 1)), c.hashes(tokens(8, 1))
        assert rc.store(good, [[0, 1, 2, 3]]) == [SlotStatus.ALLOCATED]
        for ids, what in (([0, 1, 2, NB], "outside"), ([0, 1, -1, 2], "outside"), ([0, 1, 2], "3 block ids"), ([], "0 block ids")):
            with pytest.raises(BadRequest, match=what):
                rc.store(bad, [ids])
        with pytest.raises(BadRequest, match="KV-cache groups"):
            rc.store(bad, [[0, 1, 2, 3], [0, 1, 2, 3]])
        with pytest.raises(BadRequest, match="outside"):
            rc.retrieve(good, [[0, 1, 2, 99]])
        assert c.lookup(tokens(8, 1)) == 0  # nothing of the refused stores went in
        assert blocks_server.leases() == 0
        # registrations that cannot be right
        wrong_heads = HostCacheFile.create(c.registration.blocks.shm_dir, 3, (2, NB, BS, 4, 16), torch.bfloat16)
        with pytest.raises(BadRequest, match="H=4"):
            c.register_kv_cache(wrong_heads.layers, "kv_first", BS)
        wrong_dtype = HostCacheFile.create(c.registration.blocks.shm_dir, 3, (2, NB, BS, 2, 16), torch.float16)
        with pytest.raises(BadRequest, match="float16"):  # the same width as bf16: never read as it
            c.register_kv_cache(wrong_dtype.layers, "kv_first", BS)
        wrong_dtype.close()
        with pytest.raises(BadRequest, match="layers registered"):
            c.register_kv_cache(src.layers[:2], "kv_first", BS)
        with pytest.raises(BadRequest, match="does not divide"):
            c.register_kv_cache(src.layers, "kv_first", 7)
        wrong_heads.close()
        # the server and what it held are fine
        assert c.ping()
        dst = host_cache(c)
        again = c.register_kv_cache(dst.layers, "kv_first", BS)
        assert again.retrieve(good, [[4, 5, 6, 7]]) == 1
        assert torch.equal(bits(dst.layers[2][:, 4:8]), bits(src.layers[2][:, 0:4]))
        src.close()
        dst.close()


def test_a_cache_the_server_forgot_is_registered_again_and_another_clients_id_is_unknown(blocks_server):
    with client_of(blocks_server) as a, client_of(blocks_server) as b:
        src = host_cache(a, seed=9)
        rc = a.register_kv_cache(src.layers, "kv_first", BS)
        first_id = rc.cache_id
        a.link.request(m.UnregisterKVCacheRequest(context_id=0, cache_id=first_id))  # behind its back
        assert rc.store(a.hashes(tokens(9, 1)), [[0, 1, 2, 3]]) == [SlotStatus.ALLOCATED]
        assert rc.cache_id != first_id
        with pytest.raises(UnknownKVCache):
            b.link.request(m.StoreBlocksRequest(context_id=0, cache_id=rc.cache_id, keys=b.hashes(tokens(10, 1)), block_ids=[[0, 1, 2, 3]]))
        src.close()


def test_a_restarted_server_leaves_the_workers_cache_file_and_the_cache_registers_again(blocks_server):
    """The restarted server's sweep of dead arenas deleted the worker's host cache file (same directory,
    same prefix, no lock on it): the cache could never be registered again, every store and retrieve a
    BAD_REQUEST for the worker's life."""
    with client_of(blocks_server, heartbeat=False) as a:
        src = host_cache(a, seed=23)
        rc = a.register_kv_cache(src.layers, "kv_first", BS)
        blocks_server.restart()
        assert os.path.exists(src.path)
        hashes = a.hashes(tokens(23, 1))
        assert rc.store(hashes, [[0, 1, 2, 3]]) == [SlotStatus.ALLOCATED]
        dst = host_cache(a)
        again = a.register_kv_cache(dst.layers, "kv_first", BS)
        assert again.retrieve(hashes, [[4, 5, 6, 7]]) == 1
        assert torch.equal(bits(dst.layers[2][:, 4:8]), bits(src.layers[2][:, 0:4]))
        src.close()
        dst.close()


def test_a_cache_registration_that_timed_out_is_not_taken_for_the_old_one(blocks_server, monkeypatch):
    """A restarted server numbers its caches from 1 again, so a registration whose reply came too late had
    made the cache there under the old id: the worker kept the old id, and the server took it, with the
    worker still waiting on the dead server's events (on CUDA: never recorded again, so the worker read
    its blocks before the server's copies into them were done). The next request registers again."""
    import kvdepot.client.blocks as blocks
    from kvdepot.errors import KVDepotTimeout
    from support.servers import pause

    with client_of(blocks_server, heartbeat=False) as a:
        src = host_cache(a, seed=21)
        rc = a.register_kv_cache(src.layers, "kv_first", BS)
        old_id = rc.cache_id
        blocks_server.restart()
        assert a.ping()
        call = a.link.channel.call

        def silent_server(body, *args, **kwargs):
            if isinstance(body, m.RegisterKVCacheRequest):
                pause(blocks_server.proc.proc.pid)  # it reads the REGISTER only after the worker gave up
            return call(body, *args, **kwargs)

        monkeypatch.setattr(blocks, "REGISTER_TIMEOUT_S", 0.5)
        a.link.channel.call = silent_server
        hashes = a.hashes(tokens(21, 1))
        try:
            with pytest.raises(KVDepotTimeout):
                rc.store(hashes, [[0, 1, 2, 3]])
        finally:
            a.link.channel.call = call
            blocks_server.proc.proc.send_signal(signal.SIGCONT)
        late = blocks_server.wait_status(lambda st: len(st["gpu"]["caches"]) == 1)["gpu"]["caches"]
        assert [x["id"] for x in late] == [old_id], "the late registration took the old id (the case at hand)"
        assert rc.store(hashes, [[0, 1, 2, 3]]) == [SlotStatus.ALLOCATED]
        assert rc.cache_id not in (0, old_id), "the worker went on with an id it was never given by this server"
        dst = host_cache(a)
        again = a.register_kv_cache(dst.layers, "kv_first", BS)
        assert again.retrieve(hashes, [[4, 5, 6, 7]]) == 1
        assert torch.equal(bits(dst.layers[1][:, 4:8]), bits(src.layers[1][:, 0:4]))
        src.close()
        dst.close()


def test_a_worker_killed_with_its_cache_registered_leaves_nothing_in_the_server(blocks_server):
    worker = subprocess.Popen([sys.executable, str(HERE / "_block_worker.py"), blocks_server.url, "13", "2", str(HERE)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    said = json.loads(worker.stdout.readline())
    server_pid = blocks_server.proc.proc.pid

    def server_maps_it() -> bool:
        with open(f"/proc/{server_pid}/maps") as maps:
            return any(said["path"] in line for line in maps)

    assert server_maps_it()
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: not server_maps_it(), what="the server to let go of the killed worker's cache")
    st = blocks_server.wait_status(lambda st: st["contexts"] == 0 and st["leases"] == 0)
    assert (st["contexts"], st["leases"]) == (0, 0)
    os.unlink(said["path"])  # the worker was killed before it could
    with client_of(blocks_server) as c:  # and it serves on: the killed worker's chunks are there
        assert c.lookup(tokens(13, 2)) == 2 * CHUNK


def test_turned_off_the_path_is_refused_with_the_reason(make_server, tmp_path):
    server = make_server("--gpu-transfer", "off", base=("--chunk-size", str(CHUNK), "--l1-size-gb", "0.03125", "--no-prefault"))
    with client_of(server) as c:
        assert c.registration.blocks is None
        cache = HostCacheFile.create(str(tmp_path), 3, (2, NB, BS, 2, 16), torch.bfloat16)
        with pytest.raises(TransportUnavailable, match="no server-driven path"):
            c.register_kv_cache(cache.layers, "kv_first", BS)
        from kvdepot.gpu.memory import export_cache

        with pytest.raises(TransportUnavailable, match="--gpu-transfer off"):
            c.link.request(export_cache(cache.layers, "kv_first").request(BS))
        cache.close()
        assert c.ping()


def test_malformed_cache_registrations_are_bad_requests_not_handler_crashes(blocks_server):
    """A registration whose host-file path holds a NUL, whose layer strides do not fit in 64 bits, or whose
    layer dtype is one the server cannot copy as bits (16-byte complex) is the client's bad input: it is
    answered BAD_REQUEST, not INTERNAL (a handler that crashed, logged with its traceback), and the server
    and its caches serve on."""
    from kvdepot.errors import ErrorCode, KVDepotError
    from kvdepot.gpu.memory import export_cache

    with client_of(blocks_server) as c:
        src = host_cache(c, seed=31)
        good = export_cache(src.layers, "kv_first").request(BS)
        path = good.memories[0].path

        def changed(memory=None, **layer) -> m.RegisterKVCacheRequest:
            req = export_cache(src.layers, "kv_first").request(BS)
            if memory is not None:
                req.memories = [memory]
            for spec in req.layers:
                for name, value in layer.items():
                    setattr(spec, name, value)
            return req

        cases = {
            "nul-in-path": changed(memory=m.HostFileMemory(path=path + "\x00x", size=good.memories[0].size)),
            "stride-over-64-bits": changed(shape=[2, NB, BS, 2, 1], stride=[NB * BS * 32, BS * 32, 32, 16, (1 << 64) - 1]),
            "complex128": changed(dtype="complex128", shape=[2, NB, BS, 2, 2], stride=[NB * BS * 4, BS * 4, 4, 2, 1]),
        }
        for name, req in cases.items():
            with pytest.raises(KVDepotError) as exc_info:
                c.link.request(req)
            assert exc_info.value.code == ErrorCode.BAD_REQUEST, (name, exc_info.value.code, exc_info.value.message)
        assert "REGISTER_KV_CACHE handler failed" not in blocks_server.log_text()
        rc = c.register_kv_cache(src.layers, "kv_first", BS)  # the well-formed one is still taken
        assert rc.store(c.hashes(tokens(31, 1)), [[0, 1, 2, 3]]) == [SlotStatus.ALLOCATED]
        assert blocks_server.status()["gpu"]["caches"][0]["state"] == "open"
        src.close()
