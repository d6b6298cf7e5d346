"""``kvdepot demo`` as a newcomer runs it: a real vLLM engine (CPU) cold, then a fresh one loading the
prompts' KV from kvdepot. It must end with both TTFTs side by side, tokens from kvdepot and the same
greedy output, one progress line per stage, and nothing on the screen from third parties (their output
belongs in the work directory's logs)."""

from __future__ import annotations

import re
import subprocess
import sys

from kvdepot.bench.engines.vllm_engines import require_vllm


def test_the_demo_shows_a_real_engine_hitting_kvdepot(tmp_path):
    require_vllm()
    work = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "demo", "--prompts", "2", "--prompt-tokens", "1000", "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stderr == "", f"third-party output reached the screen:\n{r.stderr[-3000:]}"
    out = r.stdout
    stages = [line for line in out.splitlines() if re.match(r"\[\d/5\] ", line)]
    assert [s[:5] for s in stages] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"], out
    assert all(re.search(r"\.\.\. [0-9.]+ s$", s) for s in stages), stages  # each finished, with its time
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+1000\s", line)]
    assert len(rows) == 2, out
    for row in rows:  # prompt, tokens, cold, "ms", hit, "ms", faster, from kvdepot, same tokens
        assert row[-1] == "yes" and int(row[-2].replace(",", "")) == 896, row  # 7 of 7 complete chunks
    assert "demo passed" in out
    for log in ("server.log", "engine-1.log", "engine-2.log", "make-model.log"):
        assert (work / log).stat().st_size > 0, f"{log} is empty"
    assert (work / "model" / "config.json").exists()
