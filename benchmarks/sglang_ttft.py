"""SGLang time-to-first-token, cold vs L3 hit, with kvdepot, SGLang's own ``file`` backend, or no L3,
and where a hit's time goes.

One run, random-weight Llamas (bfloat16) and 4k-token prompts; per model, three configurations, each with
a fresh SGLang server (CPU, HiCache on, ``layer_first`` host pool, page 64, SGLang's default prefetch
policy ``timeout``):

  none     HiCache's device and host tiers only: after a flush, the prompt is computed again
  kvdepot  a ``kvdepot server`` on this host (L1 only), the backend with ``interface_v1`` (one copy)
  file     SGLang's built-in ``file`` backend, in a directory on this machine's disk

Models: ``base`` (8 layers x hidden 512: attention-light, a hit is mostly SGLang's own overhead) and
``wide`` (8 x 2048: prefill-heavy, where the cache saves most).

Per prompt: a cold request, a wait until its pages reached L3, ``POST /flush_cache`` (SGLang's device
and host tiers are emptied, L3 is not), the same request again (the "hit"). TTFT is the latency of a
request for one new token. Inside SGLang, ``kvdepot.bench.engines.sglang_probe`` times each call of the
L3 backend (its lookup and its read), the host-to-device load and the forward pass; the table splits
each hit into those and the rest (SGLang's scheduling, HTTP). Next to them, measured in the same run:
one memcpy of the hit's KV bytes, and the same read from a plain kvdepot client outside SGLang.

``--attention new-queries`` is a what-if, labelled so in the output: SGLang's CPU attention computes an
extend for its new queries only (``sglang_probe``), instead of padding them to the whole sequence as
SGLang 0.5.23 does. It shows what a hit costs when the engine does not recompute the prefix.

    .venv/bin/python benchmarks/sglang_ttft.py [--quick] [--models base,wide] [--configs none,kvdepot,file]
        [--prompts N] [--tokens N] [--sglang-env KEY=VALUE ...] [--attention sglang|new-queries] [--json out.json]

Needs SGLang's venv (scripts/install-sglang.sh). Times are those of a shared CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdepot.bench.engines import sglang_probe
from kvdepot.bench.engines.sglang_engines import PAGE, SGLangServer, backend_config, storage_tokens
from kvdepot.bench.engines.vllm_engines import FIRST_WORD, VOCAB, ModelShape, make_tiny_model
from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.bench.stats import memcpy_seconds


@dataclass(frozen=True)
class Model:
    name: str
    shape: ModelShape
    what: str


MODELS = {
    "base": Model("base", ModelShape(layers=8, hidden=512, heads=8, kv_heads=4), "8 layers x hidden 512, 4 KV heads of 64"),
    "wide": Model("wide", ModelShape(layers=8, hidden=2048, heads=16, kv_heads=4), "8 layers x hidden 2048, 4 KV heads of 128"),
}
QUICK = Model("quick", ModelShape(layers=4, hidden=256, heads=4, kv_heads=2), "4 layers x hidden 256 (--quick)")
# A hit's parts, in the table's order: SGLang's lookup and read around the backend's own calls (the same
# for every backend: a backend without batch_get_v1, as ``file``, leaves the copy into the host pool to
# SGLang), the host-to-device load, the forward pass.
SPLIT = ("l3.lookup", "l3.read", "h2d", "forward.extend")


def kv_bytes_per_token(shape: ModelShape) -> int:
    return 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * 2


def wait_for(pred, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def run_config(name: str, model: Model, model_path: str, prompts: list[list[int]], work: Path, sglang_env: dict[str, str]) -> list[dict]:
    kvdepot = None
    extra: dict = {}
    storage: str | None = None
    if name == "kvdepot":
        log = str(work / f"kvdepot-{model.name}.log")
        kvdepot = ServerProcess(args=["--l1-size-gb", "2"], port=free_port(), http_port=free_port(), log_path=log).start()
        extra, storage = backend_config(kvdepot.url), "kvdepot"
    elif name == "file":
        storage = "file"
    probe = work / f"probe-{model.name}-{name}.jsonl"
    probe.unlink(missing_ok=True)
    sg = SGLangServer(model_path, work, name=f"sglang-{model.name}-{name}", storage=storage, extra=extra, max_total_tokens=16384,
                      probe=probe)  # fmt: skip
    records = []
    saved = {k: os.environ.get(k) for k in sglang_env}
    os.environ.update(sglang_env)  # SGLangServer passes this process's environment on
    try:
        sg.start(timeout_s=600)
        warm = [random.Random(99).randrange(FIRST_WORD, VOCAB) for _ in range(8 * PAGE)]
        sg.generate(warm, max_new_tokens=1)  # SGLang compiles its page hasher on first use
        sg.flush_cache()
        for i, p in enumerate(prompts):
            cold = sg.generate(p, max_new_tokens=1)
            pages = (len(p) - 1) // PAGE
            if name == "kvdepot":
                import httpx

                objects = lambda: httpx.get(f"http://127.0.0.1:{kvdepot.http_port}/status").json()["l1"]["objects"]  # noqa: E731
                wait_for(lambda: objects() >= (i + 1) * pages + 1)  # (+1: the warm-up prompt's pages)
            elif name == "file":
                d = work / f"sglang-{model.name}-{name}-file-l3"
                wait_for(lambda: d.exists() and sum(1 for f in d.iterdir() if f.suffix == ".bin") >= (i + 1) * pages)
            else:
                time.sleep(2.0)
            sg.flush_cache()
            t0 = time.time()
            hit = sg.generate(p, max_new_tokens=1)
            split = sglang_probe.split(sglang_probe.read(probe), t0, time.time())
            records.append({
                "model": model.name, "config": name, "prompt": i, "tokens": len(p), "cold_s": cold["seconds"], "hit_s": hit["seconds"],
                "from_l3": storage_tokens(hit), "same_first_token": cold["output_ids"] == hit["output_ids"], "split": split,
            })  # fmt: skip
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in split.items())
            print(f"  {model.name} {name} prompt {i}: cold {cold['seconds'] * 1e3:.0f} ms, after flush {hit['seconds'] * 1e3:.0f} ms, "
                  f"{storage_tokens(hit)} tokens from L3 ({parts} ms)", flush=True)  # fmt: skip
        if kvdepot is not None:
            load = kvdepot_load_s(kvdepot.url, model_path, model.shape, prompts)
            for r in records:
                r["standalone_read_s"] = load
    finally:
        sg.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if kvdepot is not None:
            kvdepot.stop()
    return records


def kvdepot_load_s(url: str, model_path: str, shape: ModelShape, prompts: list[list[int]], repeats: int = 5) -> float:
    """The read of a hit by itself: the same pages SGLang read (its model identity, its page size), from
    the same server over the same shm path, into a touched host buffer laid out as SGLang's
    ``layer_first`` pool, by this process alone; the median over the prompts, each read ``repeats`` times."""
    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.hashing import chunk_hashes
    from kvdepot.runs import copy_all

    layout = KVLayout(shape.layers, shape.kv_heads, shape.hidden // shape.heads, dtype="bfloat16")
    times = []
    with KVClient(url, model_path, layout, options=ClientOptions(chunk_size=PAGE)) as c:
        c.wait_prefault()  # as in a long-running engine: this process's mapping of the arena is populated
        pages = (len(prompts[0]) - 1) // PAGE
        out = np.ones(layout.chunk_shape(pages * PAGE), dtype=layout.storage_dtype)  # touched, like SGLang's host pool
        for p in prompts:
            hashes = chunk_hashes(p[: pages * PAGE], PAGE)
            for _ in range(repeats):
                t0 = time.perf_counter()
                with c.prepare_retrieve(hashes) as views:
                    copy_all((out[:, :, i * PAGE : (i + 1) * PAGE], v) for i, v in enumerate(views))
                times.append(time.perf_counter() - t0)
                assert len(views) == len(hashes), f"only {len(views)} of {len(hashes)} pages stored"
    return statistics.median(times)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def report(model: Model, records: list[dict], configs: list[str], n_tokens: int, floor: float, kv_bytes: int, whatif: bool) -> dict:
    print(f"\n{model.name}: {model.what} (bf16), {n_tokens}-token prompts, {len({r['prompt'] for r in records})} prompts, medians")
    if whatif:
        print("WHAT-IF: SGLang's torch_native extend patched to attend with the new queries only (not SGLang 0.5.23 as shipped)")
    print(f"KV of a hit: {kv_bytes / 2**20:.1f} MiB; one memcpy of it here: {ms(floor)}\n")
    print("| L3 | cold TTFT | TTFT after flush | after flush / cold | tokens from L3 | same first token "
          "| L3 lookup | L3 read | host->device | forward | rest |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary: dict = {}
    for name in configs:
        rs = [r for r in records if r["config"] == name]
        if not rs:
            continue
        cold = statistics.median(r["cold_s"] for r in rs)
        hit = statistics.median(r["hit_s"] for r in rs)
        parts = {k: statistics.median(r["split"].get(k, 0.0) for r in rs) for k in SPLIT}
        rest = statistics.median(r["hit_s"] - sum(r["split"].get(k, 0.0) for k in SPLIT) for r in rs)
        summary[name] = {"cold_s": cold, "hit_s": hit, "ratio": hit / cold, **{f"{k}_s": v for k, v in parts.items()}, "rest_s": rest}
        cells = " | ".join(ms(parts[k]) if parts[k] else "-" for k in SPLIT)
        print(f"| {name} | {ms(cold)} | {ms(hit)} | {hit / cold:.2f} | {statistics.median(r['from_l3'] for r in rs):.0f} | "
              f"{all(r['same_first_token'] for r in rs)} | {cells} | {ms(rest)} |")  # fmt: skip
    if "kvdepot" in summary:
        rs = [r for r in records if r["config"] == "kvdepot"]
        own = {k: statistics.median(r["split"].get(k, 0.0) for r in rs) for k in ("backend.lookup", "backend.read")}
        read, alone = own["backend.read"], statistics.median(r["standalone_read_s"] for r in rs)
        summary["kvdepot"] |= {"kvdepot_lookup_s": own["backend.lookup"], "kvdepot_read_s": read, "standalone_read_s": alone}
        print(f"\nkvdepot's own calls in a hit: lookup {ms(own['backend.lookup'])}, read {ms(read)} = {read / floor:.2f} x memcpy of the "
              f"same bytes ({ms(floor)}); the same read by a plain client outside SGLang: {ms(alone)} = {alone / floor:.2f} x memcpy "
              f"(inside / outside {read / alone:.2f})")  # fmt: skip
        hit = summary["kvdepot"]["hit_s"]
        print(f"kvdepot's calls are {(own['backend.lookup'] + read) / hit * 100:.1f} % of the hit; SGLang's forward of the last "
              f"page {summary['kvdepot']['forward.extend_s'] / hit * 100:.0f} %")  # fmt: skip
    if "kvdepot" in summary and "file" in summary:
        print(f"kvdepot hit / file hit: {summary['kvdepot']['hit_s'] / summary['file']['hit_s']:.2f}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small model and 2k-token prompts")
    ap.add_argument("--models", default="base,wide", help=f"of {sorted(MODELS)}")
    ap.add_argument("--configs", default="none,kvdepot,file")
    ap.add_argument("--prompts", type=int, default=4, help="per model (the wide model gets one fewer)")
    ap.add_argument("--tokens", type=int, default=0, help="prompt length (default 4096; 2048 with --quick)")
    ap.add_argument("--sglang-env", action="append", default=[], metavar="KEY=VALUE", help="more environment for SGLang")
    ap.add_argument("--attention", choices=["sglang", "new-queries"], default="sglang",
                    help="new-queries: a what-if, SGLang's CPU extend without recomputing the prefix's attention")  # fmt: skip
    ap.add_argument("--json", help="write every record here")
    ap.add_argument("--workdir", help="keep logs here (default: a fresh temporary dir)")
    a = ap.parse_args()
    models = [QUICK] if a.quick else [MODELS[m] for m in a.models.split(",")]
    configs = a.configs.split(",")
    sglang_env = dict(kv.split("=", 1) for kv in a.sglang_env)
    whatif = a.attention == "new-queries"
    if whatif:
        sglang_env[sglang_probe.EXTEND_ENV] = "new-queries"
    n_tokens = a.tokens or (2048 if a.quick else 4096)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvd-sglang-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    load_avg = os.getloadavg()[0]
    out: dict = {"records": [], "summary": {}, "sglang_env": sglang_env, "attention": a.attention}
    for model in models:
        path = make_tiny_model(work / f"model-{model.name}", model.shape).path
        rng = random.Random(7)
        count = max(1, a.prompts - 1) if model.name == "wide" else a.prompts
        prompts = [[rng.randrange(FIRST_WORD, VOCAB) for _ in range(n_tokens)] for _ in range(count)]
        kv_bytes = kv_bytes_per_token(model.shape) * ((n_tokens - 1) // PAGE * PAGE)
        floor = memcpy_seconds(kv_bytes)
        records: list[dict] = []
        for name in configs:
            print(f"{model.name} / {name}:", flush=True)
            records += run_config(name, model, path, prompts, work, sglang_env)
        out["records"] += records
        summary = report(model, records, configs, n_tokens, floor, kv_bytes, whatif)
        out["summary"][model.name] = summary | {"memcpy_s": floor, "kv_bytes": kv_bytes}
    env = f"; SGLang's environment adds {sglang_env}" if sglang_env else ""
    print(f"\nload average {load_avg:.2f} -> {os.getloadavg()[0]:.2f}{env}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
