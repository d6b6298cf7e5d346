"""``kvdepot replay`` against real servers, and ``--trace-record``: a recorded run replayed reproduces its
hit ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.servers import CHUNK, LAYOUT, make_kv, make_tokens

PY = sys.executable
REAL_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def _kvdepot(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvdepot.cli", *args], capture_output=True, text=True, timeout=timeout)


def _json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _layout_args() -> list[str]:
    return ["--num-layers", str(LAYOUT.num_layers), "--num-kv-heads", str(LAYOUT.num_kv_heads), "--head-dim", str(LAYOUT.head_dim)]


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    """150 requests of a public trace, and one prompt shorter than a block; in blocks of CHUNK tokens
    their 2k distinct blocks (8 KiB each) fit the test server's 64 MiB L1 well under its watermark:
    nothing is evicted."""
    path = tmp_path_factory.mktemp("trace") / "conv150.jsonl"
    short = json.dumps({"timestamp": 10**7, "input_length": CHUNK - 1, "output_length": 1, "hash_ids": [0]})
    path.write_text("\n".join(REAL_TRACE.read_text().splitlines()[:150] + [short]) + "\n")
    return path


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_replay_hits_what_the_simulation_predicts(make_server, small_trace, transport):
    srv = make_server()
    plan = _json(_kvdepot("plan", str(small_trace), "--block-tokens", str(CHUNK), "--sizes", "1TiB", "--json"))
    assert plan["points"][0]["blocks"] >= plan["distinct_blocks"]  # an L1 that never evicts
    url = srv.url if transport == "shm" else srv.ipc_url
    got = _json(_kvdepot("replay", str(small_trace), "--server", url, "--block-tokens", str(CHUNK), "--transport", transport,
                         *_layout_args(), "--json"))  # fmt: skip
    want = plan["points"][0]
    assert got["errors"] == {} and got["transports"] == [transport]
    assert got["ops"] == plan["ops"] == 151
    assert (got["hit_tokens"], got["asked_tokens"]) == (want["hit_tokens"], want["asked_tokens"])
    assert got["hit_ratio"] == pytest.approx(plan["max_hit_ratio"]) and got["hit_ratio"] > 0
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    # nothing evicted: every distinct block stored exactly once, every hit chunk read back once
    assert got["chunks_stored"] == plan["distinct_blocks"] and got["bytes_stored"] == plan["distinct_blocks"] * chunk_bytes
    assert got["chunks_retrieved"] == want["hit_tokens"] // CHUNK and got["bytes_retrieved"] == got["chunks_retrieved"] * chunk_bytes
    assert srv.status()["l1"]["objects"] == plan["distinct_blocks"]
    lat = got["latency"]
    assert lat["lookup"]["n"] == 150 and 0 < lat["lookup"]["p50_ms"] <= lat["lookup"]["p99_ms"]
    assert lat["store"]["n"] > 0 and lat["retrieve"]["n"] > 0


def test_replay_text_output_and_a_second_run_hits_everything(make_server, small_trace):
    srv = make_server()
    args = ["replay", str(small_trace), "--server", srv.url, "--block-tokens", str(CHUNK), "--limit", "20", *_layout_args()]
    first = _kvdepot(*args)
    assert first.returncode == 0, first.stderr
    assert "replayed 20 requests" in first.stdout and "hit ratio:" in first.stdout and "lookup" in first.stdout
    again = _json(_kvdepot(*args, "--json"))  # the same requests again: every complete block is stored now
    complete = sum(min(len(x["hash_ids"]), x["input_length"] // CHUNK) for x in map(json.loads, small_trace.read_text().splitlines()[:20]))
    assert again["hit_tokens"] == complete * CHUNK and again["chunks_stored"] == 0


def test_replay_refuses_bad_input_clearly(tmp_path, small_trace):
    r = _kvdepot("replay", str(small_trace), "--server", "http://127.0.0.1:1")
    assert r.returncode == 2 and "is not tcp://HOST:PORT" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("garbage\n")
    r = _kvdepot("replay", str(bad), "--server", "tcp://127.0.0.1:1")
    assert r.returncode == 2 and "neither a Mooncake-format" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- --trace-record -----------------------------------------------------------------------------------


def _engine_like_workload(client, seed: int) -> tuple[int, int]:
    """Requests over three shared prefixes with repeating tails, two tenants, loads of what hit, and a
    quarter of the requests that store nothing (so a replay that stored every miss would differ).
    Returns (hit tokens, asked tokens) as the client saw them."""
    prefixes = [make_tokens(4 * CHUNK, seed + i) for i in range(3)]
    hit = asked = 0
    for i in range(40):
        tokens = np.concatenate([prefixes[i % 3], make_tokens(2 * CHUNK, seed + 100 + i % 7)])
        salt = "tenant-a" if i % 5 == 0 else None
        n = client.lookup(tokens, cache_salt=salt)
        hit, asked = hit + n, asked + len(tokens)
        if n:
            assert client.retrieve(tokens[:n], cache_salt=salt).shape[2] == n
        if i % 4 != 3:
            client.store(tokens, make_kv(LAYOUT, len(tokens), seed + i), cache_salt=salt)
    return hit, asked


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_recorded_run_replayed_reproduces_its_hit_ratio(make_server, tmp_path, seed, transport):
    recording = tmp_path / "run.kvdtrace"
    srv = make_server("--trace-record", str(recording), name="recorded")
    with srv.client(transport=transport) as c:
        hit, asked = _engine_like_workload(c, seed)
    assert 0 < hit < asked
    assert srv.stop() == 0  # a clean shutdown hands the last events to the recorder and closes the file

    plan = _json(_kvdepot("plan", str(recording), "--json"))
    assert plan["source"] == "kvdepot-recording" and plan["skipped"] == 0
    assert plan["recorded_hit_ratio"] == pytest.approx(hit / asked)  # the recording says what the client saw
    assert plan["block_bytes"] == LAYOUT.chunk_bytes(CHUNK)

    fresh = make_server(name="fresh")
    got = _json(_kvdepot("replay", str(recording), "--server", fresh.url, *_layout_args(), "--json"))
    assert got["errors"] == {} and got["skipped"] == 0
    assert (got["hit_tokens"], got["asked_tokens"]) == (hit, asked)
    assert got["hit_ratio"] == pytest.approx(got["recorded_hit_ratio"])
    assert got["latency"]["lookup"]["n"] == 40


def test_an_unwritable_trace_record_path_stops_the_start_clearly(tmp_path):
    for path in (tmp_path / "no" / "such" / "dir" / "t.kvdtrace", tmp_path):
        r = _kvdepot("server", "--port", "0", "--ipc-path", str(tmp_path / "s.ipc"), "--http-port", "0",
                     "--l1-size-gb", "0.0625", "--trace-record", str(path), timeout=60)  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert f"--trace-record {path}: cannot write there" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_trace_record_without_the_event_bus_is_refused(tmp_path):
    path = tmp_path / "t.kvdtrace"
    r = _kvdepot("server", "--port", "0", "--ipc-path", str(tmp_path / "s.ipc"), "--http-port", "0", "--l1-size-gb", "0.0625",
                 "--event-queue-size", "0", "--trace-record", str(path), timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--trace-record needs the event bus" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not path.exists()


def test_a_server_that_cannot_bind_leaves_an_older_recording_as_it_was(tmp_path):
    import socket

    path = tmp_path / "old.kvdtrace"
    path.write_bytes(b"an older recording")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _kvdepot("server", "--port", str(port), "--http-port", "0", "--l1-size-gb", "0.0625", "--trace-record", str(path), timeout=60)
    assert r.returncode == 2 and f"--port {port}" in r.stderr, r.stderr
    assert path.read_bytes() == b"an older recording"


def test_bench_hit_ratio_tracks_the_lru_oracle_on_chat_and_agentic_workloads(tmp_path):
    """A real server's hit ratio on the conversation trace and on the agentic workload synthesized from
    it lies between the LRU oracle at its low and its high watermark (it evicts in bulk from one down
    to the other), with a small margin: a server that evicted hot blocks, or kept nothing, falls out."""
    out = tmp_path / "hit.json"
    r = subprocess.run([PY, "-m", "kvdepot.cli", "bench", "hit-ratio", "--requests", "400", "--trace", str(REAL_TRACE), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["workload"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"conversation trace", "agentic (synthesized)"}
    for row in rows.values():
        assert row["requests"] == 400 and not row["errors"], row
        assert 0 < row["oracle_low"] <= row["oracle_high"] < row["unbounded"], row  # L1 is the bottleneck: there is something to lose
        assert row["oracle_low"] - 0.02 <= row["server_ratio"] <= row["oracle_high"] + 0.02, row
    assert rows["agentic (synthesized)"]["sessions"] < rows["conversation trace"]["sessions"]  # many turns per session


def test_a_recorded_run_of_suffix_stores_replayed_reproduces_its_hit_ratio(make_server, tmp_path, seed):
    """Engine connectors store only the chunks a request computed: the vLLM connector saves
    ``hashes[stored:full]`` (after a hit, and piece by piece in a chunked prefill), SGLang's backend the
    pages it was handed. A recording of such a run names a chain's tail in a STORE: its replay must store
    the very chunks the later lookups ask for, or the replay reports misses the server never had."""
    recording = tmp_path / "suffix.kvdtrace"
    srv = make_server("--trace-record", str(recording), name="recorded-suffix")
    hit = asked = 0
    with srv.client(transport="inline") as c:
        prefix = make_tokens(2 * CHUNK, seed)
        for i in range(4):
            tokens = np.concatenate([prefix, make_tokens(2 * CHUNK, seed + 1 + i)])
            hashes = c.hashes(tokens)
            n = c.stored_chunks(hashes, "")
            hit, asked = hit + n * CHUNK, asked + len(tokens)
            with c.prepare_store(hashes[n:]) as slots:  # what an engine computed: the chunks past its hit
                for slot in slots:
                    if slot is not None:
                        slot[...] = 1
            assert c.stored_chunks(hashes, "") == len(hashes)
            hit, asked = hit + len(tokens), asked + len(tokens)
    assert srv.stop() == 0
    fresh = make_server(name="fresh-suffix")
    got = _json(_kvdepot("replay", str(recording), "--server", fresh.url, *_layout_args(), "--json"))
    assert got["errors"] == {}
    assert got["hit_ratio"] == pytest.approx(got["recorded_hit_ratio"])
    assert (got["hit_tokens"], got["asked_tokens"]) == (hit, asked)
