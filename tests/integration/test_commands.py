"""The commands a newcomer runs first: ``kvdepot demo`` and ``kvdepot bench transfer|tiers``, as real
processes, small. They must run to the end and report every row they promise; no figure is judged here
(performance is the benchmarks' business), only that each was measured.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

KVDEPOT = [sys.executable, "-m", "kvdepot.cli"]


def run(*args: str, cwd: Path, timeout: float = 240) -> str:
    r = subprocess.run([*KVDEPOT, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"kvdepot {' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def measured(value: str) -> float:
    """The leading number of a row's value ("7.3 GB/s (…)", "204 / 281 µs", "17.9 ms (…)")."""
    m = re.match(r"\s*([0-9.]+)", value)
    assert m, f"no figure in {value!r}"
    return float(m.group(1))


def test_synthetic_demo_runs_both_transports_bit_exact(tmp_path):
    out = run("demo", "--synthetic", "--l1-size-gb", "0.25", cwd=tmp_path)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("shm ", "inline "))}
    assert set(rows) == {"shm", "inline"}, out
    assert all(r[-1] == "yes" for r in rows.values()), out  # the bit-exact column
    assert "demo passed" in out



def test_synthetic_demo_keeps_its_servers_log_in_the_workdir_it_is_given(tmp_path):
    """README: "The logs of everything the demo starts stay in the work directory it prints"; the
    synthetic demo took --workdir and dropped it, its server's log deleted whatever happened."""
    work = tmp_path / "demo-work"
    out = run("demo", "--synthetic", "--l1-size-gb", "0.25", "--workdir", str(work), cwd=tmp_path)
    log = work / "server.log"
    assert log.is_file() and "serving on" in log.read_text(), out
    assert str(work) in out, out

def test_bench_transfer_reports_every_row_against_its_limit(tmp_path):
    out_json = tmp_path / "transfer.json"
    run("bench", "transfer", "--quick", "--sizes-mib", "2", "--chunks", "4", "--l1-size-gb", "0.25", "--json", str(out_json), cwd=tmp_path)
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["rows"]}
    for family in ("memcpy", "shm 4 x 2 MiB store", "shm 4 x 2 MiB retrieve", "inline (ipc) 4 x 2 MiB store", "PING tcp", "LOOKUP 32k tokens tcp p50, from a Python list"):
        assert any(name.startswith(family) for name in rows), f"no {family!r} row in {list(rows)}"
    for name, row in rows.items():
        assert measured(row["value"]) > 0, (name, row)
        if row["ratio"]:
            assert float(row["ratio"]) > 0, (name, row)  # every figure stands next to its limit


def test_bench_peer_reports_first_reads_and_reads_again_against_the_raw_socket(tmp_path):
    out_json = tmp_path / "peer.json"
    run("bench", "peer", "--quick", "--sizes-kib", "256", "--threads", "1", "--json", str(out_json), cwd=tmp_path)
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["rows"]}
    for name in ("remote get 256 KiB pages, 1 thread", "remote get 256 KiB pages, 1 thread, read again", "set 256 KiB pages",
                 "batch_exists, 128 keys (2 nodes", "batch_exists, 128 keys (3 nodes: records on another",
                 "batch_exists, 128 keys (3 nodes: records on both"):
        assert any(n.startswith(name) for n in rows), f"no {name!r} row in {list(rows)}"
    for name, row in rows.items():
        assert measured(row["value"]) > 0, (name, row)
        if row["ratio"]:
            assert float(row["ratio"].split()[0]) > 0, (name, row)


def test_bench_load_runs_every_client_count_and_path(tmp_path):
    """Several client processes against one server, both paths, own and shared prompts: every run
    completed rounds in its window and moved bytes (a client that reads wrong counts raises)."""
    out_json = tmp_path / "load.json"
    out = run("bench", "load", "--quick", "--tokens", "1024", "--l1-size-gb", "0.25", "--json", str(out_json), cwd=tmp_path)
    results = json.loads(out_json.read_text())["results"]
    runs = {(r["transport"], r["prompts"], r["clients"]) for r in results}
    assert runs == {(t, p, n) for t in ("shm", "inline") for p in ("own", "shared") for n in (1, 4)}, runs
    for r in results:
        assert r["rounds"] >= r["clients"] and r["gbps"] > 0, r
        assert 0 < r["lookup_p50_us"] <= r["lookup_p99_us"] and 0 < r["paced_lookup_p50_us"] <= r["paced_lookup_p99_us"], r
    assert "| shm | shared | 4 |" in out


def test_bench_tiers_reports_every_adapter(tmp_path, valkey_server, s3_server):
    # The command starts its own backends (as a user runs it); the fixtures only make sure the binaries
    # are there and fail with the install step if not.
    out_json = tmp_path / "tiers.json"
    run("bench", "tiers", "--quick", "--sizes-mib", "2", "--objects", "4", "--json", str(out_json), cwd=tmp_path)
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["rows"]}
    for adapter in ("fs", "valkey", "s3", "memory"):
        for op in ("store", "load (verified)"):
            assert f"{adapter} 4 x 2 MiB {op}" in rows, f"no {adapter} {op} row in {list(rows)}"
    assert any(name.startswith("LOOKUP 8k tokens, all hits from fs L2") for name in rows)
    pressure = {name: row for name, row in rows.items() if name.startswith("write-through, one writer")}
    assert len(pressure) == 3, list(rows)
    for name, row in rows.items():
        if name in pressure:  # "N evicted of M": what eviction took before the push, of what was written
            evicted, total = map(int, re.match(r"(\d+) evicted of (\d+)$", row["value"]).groups())
            assert 0 <= evicted <= total and total > 0, (name, row)
            if row["target"] == "0":
                assert evicted == 0, (name, row)  # L2 keeps up: nothing may be lost to it
        else:
            assert measured(row["value"]) > 0, (name, row)


def test_bench_gpu_runs_its_own_code_on_the_cpu_and_refuses_to_invent_gpu_figures(tmp_path):
    """Without a GPU, ``kvdepot bench gpu`` says what it needs and exits 2; ``--device cpu`` runs every
    row of the benchmark's code (the same paths, host memory) with its limits, and every byte moved is
    checked inside it. Its figures are the CPU's, labelled so."""
    from kvdepot.gpu.runtime import cuda_available

    if not cuda_available():
        r = subprocess.run([*KVDEPOT, "bench", "gpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "NVIDIA GPU" in r.stderr, (r.returncode, r.stderr)
    out_json = tmp_path / "gpu.json"
    out = run("bench", "gpu", "--device", "cpu", "--quick", "--sizes-mib", "2", "--chunks", "4", "--l1-size-gb", "0.25",
              "--json", str(out_json), cwd=tmp_path)  # fmt: skip
    assert "dry run" in out and "not measured here" in out
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())["rows"]}
    for family in ("host memcpy (CPU dry run) D2H", "paged gather", "paged scatter", "store, worker-driven shm", "retrieve, worker-driven shm",
                   "store, server-driven host_file", "retrieve, server-driven host_file"):  # fmt: skip
        assert any(name.startswith(family) for name in rows), f"no {family!r} row in {list(rows)}"
    for name, row in rows.items():
        assert measured(row["value"]) > 0 and float(row["ratio"]) > 0, (name, row)


def test_a_command_whose_reader_stops_early_ends_without_a_traceback(tmp_path):
    """`kvdepot status --json | head`: the reader closes the pipe; the command ends quietly (exit 1), as
    any shell tool does, rather than with a BrokenPipeError traceback."""
    p = subprocess.Popen([*KVDEPOT, "keygen", str(tmp_path / "keys")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command prints a line: its first print meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(60) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert (tmp_path / "keys" / "server.key").is_file()  # what it was asked to do is done
