"""``kvdepot bench soak``: many clients, a mixed workload, and the faults a server meets in a day.

One real server (a small L1, a small fs tier, and a real Valkey tier when ``valkey-server`` is
installed) and ``--clients`` client processes (``soak_client``: an engine-like workload that checks
every byte it reads). The run has two phases:

    warm-up (no faults)  ->  steady state sampled  ->  faults until --minutes  ->  clients stopped
                                                                               ->  quiet  ->  checks

During the fault phase, in rotation: a client is SIGKILLed (a replacement starts), a client is
SIGSTOPped past the server's client timeout and then continued (its leases are revoked while it may
still read the arena: the quarantine rule is what keeps its bytes right), and the Valkey server is
SIGKILLed and started again, empty, a few seconds later. All along L1 overflows and the fs tier fills
(both are sized a fraction of what the clients write).

At the end every client is told to stop; killed ones are left for the server to notice. Then the
checks, each printed with its figure: no lease, quarantined byte, writing or read-locked object is
left; the server's anonymous memory, open files and threads are back to their steady state (a
margin for the allocator); clearing L1 frees the whole arena in one piece (no leaked allocation);
no request went unanswered; every byte read matched; the faults really happened (kills, stops,
restarts, L1 evictions, the disk tier full); every tier is healthy again; the server is still up and
logged no traceback. The exit code is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.bench.backends import ValkeyServer, find_valkey_binary
from kvdepot.bench.serverproc import ServerProcess, free_port, wait_prefault
from kvdepot.bench.soak_client import CHUNK_TOKENS, SOAK_LAYOUT
from kvdepot.bench.stats import loadavg

MiB = 1 << 20
FAULTS = ("kill_client", "stop_client", "restart_valkey")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0, help="the whole run, warm-up included (default: %(default)s)")
    p.add_argument("--clients", type=int, default=6, help="client processes at any time (default: %(default)s)")
    p.add_argument("--transport", default="shm", choices=("shm", "inline"), help="the clients' path (default: %(default)s)")
    p.add_argument("--l1-size-gb", type=float, default=0.125, help="server L1, small so it overflows (default: %(default)s)")
    p.add_argument("--disk-size-gb", type=float, default=0.0625, help="the fs tier, small so it fills (default: %(default)s)")
    p.add_argument("--client-timeout-s", type=float, default=3.0,
                   help="the server's --client-timeout-s; a stopped client stays stopped 1 s longer (default: %(default)s)")  # fmt: skip
    p.add_argument("--no-valkey", action="store_true", help="no Valkey tier (and no backend restarts) even when valkey-server is installed")
    p.add_argument("--seed", type=int, default=0, help="which clients the faults pick (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the figures and the checks as JSON to this path")


# --- the clients --------------------------------------------------------------------------------------


class SoakClient:
    """One ``soak_client`` process; a thread keeps its latest counters."""

    def __init__(self, url: str, uid: int, transport: str, log_dir: Path) -> None:
        self.uid = uid
        spec = {"url": url, "uid": uid, "seed": uid, "transport": transport, "timeout_s": 10.0}
        self.stderr = open(log_dir / f"client-{uid}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.soak_client", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        self.last: dict = {"counts": {}, "mismatches": [], "final": False}
        self.fate = "running"  # running, killed, stopped (told to, at the end), hung (did not stop when told), died (on its own)
        self.paused = False  # SIGSTOPped now
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.last = json.loads(line)
            except ValueError:
                pass

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()
        self.fate = "killed"

    def finish(self, timeout_s: float) -> None:
        """Ask it to stop and wait for its last counters."""
        if self.proc.poll() is not None:
            self.fate = f"died (exit {self.proc.returncode})"  # nobody killed it: a crash the soak must report
        else:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                if self.proc.wait(timeout_s):
                    self.fate = f"died (exit {self.proc.returncode}) while stopping"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.fate = "hung"
        self._reader.join(5)
        self.stderr.close()
        if self.fate == "running":
            self.fate = "stopped"


# --- the server's side --------------------------------------------------------------------------------


def _process_figures(pid: int) -> dict:
    """The server process's anonymous memory (its heap: what leaks), whole RSS, open files, threads."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
    return {"rss_anon_mib": fields["RssAnon"] / 1024, "rss_mib": fields["VmRSS"] / 1024, "threads": fields["Threads"],
            "open_files": len(os.listdir(f"/proc/{pid}/fd"))}  # fmt: skip


def _wait_quiet(server: ServerProcess, timeout_s: float) -> tuple[dict, float]:
    """The status once no client, lease, quarantined byte, half-written or read-locked object and no
    queued L2 push is left (or the timeout passed: the checks then say what stayed)."""
    t0 = time.monotonic()
    while True:
        st = server.status()
        store = st["l2_controllers"].get("store", {})
        quiet = (st["clients"] == 0 and st["leases"] == 0 and st["quarantine"]["leases"] == 0 and st["l1"]["writing"] == 0
                 and st["l1"]["read_locked"] == 0 and not store.get("queued") and not store.get("in_flight"))  # fmt: skip
        if quiet or time.monotonic() - t0 > timeout_s:
            return st, time.monotonic() - t0
        time.sleep(0.25)


# --- the run ------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    figure: str
    target: str
    ok: bool


@dataclass
class Faults:
    done: Counter = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)

    def note(self, t0: float, kind: str, what: str) -> None:
        self.done[kind] += 1
        self.log.append(f"{time.monotonic() - t0:6.1f} s  {what}")
        print(f"# {self.log[-1]}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvdepot-soak-"))
    binary = None if args.no_valkey else find_valkey_binary()
    valkey = ValkeyServer(binary, work / "valkey") if binary else None
    tiers = ["--l2", f"fs:path={work / 'fs'},size_gb={args.disk_size_gb}"]
    if valkey is not None:
        (work / "valkey").mkdir()
        valkey.start()
        tiers += ["--l2", f"valkey:url={valkey.url}"]
    server = ServerProcess(
        args=["--l1-size-gb", str(args.l1_size_gb), "--client-timeout-s", str(args.client_timeout_s), *tiers, "--log-level", "warning"],
        http_port=free_port(), ipc_path=str(work / "kvdepot.sock"), env={"OMP_NUM_THREADS": "1"}, log_path=str(work / "server.log"),
    )  # fmt: skip
    clients: list[SoakClient] = []
    try:
        server.start()
        wait_prefault(server)
        result = _soak(args, server, valkey, clients, work)
    finally:
        for c in clients:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGCONT)
                c.proc.kill()
        server.stop()
        if valkey is not None:
            valkey.stop()
    _print(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    ok = all(c["ok"] for c in result["checks"])
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nlogs kept in {work}", file=sys.stderr)
    return 0 if ok else 1


def _soak(args: argparse.Namespace, server: ServerProcess, valkey: ValkeyServer | None, clients: list[SoakClient], work: Path) -> dict:
    url = server.url if args.transport == "shm" else server.ipc_url
    rng = random.Random(args.seed)
    uids = itertools.cycle(range(1, 256))  # a uid used again gives the same chunk ids the same bytes: still checkable
    t0 = time.monotonic()
    total_s = args.minutes * 60
    warm_s = min(max(8.0, total_s * 0.2), total_s / 2)
    load_start = loadavg()
    clients.extend(SoakClient(url, next(uids), args.transport, work) for _ in range(args.clients))

    # Warm-up: the workload without faults until L1 is full, then the steady state the end is held to.
    time.sleep(max(0.0, t0 + warm_s - time.monotonic()))
    steady = _process_figures(server.proc.pid)
    steady_status = server.status()

    faults = Faults()
    stop_s = args.client_timeout_s + 1.0
    kinds = [k for k in FAULTS if k != "restart_valkey" or valkey is not None]
    fault_span = total_s - warm_s - stop_s  # the last fault has ended before the run does
    n_faults = max(len(kinds), int(fault_span // 8))
    due = [t0 + warm_s + fault_span * (i + 0.5) / n_faults for i in range(n_faults)]
    pending: list[tuple[float, Callable[[], None]]] = []  # (when, what to undo then)
    for i, when in enumerate(due):
        while time.monotonic() < when:
            _undo_due(pending)
            time.sleep(0.05)
        kind = kinds[i % len(kinds)]
        running = [c for c in clients if c.fate == "running" and c.proc.poll() is None and not c.paused]
        if kind == "kill_client" and running:
            victim = rng.choice(running)
            victim.kill()
            clients.append(SoakClient(url, next(uids), args.transport, work))
            faults.note(t0, kind, f"client {victim.uid} SIGKILLed; client {clients[-1].uid} started")
        elif kind == "stop_client" and running:
            victim = rng.choice(running)
            victim.proc.send_signal(signal.SIGSTOP)
            victim.paused = True

            def resume(v: SoakClient = victim) -> None:
                v.proc.send_signal(signal.SIGCONT)
                v.paused = False

            pending.append((time.monotonic() + stop_s, resume))
            faults.note(t0, kind, f"client {victim.uid} SIGSTOPped for {stop_s:g} s (past the client timeout)")
        elif kind == "restart_valkey" and valkey is not None:
            valkey.kill()
            pending.append((time.monotonic() + 3.0, valkey.start))
            faults.note(t0, kind, "valkey-server SIGKILLed; started again, empty, in 3 s")
    while time.monotonic() < t0 + total_s or pending:
        _undo_due(pending)
        time.sleep(0.05)
    run_s = time.monotonic() - t0

    for c in clients:
        if c.fate == "running":
            c.finish(timeout_s=60)
    quiet, quiet_s = _wait_quiet(server, timeout_s=2 * args.client_timeout_s + 30)
    end = _process_figures(server.proc.pid)
    server.clear("l1")
    cleared = server.status()
    alive = server.proc.poll() is None
    with open(server.log_path or "", errors="replace") as f:
        log = f.read()
    load_end = loadavg()
    return _judge(args, clients, faults, steady, steady_status, quiet, quiet_s, end, cleared, alive, log, run_s, warm_s,
                  valkey is not None, load_start, load_end)  # fmt: skip


def _undo_due(pending: list[tuple[float, Callable[[], None]]]) -> None:
    now = time.monotonic()
    for item in [p for p in pending if p[0] <= now]:
        pending.remove(item)
        item[1]()


def _judge(args, clients, faults, steady, steady_status, quiet, quiet_s, end, cleared, alive, log, run_s, warm_s, has_valkey,
           load_start, load_end) -> dict:  # fmt: skip
    totals: Counter[str] = Counter()
    mismatches: list[str] = []
    for c in clients:
        totals.update(c.last["counts"])
        mismatches += c.last["mismatches"]
    answered = sum(v for k, v in totals.items() if k.startswith("answered."))
    refused = {k.removeprefix("refused."): v for k, v in totals.items() if k.startswith("refused.")}
    unanswered = totals["unanswered"]
    l1, tiers = quiet["l1"], quiet["tiers"]
    fs = next((t for t in tiers if t["kind"] == "fs"), None)
    chunk_bytes = SOAK_LAYOUT.chunk_bytes(CHUNK_TOKENS)
    anon_margin = max(steady["rss_anon_mib"] * 0.2, 32.0)
    hung = [c.uid for c in clients if c.fate == "hung"]
    died = [f"{c.uid}: {c.fate}" for c in clients if c.fate.startswith("died")]
    internal = quiet["errors"].get("INTERNAL", 0)
    revoked = quiet.get("clients_gone", {}).get("revoked", 0)  # a stop past the client timeout that went unseen proves nothing
    checks = [
        Check("every request answered", f"{unanswered} unanswered of {answered + sum(refused.values()) + unanswered}", "0", unanswered == 0),
        Check("every byte read matched", f"{totals['mismatched_chunks']} wrong of {totals['verified_chunks'] + totals['mismatched_chunks']} "
              f"chunks ({totals['verified_bytes'] / 1e9:.2f} GB checked)", "0 wrong, > 0 checked",
              totals["mismatched_chunks"] == 0 and totals["verified_chunks"] > 0),  # fmt: skip
        Check("no client's own error or hang", f"{totals['client_crashes']} errors, {totals['client_errors_logged']} errors logged by the client library, "
              f"{len(hung)} hung, {len(died)} died" + (f" ({'; '.join(died)})" if died else ""),
              "0", not totals["client_crashes"] and not totals["client_errors_logged"] and not hung and not died),  # fmt: skip
        Check("no lease left", f"{quiet['leases']} leases, {quiet['quarantine']['leases']} quarantined ({quiet['quarantine']['bytes']} B), "
              f"{quiet['clients']} clients, after {quiet_s:.1f} s", "0", quiet["leases"] == 0 and quiet["quarantine"]["leases"] == 0
              and quiet["clients"] == 0),  # fmt: skip
        Check("no object half-written or locked", f"{l1['writing']} writing, {l1['read_locked']} read-locked", "0", l1["writing"] == 0 and l1["read_locked"] == 0),
        Check("arena back in one piece", f"after clearing L1: {cleared['l1']['used_bytes']} B used, largest free "
              f"{cleared['l1']['largest_free_bytes'] / MiB:.0f} of {cleared['l1']['capacity_bytes'] / MiB:.0f} MiB", "0 used, all free",
              cleared["l1"]["used_bytes"] == 0 and cleared["l1"]["largest_free_bytes"] == cleared["l1"]["capacity_bytes"]),  # fmt: skip
        Check("server heap back to steady", f"RssAnon {steady['rss_anon_mib']:.0f} -> {end['rss_anon_mib']:.0f} MiB (RSS {steady['rss_mib']:.0f} -> "
              f"{end['rss_mib']:.0f})", f"<= steady + {anon_margin:.0f} MiB", end["rss_anon_mib"] <= steady["rss_anon_mib"] + anon_margin),  # fmt: skip
        Check("open files and threads back to steady", f"files {steady['open_files']} -> {end['open_files']}, threads {steady['threads']} -> "
              f"{end['threads']}", "<= steady + 4", end["open_files"] <= steady["open_files"] + 4 and end["threads"] <= steady["threads"] + 4),  # fmt: skip
        Check("clients killed and replaced", f"{faults.done['kill_client']}", ">= 1", faults.done["kill_client"] >= 1),
        Check("clients stopped past the timeout, revoked", f"{faults.done['stop_client']} stopped, {revoked} revoked; requests refused "
              f"as revoked {quiet['request_failures']['lease_revoked']}", ">= 1, >= 1", faults.done["stop_client"] >= 1 and revoked >= 1),  # fmt: skip
        Check("L1 overflowed", f"{l1['evicted_objects']} objects evicted", "> 0", l1["evicted_objects"] > 0),
        Check("disk tier filled", f"{fs['stored']} chunks stored = {fs['stored'] * chunk_bytes / MiB:.0f} MiB into {fs['capacity_bytes'] / MiB:.0f} "
              f"MiB; {fs['used_bytes'] / MiB:.0f} MiB held" if fs else "no fs tier", "stored > capacity, held <= capacity",
              bool(fs) and fs["stored"] * chunk_bytes > fs["capacity_bytes"] >= fs["used_bytes"]),  # fmt: skip
        Check("every tier healthy at the end", ", ".join(f"{t['name']} {'healthy' if t['healthy'] else 'DOWN: ' + t['last_error']} ({t['failures']} failed calls)" for t in tiers),
              "all healthy", all(t["healthy"] for t in tiers)),  # fmt: skip
        Check("server up, no internal error, no traceback", f"{'up' if alive else 'EXITED'}, {internal} internal errors, "
              f"{log.count('Traceback')} tracebacks in its log", "up, 0, 0", alive and internal == 0 and "Traceback" not in log),  # fmt: skip
    ]
    if has_valkey:
        checks.insert(10, Check("tier backend restarted", f"valkey SIGKILLed and restarted {faults.done['restart_valkey']} times", ">= 1",
                                faults.done["restart_valkey"] >= 1))  # fmt: skip
    return {
        "run_s": run_s, "warm_s": warm_s, "clients": args.clients, "client_processes": len(clients), "transport": args.transport,
        "totals": dict(totals), "refused": refused, "mismatches": mismatches[:10], "faults": dict(faults.done), "fault_log": faults.log,
        "steady": steady, "end": end, "steady_l1_used": steady_status["l1"]["used_bytes"], "status_end": quiet,
        "checks": [vars(c) for c in checks], "load_start": load_start, "load_end": load_end, "valkey": has_valkey,
    }  # fmt: skip


def _print(r: dict, args: argparse.Namespace) -> None:
    t = Counter(r["totals"])
    rounds = t["rounds"]
    hit = t["hit_chunks"] / t["asked_chunks"] if t["asked_chunks"] else 0.0
    print(f"Soak: {r['run_s']:.0f} s ({r['warm_s']:.0f} s warm-up without faults), {r['clients']} clients at a time "
          f"({r['client_processes']} processes in all), {r['transport']}; L1 {args.l1_size_gb:g} GiB, fs tier {args.disk_size_gb:g} GB"
          f"{', valkey tier' if r['valkey'] else ', no valkey tier'}; {os.cpu_count()} CPUs, load {r['load_start']} -> {r['load_end']}\n")  # fmt: skip
    print(f"Workload: {rounds} rounds ({rounds / r['run_s']:.1f}/s), {t['answered.lookup']} LOOKUPs (hit {hit:.0%} of chunks asked), "
          f"{t['answered.prepare_retrieve']} zero-copy reads, {t['answered.retrieve']} copy reads, {t['answered.store']} stores "
          f"({t['stored_chunks']} chunks), {t['answered.ping']} PINGs; {t['verified_bytes'] / 1e9:.2f} GB read and checked "
          f"({t['verified_bytes'] / 1e9 / r['run_s']:.2f} GB/s)")  # fmt: skip
    refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "none"
    print(f"Refused (per-request problems, each that request's miss): {refused}")
    print("Faults: " + ("; ".join(x.strip() for x in r["fault_log"]) or "none") + "\n")
    print("| check | figure | target | |")
    print("|---|---|---|---|")
    for c in r["checks"]:
        print(f"| {c['name']} | {c['figure']} | {c['target']} | {'ok' if c['ok'] else 'FAILED'} |")
    if r["mismatches"]:
        print("\nMismatches: " + "; ".join(r["mismatches"]))
