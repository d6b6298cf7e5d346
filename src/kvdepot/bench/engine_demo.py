"""``kvdepot demo``: a real vLLM engine (CPU) skipping prefill through kvdepot, start to finish.

It makes a small random-weight Llama locally (no download), starts a kvdepot server, and serves long
prompts twice: cold in one vLLM engine process, whose prompts' KV goes to kvdepot, then from a fresh
engine process with nothing cached in it, which loads that KV from kvdepot instead of computing it. It
prints each prompt's time to first token side by side, the tokens that came from kvdepot, and whether
the greedy output is the same. Everything it starts logs into a work directory (printed); the screen
gets one progress line per stage.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvdepot.bench.engines.vllm_engines import TINY, Engine, TinyModel, connector_config, make_prompts
from kvdepot.bench.serverproc import ServerProcess, free_port

T = TypeVar("T")
STAGES = 5


class Stage:
    """One progress line: ``[i/N] what ... took``; a failure ends the line with FAILED and the log."""

    def __init__(self, index: int, what: str) -> None:
        self.index, self.what = index, what

    def run(self, work: Callable[[], T], failed: Callable[[T], bool] = lambda _: False) -> T:
        print(f"[{self.index}/{STAGES}] {self.what} ...", end=" ", flush=True)
        t0 = time.monotonic()
        try:
            result = work()
        except BaseException:
            print("FAILED", flush=True)
            raise
        print("FAILED" if failed(result) else f"{time.monotonic() - t0:.1f} s", flush=True)
        return result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=4, help="how many long prompts (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--workdir", default="", help="where the model and the logs go (default: a new temporary directory, kept)")


def run(args: argparse.Namespace) -> int:
    """0 when every prompt came back from kvdepot with the same tokens; 1 otherwise; the server's own
    exit code (2 for a bad setting), with its reason, when it could not start."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvdepot-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    print("kvdepot demo: a real vLLM engine (CPU) skipping prefill through kvdepot")
    print(f"work directory (model, server and engine logs): {work}\n")
    server = ServerProcess(args=["--l1-size-gb", str(args.l1_size_gb)], port=args.port, http_port=free_port(), log_path=str(work / "server.log"))
    failed = Stage(1, "server: kvdepot on embedded defaults").run(server.start_or_explain, lambda r: r is not None)
    if failed is not None:
        print(f"kvdepot demo: the server did not start: {failed[1]}", file=sys.stderr)
        return failed[0]
    try:
        model = Stage(2, f"model: a random-weight Llama ({TINY.layers} layers, hidden {TINY.hidden}), made here").run(
            lambda: _make_model(work / "model", work / "make-model.log")
        )
        return _serve_twice(args, work, model, server)
    finally:
        server.stop()


def _serve_twice(args: argparse.Namespace, work: Path, model: TinyModel, server: ServerProcess) -> int:
    prompts = make_prompts(seed=2026, lengths=[args.prompt_tokens] * args.prompts)
    kv = connector_config(server.url)
    first = Engine(model, kv, work, name="engine-1")
    Stage(3, "engine 1: vLLM (CPU) with the kvdepot connector, starting").run(first.start)
    try:
        cold = Stage(4, f"engine 1: {args.prompts} prompts of {args.prompt_tokens} tokens, cold (their KV goes to kvdepot)").run(
            lambda: _serve(first, prompts)
        )
    finally:
        first.close()
    second = Engine(model, kv, work, name="engine-2")
    try:
        hits = Stage(5, "engine 2: a fresh vLLM process, nothing cached in it: starting, then the same prompts").run(
            lambda: _serve(second.start(), prompts)
        )
    finally:
        second.close()
    return _report(prompts, cold, hits, server)


def _report(prompts: list[list[int]], cold: list[dict], hits: list[dict], server: ServerProcess) -> int:
    print(f"\n{'prompt':>6} {'tokens':>7} {'cold TTFT':>10} {'hit TTFT':>9} {'faster':>7} {'from kvdepot':>13} {'same tokens':>12}")
    ok = True
    for i, (p, c, h) in enumerate(zip(prompts, cold, hits), 1):
        same = c["token_ids"] == h["token_ids"]
        ok &= same and h["num_cached_tokens"] > 0
        c_ttft, h_ttft = _ttft(c), _ttft(h)
        print(
            f"{i:>6} {len(p):>7} {1000 * c_ttft:>8.0f} ms {1000 * h_ttft:>6.0f} ms {c_ttft / max(h_ttft, 1e-9):>6.1f}x "
            f"{h['num_cached_tokens']:>13,} {'yes' if same else 'NO':>12}"
        )
    lk = server.status()["lookups"]
    print(
        f"\nkvdepot saw {lk['requests']} lookups: hit rate {lk['hit_rate']:.1%} "
        f"({lk['hit_tokens']:,} of {lk['hit_tokens'] + lk['missed_tokens']:,} tokens; the cold engine's lookups missed)"
    )
    print("demo", "passed: the second engine skipped the prefill kvdepot held, and said the same" if ok else "FAILED")
    return 0 if ok else 1


def _serve(engine: Engine, prompts: list[list[int]]) -> list[dict]:
    """Each prompt alone (vLLM's own prefix cache reset first), 8 greedy tokens."""
    return [engine.one(p, max_tokens=8) for p in prompts]


def _ttft(out: dict) -> float:
    return out["ttft_s"] or out["seconds"]


def _make_model(path: Path, log: Path) -> TinyModel:
    """``kvdepot make-model`` in its own process, its output in ``log`` (torch and transformers print
    warnings on import that are not the demo's business)."""
    with open(log, "wb") as out:
        r = subprocess.run([sys.executable, "-m", "kvdepot.cli", "make-model", str(path)], stdout=out, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"making the model failed; see {log}")
    head_dim = TINY.hidden // TINY.heads
    return TinyModel(str(path), TINY.layers, TINY.kv_heads, head_dim)
