"""The kvdepot tier for vLLM's native offloading, without vLLM: its settings, what a row is called in
kvdepot (namespace, layout, chunk hash, which keys one LOOKUP asks), and its transfer threads.

The tier itself, inside vLLM's real offloading manager and against a real server, is
``tests/e2e/test_vllm_native_offload.py``; that is also where ``namespace_fields`` reads vLLM's real
``OffloadingConfig`` (here: stand-ins with the same attribute names).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field, replace

import pytest

from kvdepot.connectors.vllm_tier.config import TierSettings
from kvdepot.connectors.vllm_tier.identity import KEY_SCHEME, TierIdentity, chunk_hash, group_of, lookup_chains, namespace_fields, tokens_per_chunk
from kvdepot.connectors.vllm_tier.transfers import Completions, JobQueue

# --- settings ------------------------------------------------------------------------------------------


def test_settings_defaults():
    s = TierSettings.from_tier_options({})
    assert s.url == "tcp://127.0.0.1:5555"
    assert s.timeout_s == 2.0 and s.retry_after_s == 5.0
    assert s.model_name == "" and s.locality == "" and s.chunk_size == 0


def test_settings_from_the_json_vllm_passes():
    s = TierSettings.from_tier_options({"url": "tcp://10.0.0.5:6000", "model_name": "llama-8b", "timeout_s": "0.5", "locality": "REMOTE"})
    assert (s.url, s.model_name, s.timeout_s, s.locality) == ("tcp://10.0.0.5:6000", "llama-8b", 0.5, "REMOTE")


@pytest.mark.parametrize(
    "options, named",
    [
        ({"urll": "tcp://127.0.0.1:1"}, "urll"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"retry_after_s": -1}, "retry_after_s"),
        ({"url": "http://127.0.0.1:5555"}, "url"),
        ({"chunk_size": 256}, "chunk_size"),
        ({"locality": "NEARBY"}, "locality"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"curve_server_key": "/nonexistent"}, "curve_client_key"),
    ],
)
def test_a_bad_setting_is_an_error_naming_the_key(options, named):
    with pytest.raises(ValueError, match=named) as err:
        TierSettings.from_tier_options(options)
    assert "kvdepot tier option" in str(err.value)  # says whose option it is


# --- what a row is called ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    world_size: int = 1
    rank: int = 0
    data_parallel_index: int = 0
    is_parallelism_agnostic: bool = False


@dataclass(frozen=True)
class Model:
    name: str = "meta-llama/Llama-3.1-8B"
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Cache:
    tokens_per_hash: int = 16
    blocks_per_chunk: int = 16


LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))


@dataclass(frozen=True)
class Config:
    """The attributes of vLLM's ``OffloadingConfig`` that the tier reads."""

    groups: tuple[Group, ...] = (Group(0, 16, LAYERS),)
    model: Model = field(default_factory=Model)
    cache: Cache = field(default_factory=Cache)
    parallel: Parallel = field(default_factory=Parallel)
    engine_id: str = "engine-a"
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = "LBNHC"


ROW = 2 * 32 * 256 * 8 * 128 * 2  # one 256-token chunk of an 8-KV-head bf16 model: 32 MiB


def identity(config: Config = Config(), device: str = "cuda", row: int = ROW, model_name: str = "") -> TierIdentity:
    return TierIdentity.of(namespace_fields(config, device), row, list(tokens_per_chunk(config).values()), model_name)


def test_a_row_is_one_chunk_of_the_offload_chunks_tokens():
    ident = identity()
    assert ident.chunk_tokens == 256  # 16 blocks of 16 tokens
    assert ident.row_bytes == ROW
    assert ident.layout.fingerprint() == f"uint8:K1xL1xH1xD{ROW // 256}"
    assert ident.model.startswith("meta-llama/Llama-3.1-8B|vllm-offload-") and ident.model.endswith(ident.digest)


def test_a_row_that_tokens_do_not_divide_is_one_token_wide():
    three_blocks = replace(Config(), cache=Cache(blocks_per_chunk=3))  # 48 tokens
    assert identity(three_blocks, row=48 * 4096).chunk_tokens == 48
    odd = identity(three_blocks, row=5 * 4096)  # page-aligned rows: 20480 bytes are not 48 equal parts
    assert odd.chunk_tokens == 1 and odd.row_bytes == 5 * 4096
    two_sizes = replace(Config(), groups=(Group(0, 16, LAYERS[:16]), Group(1, 32, LAYERS[16:])))
    ident = identity(two_sizes)
    assert ident.chunk_tokens == 1 and ident.row_bytes == ROW
    with pytest.raises(ValueError):
        identity(row=0)


def test_engines_of_one_deployment_share_a_namespace():
    a = identity()
    # Another engine (its own engine id), another data-parallel replica: the same rows.
    b = identity(replace(Config(), engine_id="engine-b", parallel=Parallel(data_parallel_index=3)))
    assert a == b


@pytest.mark.parametrize(
    "other",
    [
        replace(Config(), model=Model(name="Qwen/Qwen3-8B")),
        replace(Config(), model=Model(dtype="float16")),
        replace(Config(), cache=Cache(blocks_per_chunk=8)),
        replace(Config(), cache=Cache(tokens_per_hash=32)),
        replace(Config(), groups=(Group(0, 32, LAYERS),)),
        replace(Config(), groups=(Group(0, 16, LAYERS[:-1]),)),
        replace(Config(), parallel=Parallel(tp_size=2, world_size=2)),
        replace(Config(), parallel=Parallel(pp_size=2, world_size=2)),
        replace(Config(), kv_cache_layout="LBHNC"),
        replace(Config(), replicated_layout=True),
        replace(Config(), canonical_layout=True),
    ],
)
def test_anything_that_changes_a_rows_bytes_changes_the_namespace(other):
    assert identity(other).model != identity().model


def test_the_device_and_the_row_size_are_part_of_the_namespace():
    assert identity(device="cuda").model != identity(device="xpu").model
    assert identity(row=ROW).model != identity(row=ROW + 65536).model  # e.g. another host page size


def test_fp8_encodings_and_canonical_format_versions_never_share_a_namespace():
    """fp8 KV is e4m3fn on NVIDIA and e4m3fnuz on some AMD GPUs (one device type, other bits); a
    canonical layout's byte format has versions of its own. Each is named where it applies, and leaves
    every other namespace as it was."""
    from kvdepot.connectors.vllm_tier.identity import TierIdentity, namespace_fields

    def model(config, fp8="", canonical=""):
        return TierIdentity.of(namespace_fields(config, "cuda", fp8, canonical), ROW, [16]).model

    fp8 = replace(Config(), model=Model(dtype="fp8"))
    assert model(fp8, "float8_e4m3fn") != model(fp8, "float8_e4m3fnuz")
    assert model(Config(), "float8_e4m3fn") == model(Config(), "float8_e4m3fnuz") == model(Config())  # not fp8: unchanged
    canonical = replace(Config(), canonical_layout=True)
    assert model(canonical, canonical="v1-nhd") != model(canonical, canonical="v2-nhd")
    assert model(Config(), canonical="v1-nhd") == model(Config())  # not canonical: unchanged


def test_a_parallelism_agnostic_row_is_shared_across_topologies():
    one = replace(Config(), parallel=Parallel(is_parallelism_agnostic=True))
    four = replace(Config(), parallel=Parallel(tp_size=4, world_size=4, is_parallelism_agnostic=True))
    assert identity(one).model == identity(four).model
    assert identity(four).model != identity(replace(four, parallel=replace(four.parallel, is_parallelism_agnostic=False))).model


def test_model_name_replaces_the_engines_model_path():
    here = replace(Config(), model=Model(name="/models/llama-8b"))
    there = replace(Config(), model=Model(name="/mnt/weights/Llama-3.1-8B"))
    assert identity(here).model != identity(there).model
    a, b = identity(here, model_name="llama-8b"), identity(there, model_name="llama-8b")
    assert a.model == b.model and a.model.startswith("llama-8b|vllm-offload-")


def test_chunk_hash_is_sha256_of_the_offload_key_cut_to_the_servers_size():
    key = bytes(range(32)) + (0).to_bytes(4, "big")
    assert chunk_hash(key, 32) == hashlib.sha256(key).digest()
    assert chunk_hash(key, 16) == hashlib.sha256(key).digest()[:16]
    other_group = key[:-4] + (1).to_bytes(4, "big")
    assert chunk_hash(other_group, 32) != chunk_hash(key, 32)
    assert group_of(other_group) == 1 and group_of(key) == 0
    assert KEY_SCHEME == "vllm-offload-key-v1"


def key(n: int, group: int = 0) -> bytes:
    return hashlib.sha256(str(n).encode()).digest() + group.to_bytes(4, "big")


def test_lookup_chains_ask_each_groups_chunk_keys_together_in_prompt_order():
    keys = [key(3), key(1), key(2), key(9, group=1), key(8, group=1)]
    positions = [768, 256, 512, 1024, 512]
    assert lookup_chains(keys, positions, {0: 256, 1: 512}) == [[1, 2, 0], [4, 3]]


def test_lookup_chains_ask_a_key_off_the_chunk_grid_alone():
    keys = [key(1), key(2), key(3), key(4), key(5, group=7)]
    positions = [256, 300, None, 512, 256]  # a partial-tail probe, a key without a position, an unknown group
    assert lookup_chains(keys, positions, {0: 256}) == [[0, 3], [1], [2], [4]]
    assert lookup_chains([], [], {0: 256}) == []


# --- transfer threads --------------------------------------------------------------------------------


def test_jobs_run_in_order_on_one_thread_and_each_outcome_is_taken_once():
    done = Completions()
    q = JobQueue("test", done)
    assert "idle" in repr(q)  # no thread until the first job
    seen: list[tuple[int, str]] = []

    def job(i: int):
        def run():
            seen.append((i, threading.current_thread().name))
            return i, 100 * i

        return run

    for i in range(1, 5):
        q.submit(i, total=3, work=job(i))
    assert done.wait_idle(10)
    outcomes = done.take()
    assert [o.job_id for o in outcomes] == [1, 2, 3, 4]
    assert [i for i, _ in seen] == [1, 2, 3, 4] and {name for _, name in seen} == {"kvdepot-test"}
    assert [(o.done, o.complete) for o in outcomes] == [(1, False), (2, False), (3, True), (3, True)]  # never more than total
    assert [o.nbytes for o in outcomes] == [100, 200, 300, 400]
    assert done.take() == [] and done.open == 0
    q.close(10)
    assert "closed" in repr(q)


def test_a_job_that_raises_moved_nothing_and_the_queue_goes_on(caplog):
    done = Completions()
    q = JobQueue("test", done)

    def boom():
        raise RuntimeError("the copy broke")

    with caplog.at_level(logging.ERROR, logger="kvdepot.connectors.vllm_tier.transfers"):
        q.submit(1, 2, boom)
        q.submit(2, 2, lambda: (2, 8))
        assert done.wait_idle(10)
    assert [(o.job_id, o.done, o.complete) for o in done.take()] == [(1, 0, False), (2, 2, True)]
    assert "the copy broke" in caplog.text
    q.close(10)


def test_wait_idle_waits_for_a_running_job_and_a_job_after_close_ends_at_once():
    done = Completions()
    q = JobQueue("test", done)
    gate = threading.Event()
    q.submit(1, 1, lambda: (gate.wait(30), (1, 0))[1])
    assert done.wait_idle(0.05) is False and done.open == 1
    gate.set()
    assert done.wait_idle(10) is True
    q.close(10)
    q.submit(2, 4, lambda: pytest.fail("a closed queue runs nothing"))
    assert done.open == 0
    assert [(o.job_id, o.done, o.total) for o in done.take()] == [(1, 1, 1), (2, 0, 4)]


def test_close_with_cancel_ends_the_queued_jobs_without_running_them():
    done = Completions()
    q = JobQueue("test", done)
    started, gate = threading.Event(), threading.Event()
    ran: list[int] = []
    q.submit(1, 1, lambda: (started.set(), gate.wait(30), ran.append(1), (1, 0))[3])
    q.submit(2, 1, lambda: (ran.append(2), (1, 0))[1])
    q.submit(3, 1, lambda: (ran.append(3), (1, 0))[1])
    assert started.wait(10)
    q.close(timeout_s=0.01, cancel=True)  # job 1 is running (waiting at the gate): close does not wait for it here
    gate.set()
    assert done.wait_idle(10)
    assert ran == [1]  # the running job finished; the queued ones never ran
    assert [(o.job_id, o.done) for o in done.take()] == [(1, 1), (2, 0), (3, 0)]
