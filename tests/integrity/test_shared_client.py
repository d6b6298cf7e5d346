"""One KVClient shared by many threads (SGLang calls its storage backend from a prefetch thread and a
backup thread at once): every thread gets its own bytes back, on both transports, for small and
multi-frame chunks, contiguous or not; and a zero-copy view never changes before its own block exits,
whatever other threads or a nested block do meanwhile."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvdepot import KVLayout

from support.servers import CHUNK, as_bits, make_kv, make_tokens

THREADS = 6
ROUNDS = 4
LAYOUTS = {
    "small": KVLayout(num_layers=2, num_kv_heads=2, head_dim=32),  # 8 KiB chunks: one frame, staged
    "multiframe": KVLayout(num_layers=48, num_kv_heads=8, head_dim=128),  # 3 MiB chunks: frames joined
}


def run_threads(target, n: int = THREADS) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            barrier.wait(10)
            target(i)
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def strided(kv: np.ndarray, how: str) -> np.ndarray:
    """The same values as ``kv`` in a different memory arrangement."""
    if how == "contiguous":
        return kv
    if how == "sliced":  # a view into a wider array: not contiguous
        wide = np.empty((*kv.shape[:4], kv.shape[4] * 2), kv.dtype)
        wide[..., : kv.shape[4]] = kv
        return wide[..., : kv.shape[4]]
    # token-major storage viewed back as [K, L, T, H, D]
    tm = np.ascontiguousarray(kv.transpose(2, 0, 1, 3, 4))
    return tm.transpose(1, 2, 0, 3, 4)


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    from support.servers import start_server, stop_server

    s = start_server(tmp_path_factory.mktemp("shared"), "shared-client", ["--l1-size-gb", "0.75"])
    yield s
    stop_server(s)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_threads_storing_through_one_client_each_get_their_own_bytes(big_server, transport, layout_name, seed):
    layout = LAYOUTS[layout_name]
    with big_server.client(transport=transport, layout=layout) as c:
        c.clear()

        def work(i: int) -> None:
            rng = np.random.default_rng(seed + i)  # a Generator is not to be shared between threads
            for r in range(ROUNDS):
                n_chunks = int(rng.integers(1, 4))
                tokens = make_tokens(n_chunks * CHUNK, seed * 1000 + i * 10 + r)
                kv = make_kv(layout, len(tokens), seed * 1000 + i * 10 + r)
                arrangement = ("contiguous", "sliced", "token_major")[(i + r) % 3]
                assert c.store(tokens, strided(kv, arrangement)) == n_chunks * CHUNK
                got = c.retrieve(tokens)
                assert np.array_equal(as_bits(got), as_bits(kv)), f"thread {i} round {r} ({arrangement}) got other bytes"

        run_threads(work)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_view_stays_its_own_while_other_threads_retrieve(big_server, transport, layout_name, seed):
    layout = LAYOUTS[layout_name]
    prompts = [make_tokens(2 * CHUNK, seed + i) for i in range(THREADS)]
    values = [make_kv(layout, 2 * CHUNK, seed + i) for i in range(THREADS)]
    with big_server.client(transport=transport, layout=layout) as c:
        c.clear()
        for tokens, kv in zip(prompts, values):
            assert c.store(tokens, kv) == 2 * CHUNK

        def work(i: int) -> None:
            for r in range(ROUNDS):
                with c.prepare_retrieve(prompts[i]) as views:
                    assert len(views) == 2
                    snapshot = [v.copy() for v in views]
                    time.sleep(0.01 * ((i + r) % 3))  # let the others run their own blocks meanwhile
                    for j, v in enumerate(views):
                        want = values[i][:, :, j * CHUNK : (j + 1) * CHUNK]
                        assert np.array_equal(as_bits(v), as_bits(want)), f"thread {i}: a view showed other data"
                        assert np.array_equal(as_bits(v), as_bits(snapshot[j]))

        run_threads(work)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_nested_block_never_changes_the_outer_views(big_server, transport, layout_name, seed):
    layout = LAYOUTS[layout_name]
    a, b = make_tokens(2 * CHUNK, seed), make_tokens(2 * CHUNK, seed + 1)
    kv_a, kv_b = make_kv(layout, 2 * CHUNK, seed), make_kv(layout, 2 * CHUNK, seed + 1)
    with big_server.client(transport=transport, layout=layout) as c:
        c.clear()
        assert c.store(a, kv_a) == c.store(b, kv_b) == 2 * CHUNK
        with c.prepare_retrieve(a) as outer:
            with c.prepare_retrieve(b) as inner:
                assert np.array_equal(as_bits(np.concatenate(inner, axis=2)), as_bits(kv_b))
                assert np.array_equal(as_bits(np.concatenate(outer, axis=2)), as_bits(kv_a))
            with c.prepare_store(make_tokens(2 * CHUNK, seed + 2)) as slots:  # a nested store too
                for slot in slots:
                    slot[...] = 0
            assert np.array_equal(as_bits(np.concatenate(outer, axis=2)), as_bits(kv_a)), "the outer views changed"
