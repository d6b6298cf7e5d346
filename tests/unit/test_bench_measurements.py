"""What the benchmarks report, checked without timing anything: their helpers run against in-process
stand-ins for the server and client, so a ratio, a unit or a check that is wrong shows as a wrong
figure here rather than in a published table."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdepot.bench import load, tiers
from kvdepot.bench import stats as bench_stats

MiB = 1 << 20


def test_load_paced_ratio_needs_a_one_client_run():
    def row(n, p50, p99):
        return load.LoadResult("shm", "own", n, 5.0, 10, 1, 1, 1, 1, 1, 1, 5.0, p50, p99, 1, 1)

    results = [row(4, 2000.0, 4000.0), row(16, 2500.0, 9000.0)]  # --clients 4,16: no 1-client run
    args = SimpleNamespace(tokens=4096, rate=5.0)
    out = io.StringIO()
    with redirect_stdout(out):
        load._print(results, {t: 10.0 for t in range(1, 257)}, {"tcp": 1e-4, "ipc": 1e-4}, args, 2 * MiB, "0", "0")
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("| shm")]
    col = [ln.split("|")[9].strip() for ln in lines]  # "paced p99 / 1-client paced p50"
    # it was 4000/2000 = 2.0 and 9000/2000 = 4.5: a ratio to the 4-client p50 under a 1-client heading
    assert col == ["—", "—"]


# --- tiers: LOOKUP from the fs L2 -----------------------------------------------------------------------


class _FakeServer:
    def __init__(self, *a, **k) -> None:
        self.url = "tcp://fake"
        self.cleared = False
        _FakeServer.last = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def status(self):
        return {"l2_controllers": {"store": {"queued": 0, "in_flight": 0}}}

    def clear(self, scope: str = "l1"):
        self.cleared = True


class _FakeL2Client:
    """``miss_after_clear``: the first LOOKUP after a clear finds nothing (the L2 load failed or had not
    come in), the next one finds all (L1 filled behind it) -- what a real server answers when a prefetch
    fails midway and a later one succeeds."""

    miss_after_clear = False

    def __init__(self, *a, **k) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def store(self, tokens, kv):
        return len(tokens)

    def lookup(self, tokens):
        server = _FakeServer.last
        if self.miss_after_clear and server.cleared:
            server.cleared = False
            return 0
        server.cleared = False
        return len(tokens)


def _patch_l2(monkeypatch, seconds: float, drops: list | None = None):
    import kvdepot.bench.serverproc as sp
    import kvdepot.client.client as cc

    monkeypatch.setattr(sp, "ServerProcess", _FakeServer)
    monkeypatch.setattr(sp, "free_port", lambda *a, **k: 1)
    monkeypatch.setattr(cc, "KVClient", _FakeL2Client)
    real_timed = bench_stats.timed

    def fixed_timed(fn, reps, warmup=1, setup=None):
        real_timed(fn, reps, warmup, setup)  # run the benchmark's own calls
        return [seconds] * reps  # and say each took ``seconds``

    monkeypatch.setattr(tiers, "timed", fixed_timed)
    if drops is not None:
        monkeypatch.setattr(tiers, "_drop_cache", lambda path: drops.append(Path(path)))


def test_lookup_l2_effective_rate_is_gb_not_gib(monkeypatch, tmp_path):
    _patch_l2(monkeypatch, 0.25)
    rows = tiers._lookup_from_l2(tmp_path, 3, {})
    row = rows[1]  # 32k tokens x 8 KiB = 256 MiB = 0.268 GB, in 0.25 s
    got = float(re.search(r"([\d.]+) GB/s", row.limit)[1])
    assert got == pytest.approx(268435456 / 0.25 / 1e9, abs=0.006)  # it printed 1.00 (GiB/s)


def test_lookup_l2_timed_lookups_must_be_hits(monkeypatch, tmp_path):
    _patch_l2(monkeypatch, 0.25)
    monkeypatch.setattr(_FakeL2Client, "miss_after_clear", True)
    # Every timed LOOKUP (each right after a clear) found 0 tokens; it checked one untimed LOOKUP
    # afterwards (no clear before it), which found all, and printed a "hit from L2" time.
    with pytest.raises(AssertionError, match="found 0 of"):
        tiers._lookup_from_l2(tmp_path, 3, {})


def test_lookup_l2_reads_are_cold(monkeypatch, tmp_path):
    drops: list[Path] = []
    _patch_l2(monkeypatch, 0.25, drops)
    tier = tmp_path / "lookup-tier" / "ab"
    tier.mkdir(parents=True)
    files = [tier / f"obj{i}" for i in range(4)]
    for f in files:
        f.write_bytes(b"x" * 4096)
    tiers._lookup_from_l2(tmp_path, 3, {})
    # 2 prompt lengths x (1 warm-up + 3 reps): each timed lookup starts with the tier's files dropped
    # from the page cache, like the table's other fs reads ("fs reads are cold (fadvise DONTNEED)").
    assert sorted(set(drops)) == sorted(files) and len(drops) == 2 * 4 * len(files)
