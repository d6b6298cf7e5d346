"""``kvdepot plan``: the LRU simulation of prefix caching, its command, and the trace formats it reads."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdepot.errors import ConfigError
from kvdepot.observability.trace import TraceRecorder
from kvdepot.trace.ops import OpKind
from kvdepot.trace.reader import load_trace
from kvdepot.trace.simulate import compile_ops, curve, distinct_blocks

PY = sys.executable
REAL_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kvdepot.cli", "plan", *args], capture_output=True, text=True, timeout=120)


def _write_mooncake(path: Path, requests: list[tuple[int, list[int]]], block_tokens: int = 4) -> Path:
    with path.open("w") as f:
        for i, (length, ids) in enumerate(requests):
            f.write(json.dumps({"timestamp": i * 10, "input_length": length, "output_length": 1, "hash_ids": ids}) + "\n")
    return path


# Four requests in blocks of 4 tokens, 40 prompt tokens; worked by hand in the test below.
HAND = [(12, [1, 2, 3]), (12, [1, 2, 4]), (4, [5]), (12, [1, 2, 3])]


def test_a_hand_computed_curve(tmp_path):
    """LRU of C blocks, every request's blocks used in order after its lookup:
    C=1: never a hit -> 0.   C=3: r2 hits 1,2 (8); 4 evicts 3, 5 evicts 1, so r4 misses -> 8/40.
    C=4: r2 hits 8; 5 evicts 3, so r4 hits 1,2 only -> 16/40.   C>=5 (all blocks): r2 8 + r4 12 -> 20/40."""
    path = _write_mooncake(tmp_path / "hand.jsonl", HAND)
    r = _plan(str(path), "--block-tokens", "4", "--bytes-per-token", "1", "--sizes", "4,12,16,20,1KiB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["distinct_blocks"] == 5 and doc["block_bytes"] == 4
    got = [(p["blocks"], p["hit_tokens"], p["asked_tokens"]) for p in doc["points"]]
    assert got == [(1, 0, 40), (3, 8, 40), (4, 16, 40), (5, 20, 40), (256, 20, 40)]
    assert doc["max_hit_ratio"] == 0.5


def test_a_partial_last_block_is_never_a_hit(tmp_path):
    # 13 tokens in blocks of 4: three complete blocks (the 4th hash id is a partial block); asked counts all 13
    path = _write_mooncake(tmp_path / "partial.jsonl", [(13, [1, 2, 3, 9]), (13, [1, 2, 3, 9])])
    trace = load_trace(str(path), block_tokens=4)
    assert [op.blocks for op in trace.ops] == [(1, 2, 3), (1, 2, 3)]
    (point,) = curve(compile_ops(trace.ops), [0])
    assert (point.hit_tokens, point.asked_tokens) == (12, 26)


def test_salts_and_models_do_not_share_blocks():
    from kvdepot.trace.ops import TraceOp

    ops = [TraceOp(0, OpKind.REQUEST, (1, 2), 4, 8, model="m", salt=s) for s in ("a", "b", "a")]
    compiled = compile_ops(ops)
    assert distinct_blocks(compiled) == 4
    assert curve(compiled, [0])[0].hit_tokens == 8  # only the second "a" hits


def test_a_real_trace_gives_a_monotone_bounded_curve(tmp_path):
    lines = REAL_TRACE.read_text().splitlines()[:2000]
    path = tmp_path / "conv2000.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = _plan(str(path), "--json", "--points", "10")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    ratios = [p["hit_ratio"] for p in doc["points"]]
    assert len(ratios) == 10
    assert all(0.0 <= x <= 1.0 for x in ratios)
    assert ratios == sorted(ratios), "a bigger LRU never serves less (inclusion property)"
    assert ratios[0] < ratios[-1]
    assert doc["points"][-1]["blocks"] == doc["distinct_blocks"] and ratios[-1] == doc["max_hit_ratio"]
    # independent bound: only a block seen before can hit, so hits <= (blocks - distinct) x 512 tokens
    recs = [json.loads(x) for x in lines]
    complete = sum(min(len(x["hash_ids"]), x["input_length"] // 512) for x in recs)
    asked = sum(x["input_length"] for x in recs)
    assert doc["points"][-1]["asked_tokens"] == asked
    assert doc["points"][-1]["hit_tokens"] <= (complete - doc["distinct_blocks"]) * 512
    # default bytes a block: a Llama-3-8B-like fp16 model, 128 KiB a token
    assert doc["block_bytes"] == 128 * 1024 * 512
    assert all(p["l1_size_gb_to_set"] * 2**30 * 0.85 == pytest.approx(p["l1_bytes"]) for p in doc["points"])


def test_the_text_output_has_a_table_and_a_plot(tmp_path):
    path = _write_mooncake(tmp_path / "hand.jsonl", HAND)
    r = _plan(str(path), "--block-tokens", "4", "--bytes-per-token", "1", "--plot", "always")
    assert r.returncode == 0, r.stderr
    assert "hit ratio" in r.stdout and "50.00%" in r.stdout and "(holds the whole trace)" in r.stdout
    assert "█" in r.stdout and "L1 size" in r.stdout.splitlines()[-1]
    # sizes 4, 8, 20 bytes (1, 2, 5 blocks of 4 B): only the whole trace's 5 blocks hit at all
    assert "50% of the best hit ratio (50.00%) needs at most 20 B of L1" in r.stdout
    # what to give the server: it evicts down to its low watermark (0.85), so 20 B cached is 20 / 0.85 B of L1
    assert f"(--l1-size-gb {20 / 0.85 / 2**30:.3g})" in r.stdout and "--low-watermark (85% by default)" in r.stdout


def test_png_draws_or_says_why_not(tmp_path):
    path = _write_mooncake(tmp_path / "hand.jsonl", HAND)
    png = tmp_path / "curve.png"
    r = _plan(str(path), "--block-tokens", "4", "--png", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.returncode == 1 and "--png needs matplotlib" in r.stderr and not png.exists(), r.stderr
        assert "hit ratio" in r.stdout  # the table still comes
    else:
        assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        ("not a trace\n", "neither a Mooncake-format JSONL trace nor a kvdepot recording"),
        ('{"timestamp": 0, "input_length": 8, "hash_ids": [1, 2]}\n{"timestamp": 1}\n', "line 2: not a Mooncake trace record"),
        ('{"timestamp": 0, "input_length": 8, "hash_ids": [1, 2]}\n{"timest', "line 2: not JSON"),
    ],
)
def test_a_bad_trace_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    r = _plan(str(path))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_missing_trace_and_bad_sizes_are_clear_errors(tmp_path):
    r = _plan(str(tmp_path / "nope.jsonl"))
    assert r.returncode == 2 and "No such file" in r.stderr and "Traceback" not in r.stderr
    path = _write_mooncake(tmp_path / "hand.jsonl", HAND)
    r = _plan(str(path), "--sizes", "12 parsecs")
    assert r.returncode == 2 and "is not a size like" in r.stderr and "Traceback" not in r.stderr
    r = _plan(str(path), "--num-layers", "-3")
    assert r.returncode == 2 and "num_layers must be a positive int" in r.stderr and "Traceback" not in r.stderr


# --- the recording format ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRequestDone:
    """The event the recorder subscribes to (``kvdepot/events.py``'s fields)."""

    op: str
    t: float
    duration_s: float
    model: str
    salt: str
    keys: tuple[bytes, ...]
    chunk_tokens: int
    chunk_bytes: int
    found: int
    outcome: str
    rtype: str = ""
    prefetch_s: float = 0.0
    prefetched: int = 0
    space: bytes = b""


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") + bytes(24)  # a 32-byte hash whose first 8 bytes are i


def _event(op: str, t: float, ids: list[int], found: int, outcome: str = "ok", salt: str = "") -> ChunkRequestDone:
    return ChunkRequestDone(op, t, 0.001, "m", salt, tuple(_key(i) for i in ids), 16, 8192, found, outcome)


def test_a_recording_reads_back_as_the_ops_it_recorded(tmp_path):
    path = tmp_path / "rec.kvdtrace"
    rec = TraceRecorder(str(path), server_version="x")
    rec.handle([_event("lookup", 100.0, [1, 2, 3], 0), _event("store", 100.1, [1, 2, 3], 3), object()])
    rec.handle([_event("lookup", 100.3, [1, 2, 4], 2, salt="s"), _event("retrieve", 100.2, [1, 2], 2)])
    rec.handle([_event("store", 100.4, [1, 2, 4], 0, outcome="NO_SPACE")])
    rec.close()
    assert rec.records == 5
    trace = load_trace(str(path))
    assert trace.source == "kvdepot-recording" and trace.skipped == 1  # the failed store
    kinds = [(op.kind, op.blocks, op.found, op.salt) for op in trace.ops]
    assert kinds == [
        (OpKind.LOOKUP, (1, 2, 3), 0, ""),
        (OpKind.STORE, (1, 2, 3), 3, ""),
        (OpKind.RETRIEVE, (1, 2), 2, ""),  # sorted by arrival time, not by when it was recorded
        (OpKind.LOOKUP, (1, 2, 4), 2, "s"),
    ]
    assert [round(op.t, 6) for op in trace.ops] == [0.0, 0.1, 0.2, 0.3]
    assert trace.block_bytes == 8192 and trace.ops[0].prompt_tokens == 48
    assert trace.recorded_hit_ratio() == 2 * 16 / (48 + 48)


def test_a_tensor_parallel_servers_ranks_are_sized_apart(tmp_path):
    """Each TP rank asks for the same chunk hashes and stores its own shard: plan used to count one
    block where the server held one per rank, sizing L1 at half of what two ranks need."""
    path = tmp_path / "tp.kvdtrace"
    rec = TraceRecorder(str(path))
    events = []
    for rank in (b"rank-0..", b"rank-1.."):
        events += [ChunkRequestDone("lookup", 1.0, 0.001, "m", "", tuple(_key(i) for i in range(10)), 16, 8192, 0, "ok", space=rank),
                   ChunkRequestDone("store", 1.1, 0.001, "m", "", tuple(_key(i) for i in range(10)), 16, 8192, 10, "ok", space=rank)]  # fmt: skip
    rec.handle(events)
    rec.close()
    trace = load_trace(str(path))
    assert {op.space for op in trace.ops} == {b"rank-0..", b"rank-1.."}
    assert distinct_blocks(compile_ops(trace.ops)) == 20


def test_a_torn_last_frame_is_dropped_and_counted(tmp_path):
    path = tmp_path / "rec.kvdtrace"
    rec = TraceRecorder(str(path))
    rec.handle([_event("lookup", 1.0, [1], 0)])
    rec.handle([_event("lookup", 2.0, [1], 1)])
    rec.close()
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # the server died mid-write
    trace = load_trace(str(path))
    assert len(trace.ops) == 1 and trace.skipped == 1


@pytest.mark.parametrize("where", ["missing-dir", "a-directory", "empty"])
def test_an_unwritable_recording_path_is_a_config_error(tmp_path, where):
    path = {"missing-dir": str(tmp_path / "no" / "such" / "dir" / "t.kvdtrace"), "a-directory": str(tmp_path), "empty": ""}[where]
    with pytest.raises(ConfigError, match="--trace-record"):
        TraceRecorder(path)


def test_a_full_disk_stops_the_recording_not_the_caller(small_tmpfs):
    rec = TraceRecorder(str(small_tmpfs / "rec.kvdtrace"))  # a 1 MiB file system
    rec.handle([_event("lookup", 1.0, [1, 2], 0)])
    assert rec.records == 1 and not rec.failed
    rec.handle([_event("lookup", 2.0, list(range(64)), 0)] * 4000)  # ~2 MiB: ENOSPC, raised nowhere
    assert "No space left" in rec.failed and rec.records == 1
    rec.handle([_event("lookup", 3.0, [1], 0)])  # ignored once stopped
    rec.close()
    assert rec.records == 1


def test_a_recording_is_readable_by_its_owner_only(tmp_path):
    fresh, old = tmp_path / "rec.kvdtrace", tmp_path / "old.kvdtrace"
    old.write_bytes(b"x")
    old.chmod(0o644)
    for path in (fresh, old):
        TraceRecorder(str(path)).close()
        assert path.stat().st_mode & 0o777 == 0o600  # it names every tenant's salt


def test_a_restart_keeps_the_previous_recording_and_a_planted_link_is_refused(tmp_path):
    """A supervisor restarting a crashed server with the same flags used to erase the recording of
    the traffic that led to the crash; and a link at the path had its target truncated."""
    path = tmp_path / "rec.kvdtrace"
    first = TraceRecorder(str(path))
    first.handle([_event("lookup", 1.0, [1, 2], 0)])
    first.close()
    TraceRecorder(str(path)).close()  # the restart
    assert len(load_trace(str(tmp_path / "rec.kvdtrace.1")).ops) == 1 and load_trace(str(path)).ops == []
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "link.kvdtrace"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="--trace-record"):
        TraceRecorder(str(link))
    assert victim.read_bytes() == b"precious"


def test_a_recording_of_models_with_different_chunk_bytes_is_planned_one_model_at_a_time(tmp_path):
    """The simulation counts blocks and sizes them alike: a server of a small and a large model used to
    be sized by whichever model the recording named first."""
    path = tmp_path / "two.kvdtrace"
    rec = TraceRecorder(str(path))
    events = []
    for model, nbytes in (("small", 8192), ("large", 65536)):
        events += [ChunkRequestDone("lookup", 1.0, 0.001, model, "", tuple(_key(i) for i in range(10)), 16, nbytes, 0, "ok"),
                   ChunkRequestDone("store", 1.1, 0.001, model, "", tuple(_key(i) for i in range(10)), 16, nbytes, 10, "ok")]  # fmt: skip
    rec.handle(events)
    rec.close()
    r = _plan(str(path), "--json")
    assert r.returncode == 2 and "small: 16 tokens / 8 KiB" in r.stderr and "large: 16 tokens / 64 KiB" in r.stderr, r.stderr
    assert "--model NAME" in r.stderr
    for model, nbytes in (("small", 8192), ("large", 65536)):
        r = _plan(str(path), "--model", model, "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["model"] == model and doc["block_bytes"] == nbytes and doc["distinct_blocks"] == 10
    r = _plan(str(path), "--model", "other")
    assert r.returncode == 2 and "its models: large, small" in r.stderr, r.stderr
    # One size for everything, given: one curve over both models.
    r = _plan(str(path), "--bytes-per-token", "1024", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["distinct_blocks"] == 20
