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


# --- benchmarks/vllm_ttft.py: a "hit" that found nothing is not timed as a hit ----------------------------


def _vllm_ttft():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_ttft.py"
    spec = importlib.util.spec_from_file_location("vllm_ttft_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_floor_leaves_out_kvdepot_hits_that_brought_less_than_vllms_own(capsys):
    """Two of four kvdepot "hits" found nothing (recomputed, 1.6 s): the floor's median took them in and
    read 4.02 x vLLM's own hit, where the hits that hit read 1.62 x, and nothing said two were misses."""
    vt = _vllm_ttft()
    F = vt.FloorRecord
    recs = []
    for d, (t, cached, mib) in enumerate([(0.40, 4096, 32.0), (0.41, 4096, 32.0), (1.60, 0, 0.0), (1.65, 0, 0.0)]):
        recs += [F(d, "cold", 4128, 1.6, 0, [1]), F(d, "own", 4128, 0.25, 4096, [1]),
                 F(d, "kvdepot", 4128, t, cached, [1], load_ms=20.0 if cached else 0.0, retrieve_ms=10.0 if cached else 0.0,
                   copy_ms=10.0 if cached else 0.0, loaded_mib=mib)]  # fmt: skip
    out = vt.report_floor(recs)
    assert out["ratio"] == pytest.approx(0.405 / 0.25) and out["short_hits"] == 2
    assert "doc2 0/4096 tokens" in capsys.readouterr().out  # said, not hidden


def test_the_hit_columns_leave_out_hits_that_found_nothing_and_count_them():
    vt = _vllm_ttft()
    R = vt.Record
    recs = [R("qa", "miss", "r0/doc0(4096)/q0", 4128, 1.6, 1.7, 0, [1]), R("qa", "miss", "r0/doc1(6144)/q0", 6176, 2.6, 2.7, 0, [1]),
            R("qa", "hit", "r0/doc0(4096)/q1", 4128, 0.20, 0.3, 4096, [1]), R("qa", "hit", "r0/doc1(6144)/q1", 6176, 0.21, 0.3, 6144, [1]),
            R("qa", "hit", "r0/doc0(4096)/q2", 4128, 1.60, 1.7, 0, [1]), R("qa", "hit", "r0/doc1(6144)/q2", 6176, 2.60, 2.7, 0, [1])]  # fmt: skip
    s = vt.summarize("lmcache", recs)
    assert s["qa_hit"] == pytest.approx(0.205) and s["hits_found_nothing"] == 2  # it read 0.905 s


# --- bench soak: a prefetch poll the server never answered is unanswered, not refused ---------------------


def test_a_prefetch_poll_the_server_never_answered_counts_as_unanswered(monkeypatch, capsys):
    """A LOOKUP against a server with L2 tiers polls its prefetch; a poll with no reply became
    PrefetchTooSlow, which the soak counted as a refusal: a server that stopped answering polls still
    showed "0 unanswered"."""
    import json
    import sys
    import threading

    from kvdepot.bench import soak_client
    from kvdepot.client.context import ContextLink
    from kvdepot.errors import KVDepotTimeout

    go = threading.Event()

    class Stdin:  # "stop" once the first round ran
        def __iter__(self):
            go.wait(10)
            yield "stop\n"

    def request(body, timeout_s=None):
        raise KVDepotTimeout("QueryPrefetchStatusRequest got no reply in time")

    link = SimpleNamespace(registration=SimpleNamespace(l2_tiers=["fs"], context_id=1), lookup=lambda *a, **k: None,
                           _timeout=lambda: 0.05, request=request, finish=lambda body: None)  # fmt: skip

    class Client:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def hashes(self, tokens):
            return [bytes([i % 256]) * 16 for i in range(len(tokens) // soak_client.CHUNK_TOKENS)]

        def store(self, tokens, kv):
            return len(tokens)

        def ping(self):
            return True

        def lookup(self, tokens):
            try:
                return ContextLink.stored_chunks(link, self.hashes(tokens), "") * soak_client.CHUNK_TOKENS
            finally:
                go.set()

    import kvdepot.client.client as cc

    monkeypatch.setattr(sys, "stdin", Stdin())
    monkeypatch.setattr(cc, "KVClient", Client)
    soak_client.main({"url": "x", "uid": 1, "seed": 1, "transport": "shm", "timeout_s": 1.0, "report_every_s": 60})
    counts = json.loads([line for line in capsys.readouterr().out.splitlines() if line.strip()][-1])["counts"]
    assert counts.get("unanswered.prefetch_poll", 0) >= 1 and counts["unanswered"] >= 1
    assert not any(k.startswith("refused.PREFETCH_TOO_SLOW") for k in counts)


# --- bench tiers: a load that wrote nothing must not pass the check -----------------------------------


def test_tiers_load_check_sees_the_adapters_own_bytes(monkeypatch, tmp_path):
    """The raw GET of each repetition wrote the right bytes into the same destinations just before the
    adapter's load, so the "load (verified)" check passed for a load that wrote nothing at all."""
    from kvdepot.storage.l2.memory_adapter import MemoryAdapter

    monkeypatch.setattr(MemoryAdapter, "_get_into", lambda self, key, dest: True)  # says loaded, writes nothing
    args = SimpleNamespace(adapters="memory", sizes_mib="1", objects=2, reps=1, fs_path=str(tmp_path), json=None, quick=False)
    with pytest.raises(AssertionError, match="loaded bytes differ"), redirect_stdout(io.StringIO()):
        tiers.main(args)


# --- bench peer: a remote get that wrote nothing must not be timed as one ----------------------------------


def test_peer_remote_get_bytes_are_checked(monkeypatch):
    """``bench peer`` checked that ``batch_get_into`` said True for every page, never the bytes: a data
    plane that answered True and delivered nothing (or the wrong pages) printed its GB/s as a remote get.
    The raw socket's reads land in the same buffers first, so the check has to see the get's bytes alone."""
    import os

    import numpy as np

    from kvdepot.bench import peer

    monkeypatch.setattr(peer, "PAYLOAD_BYTES", 8 * MiB)  # small, for the test: the owner and the check agree on it
    monkeypatch.setattr(peer, "_raw_connections", lambda port, n: [SimpleNamespace(close=lambda: None)] * n)

    def raw_read(conns, dests, per_batch):  # the raw socket delivers the owner's pages, as the real one does
        payload = np.frombuffer(np.random.default_rng(1).bytes(peer.PAYLOAD_BYTES), np.uint8)  # as the owner makes it
        for i, d in enumerate(dests):
            off = peer._page_offset(i, d.nbytes)
            d[:] = payload[off : off + d.nbytes]
        return 0.01

    monkeypatch.setattr(peer, "_raw_read", raw_read)
    monkeypatch.setattr(peer, "memcpy_seconds", lambda nbytes: 0.01)
    owner = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()), raw_port=0,
                            command=lambda line: {"stored": int(line.split()[2])} if line.startswith("set") else {})  # fmt: skip
    reader = SimpleNamespace(node=SimpleNamespace(located=set()), batch_get_into=lambda names, views: [True] * len(names),
                             batch_set=lambda names, pages: [True] * len(names), clear=lambda: None)  # fmt: skip
    with pytest.raises(AssertionError, match="differ"):
        peer._bench_size(reader, owner, 1 * MiB, 4 * MiB, [1], 1, {})


# --- bench transfer: the "retrieve incl. paged scatter" row checks what the scatter wrote ----------------------


def test_transfer_paged_scatter_rows_are_checked(monkeypatch, tmp_path):
    """The paged cache was one value everywhere (1.0) and nothing was compared after the timed scatters:
    a retrieve that scattered nothing (or into the wrong blocks) printed its GB/s all the same."""
    from kvdepot.bench import serverproc, transfer

    monkeypatch.setattr(transfer, "scatter_chunks", lambda views, caches, block_ids: None)  # writes nothing
    server = serverproc.ServerProcess(args=["--l1-size-gb", "0.25", "--log-level", "warning", "--no-prefault"],
                                      http_port=serverproc.free_port(), ipc_path=str(tmp_path / "s.sock"), log_path=str(tmp_path / "s.log"))  # fmt: skip
    with server, pytest.raises(AssertionError, match="scatter"):
        transfer._bench_size(server, 2, 2, ["shm"], 1, 0, {})
