"""vLLM under the conditions users serve in: bfloat16 and float16 models, loads slower than the lease
TTL, requests queuing behind each other.

One engine per dtype, against a server whose lease TTL (2 s) is shorter than every hit's load (held up
3 s on purpose, as on a loaded machine) and than the queue each request waits in (``max_num_seqs=1``).
The engine computes the prompts once (storing them), drops its own prefix cache, and asks again.

Token identity is not a valid check in bf16/fp16 on a random-weight model (vLLM's own prefix cache
changes greedy tokens there too), so correctness is checked where it is exact: the KV bytes that vLLM's
paged cache holds after each load equal, chunk for chunk, the bytes the cold run stored (both read by
the connector's ``debug_dump_dir``), and the first generated token matches the cold run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvdepot.bench.engines.vllm_engines import BLOCK, Engine, connector_config, expected_hit, make_prompts

from support.servers import Server, start_server, stop_server

from .conftest import VLLM_SERVER

pytestmark = pytest.mark.timeout(900)

TTL_S = 2
LOAD_DELAY_S = 3.0  # every hit's load takes longer than a lease lives
LENGTHS = [600, 900, 700, 1000, 650, 800]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def short_ttl_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("short-ttl-server")
    s = start_server(tmp, "server", ["--lease-ttl-s", str(TTL_S)], ipc=False, base=VLLM_SERVER)
    yield s
    stop_server(s)


@dataclass
class Run:
    engine: Engine
    cold: dict
    dump: Path
    dtype: str
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def run(request, tiny_model, short_ttl_server, workdir) -> Run:
    dtype = request.param
    dump = workdir / f"dump-{dtype}"
    prompts = make_prompts(seed=50 + len(dtype), lengths=LENGTHS)
    config = connector_config(short_ttl_server.url, debug_load_delay_s=LOAD_DELAY_S, debug_dump_dir=str(dump))
    engine = Engine(tiny_model, config, workdir, name=f"slow-{dtype}", dtype=dtype, llm_kwargs={"max_num_seqs": 1})
    with engine:
        engine.generate(make_prompts(seed=99, lengths=[BLOCK - 28]), 2)  # warm-up, stores nothing
        cold = engine.generate(prompts, MAX_TOKENS)
        assert [o["num_cached_tokens"] for o in cold["outputs"]] == [0] * len(LENGTHS)
        yield Run(engine, cold, dump, dtype, prompts)


def hits(result: dict) -> list[int]:
    return [o["num_cached_tokens"] for o in result["outputs"]]


def first_tokens(result: dict) -> list[int]:
    return [o["token_ids"][0] for o in result["outputs"]]


def assert_no_lease_ran_out(server: Server, engine: Engine) -> None:
    st = server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0, "a lease or session leaked"
    assert st["expired_leases"] == 0, "a lease ran out although its holder was alive (it was not renewed)"
    assert st["request_failures"]["lease_expired"] == 0
    assert st["quarantine"]["leases"] == 0
    log = engine.tail(200_000)
    assert "uncached" not in log and "failed" not in log.split("slow-")[-1], log[-3000:]


def test_a_hit_whose_load_outlasts_the_lease_ttl_still_hits(run, short_ttl_server):
    run.engine.call({"op": "reset_prefix_cache"})
    result = run.engine.generate(run.prompts[:2], MAX_TOKENS)
    print(f"\n{run.dtype}: two hits, each load {LOAD_DELAY_S}s with a {TTL_S}s TTL: {result['seconds']:.1f}s")
    assert hits(result) == [expected_hit(n) for n in LENGTHS[:2]]
    assert first_tokens(result) == first_tokens(run.cold)[:2]
    assert_no_lease_ran_out(short_ttl_server, run.engine)


def test_queued_requests_keep_their_hits(run, short_ttl_server):
    """Six requests at once, one running at a time, each load 3 s: the last waits ~15 s, far past the
    TTL of the locks its lookup took. Every stored prefix still hits, and no lease leaks."""
    run.engine.call({"op": "reset_prefix_cache"})
    result = run.engine.generate(run.prompts, MAX_TOKENS)
    print(f"\n{run.dtype}: {len(LENGTHS)} queued hits: {result['seconds']:.1f}s")
    assert hits(result) == [expected_hit(n) for n in LENGTHS]
    assert first_tokens(result) == first_tokens(run.cold)
    assert_no_lease_ran_out(short_ttl_server, run.engine)


def test_the_loaded_kv_is_byte_for_byte_what_the_cold_run_stored(run):
    """(After the hit tests: every chunk they loaded was dumped as vLLM's paged cache held it.)"""
    saved = {p.name: p for p in (run.dump / "saved").glob("*.npy")}
    loaded = sorted((run.dump / "loaded").glob("*.npy"))
    assert len(loaded) == sum(expected_hit(n) // BLOCK for n in LENGTHS), "not every hit chunk was loaded"
    for path in loaded:
        assert path.name in saved, f"{path.name} was loaded but never stored"
        got, want = np.load(path), np.load(saved[path.name])
        assert got.dtype == want.dtype and got.dtype.itemsize == 2  # bf16/fp16 bits
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{run.dtype}: chunk {path.name[:16]} differs"
