"""Inline transfers of chunks whose rows are large relative to the frame limit (--max-frame-mib 1): rows
sent straight from the caller's array, several rows a frame, and rows split across frames. Plus
concurrent clients over both endpoints and transports, and client-side argument errors."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from kvdepot import KVLayout
from kvdepot.errors import BadRequest

from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens, start_server, stop_server

LAYOUTS = {
    # row = T*H*D*itemsize with T = 16
    "rows-direct-128KiB": KVLayout(num_layers=2, num_kv_heads=8, head_dim=512),  # 4 rows/frame
    "rows-512KiB": KVLayout(num_layers=3, num_kv_heads=16, head_dim=1024),  # 2 rows/frame
    "row-split-1.25MiB": KVLayout(num_layers=1, num_kv_heads=40, head_dim=1024),  # a row spans 2 frames
    # a 2 MiB chunk: one frame by the 2 MiB target, two by the 1 MiB limit (an inline view joined them
    # only above the target, and failed on an assertion here)
    "chunk-2MiB-in-1MiB-frames": KVLayout(num_layers=2, num_kv_heads=16, head_dim=1024),
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("frames"), "frames", ["--max-frame-mib", "1"])
    yield s
    stop_server(s)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("writer, reader", [("inline", "inline"), ("inline", "shm"), ("shm", "inline")])
def test_large_rows_round_trip(srv, name, writer, reader, seed):
    layout = LAYOUTS[name]
    tokens = make_tokens(3 * CHUNK + 3, seed)
    kv = make_kv(layout, len(tokens), seed)
    with srv.client(layout=layout, transport=writer) as w, srv.client(srv.ipc_url, layout=layout, transport=reader) as r:
        assert w.store(tokens, kv) == 3 * CHUNK
        want = kv[:, :, : 3 * CHUNK]
        assert_bytes_equal(r.retrieve(tokens), want)
        # into a contiguous and a strided destination
        out = np.zeros(layout.chunk_shape(3 * CHUNK), dtype=layout.storage_dtype)
        assert_bytes_equal(r.retrieve(tokens, out=out), want)
        assert_bytes_equal(out, want)
        backing = np.zeros((*layout.chunk_shape(3 * CHUNK)[:4], 2 * layout.head_dim), dtype=layout.storage_dtype)
        strided = backing[..., ::2]
        r.retrieve(tokens, out=strided)
        assert_bytes_equal(strided, want)
        assert not backing[..., 1::2].any()
        with r.prepare_retrieve(tokens) as views:
            assert len(views) == 3
            for i, v in enumerate(views):
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
    assert srv.leases() == 0


def test_concurrent_clients_on_shared_prompts(srv, seed):
    """Eight clients (tcp/ipc x shm/inline) store and read the same ten prompts in random orders; every
    read is a bit-exact prefix of the prompt's KV, and nothing is left locked."""
    prompts = []
    for i in range(10):
        t = make_tokens((2 + i % 4) * CHUNK, seed + i)
        prompts.append((t, make_kv(LAYOUT, len(t), seed + i)))
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            url = srv.url if k % 2 else srv.ipc_url
            with srv.client(url, transport="shm" if k % 4 < 2 else "inline") as c:
                rng = random.Random(seed + k)
                barrier.wait(30)
                for _ in range(6):
                    order = list(range(len(prompts)))
                    rng.shuffle(order)
                    for j in order:
                        tokens, kv = prompts[j]
                        stored = c.store(tokens, kv)
                        assert stored % CHUNK == 0 and stored <= len(tokens)
                        got = c.retrieve(tokens)
                        n = got.shape[2]
                        assert n % CHUNK == 0
                        assert_bytes_equal(got, kv[:, :, :n])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    with srv.client() as c:
        for tokens, kv in prompts:
            assert c.lookup(tokens) == len(tokens)
            assert_bytes_equal(c.retrieve(tokens), kv)
    st = srv.status()
    assert st["leases"] == 0 and st["l1"]["writing"] == 0 and st["l1"]["read_locked"] == 0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_client_side_argument_errors_leave_nothing_locked(srv, transport, seed):
    tokens = make_tokens(3 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(transport=transport) as c:
        with pytest.raises(BadRequest):  # wrong shape
            c.store(tokens, kv[:, :1])
        with pytest.raises(BadRequest):  # too few tokens of KV
            c.store(tokens, kv[:, :, : 2 * CHUNK])
        with pytest.raises(BadRequest):  # wrong dtype width
            c.store(tokens, kv.astype(np.float32))
        assert c.lookup(tokens) == 0
        assert c.store(tokens, kv) == 3 * CHUNK
        with pytest.raises(BadRequest):  # out too small for the hit
            c.retrieve(tokens, out=LAYOUT.empty(2 * CHUNK))
        with pytest.raises(BadRequest):  # out of the wrong shape
            c.retrieve(tokens, out=np.empty((2, 2, 3 * CHUNK, 2, 16), dtype=np.float16))
        assert srv.status()["leases"] == 0
        assert_bytes_equal(c.retrieve(tokens), kv)
        assert c.store([], LAYOUT.empty(0)) == 0
        assert c.lookup([]) == 0
    assert srv.status()["leases"] == 0
