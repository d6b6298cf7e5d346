"""SGLang time-to-first-token, cold vs L3 hit, with kvdepot, SGLang's own ``file`` backend, or no L3.

One run, one random-weight Llama (bfloat16) and one set of 4k-token prompts, three configurations, each
with a fresh SGLang server (CPU, HiCache on, ``layer_first`` host pool, page 64, ``wait_complete``):

  none     HiCache's device and host tiers only: after a flush, the prompt is computed again
  kvdepot  a ``kvdepot server`` on this host (L1 only), the backend with ``interface_v1`` (one copy)
  file     SGLang's built-in ``file`` backend, in a directory on this machine's disk

Per prompt: a cold request, a wait until its pages reached L3, ``POST /flush_cache`` (SGLang's device
and host tiers are emptied, L3 is not), the same request again (the "hit"). TTFT is the latency of a
request for one new token (prefill + one decode step; what a client waits for its first token).
The floor of a hit's load is the time to copy its KV bytes once (memcpy of the same size, measured in
the same run); it is printed with the table.

    .venv/bin/python benchmarks/sglang_ttft.py [--quick] [--configs none,kvdepot,file] [--json out.json]

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
from pathlib import Path

import numpy as np

from kvdepot.bench.engines.sglang_engines import PAGE, SGLangServer, backend_config, storage_tokens
from kvdepot.bench.engines.vllm_engines import FIRST_WORD, VOCAB, ModelShape, make_tiny_model
from kvdepot.bench.serverproc import ServerProcess, free_port

FULL = ModelShape(layers=8, hidden=512, heads=8, kv_heads=4)  # bf16 KV: 8 KiB a token, 32 MiB a 4k prompt
QUICK = ModelShape(layers=4, hidden=256, heads=4, kv_heads=2)
SHAPE_OF: dict[str, ModelShape] = {}  # model path -> its shape


def kv_bytes_per_token(shape: ModelShape) -> int:
    return 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * 2


def memcpy_s(nbytes: int, repeats: int = 7) -> float:
    """One single-threaded copy of ``nbytes`` between touched buffers (the floor of any read of them)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wait_for(pred, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def run_config(name: str, model_path: str, prompts: list[list[int]], work: Path) -> list[dict]:
    kvdepot = None
    extra: dict = {}
    storage: str | None = None
    if name == "kvdepot":
        kvdepot = ServerProcess(args=["--l1-size-gb", "2"], port=free_port(), http_port=free_port(), log_path=str(work / "kvdepot.log")).start()
        extra, storage = backend_config(kvdepot.url), "kvdepot"
    elif name == "file":
        storage = "file"
    sg = SGLangServer(model_path, work, name=f"sglang-{name}", storage=storage, extra=extra, max_total_tokens=16384)
    records = []
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
                d = work / f"sglang-{name}-file-l3"
                wait_for(lambda: d.exists() and sum(1 for f in d.iterdir() if f.suffix == ".bin") >= (i + 1) * pages)
            else:
                time.sleep(2.0)
            sg.flush_cache()
            hit = sg.generate(p, max_new_tokens=1)
            records.append({
                "config": name, "prompt": i, "tokens": len(p), "cold_s": cold["seconds"], "hit_s": hit["seconds"],
                "from_l3": storage_tokens(hit), "same_first_token": cold["output_ids"] == hit["output_ids"],
            })  # fmt: skip
            print(f"  {name} prompt {i}: cold {cold['seconds'] * 1e3:.0f} ms, after flush {hit['seconds'] * 1e3:.0f} ms, "
                  f"{storage_tokens(hit)} tokens from L3", flush=True)  # fmt: skip
        if kvdepot is not None:
            load = kvdepot_load_s(kvdepot.url, model_path, prompts)
            for r in records:
                r["kvdepot_load_s"] = load
    finally:
        sg.stop()
        if kvdepot is not None:
            kvdepot.stop()
    return records


def kvdepot_load_s(url: str, model_path: str, prompts: list[list[int]]) -> float:
    """What a hit's L3 read costs by itself: the same pages SGLang read (its model identity, its page
    size), fetched from the same server over the same shm path into one host buffer; the median over
    the prompts."""
    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.hashing import chunk_hashes

    shape = SHAPE_OF[model_path]
    layout = KVLayout(shape.layers, shape.kv_heads, shape.hidden // shape.heads, dtype="bfloat16")
    times = []
    with KVClient(url, model_path, layout, options=ClientOptions(chunk_size=PAGE)) as c:
        c.wait_prefault()  # as in a long-running engine: this process's mapping of the arena is populated
        pages = (len(prompts[0]) - 1) // PAGE
        out = np.ones(layout.chunk_shape(pages * PAGE), dtype=layout.storage_dtype)  # touched, like SGLang's host pool
        for p in prompts:
            hashes = chunk_hashes(p[: pages * PAGE], PAGE)
            t0 = time.perf_counter()
            with c.prepare_retrieve(hashes) as views:
                for i, v in enumerate(views):
                    np.copyto(out[:, :, i * PAGE : (i + 1) * PAGE], v)
            times.append(time.perf_counter() - t0)
            assert len(views) == len(hashes), f"only {len(views)} of {len(hashes)} pages stored"
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model and 2k-token prompts")
    ap.add_argument("--configs", default="none,kvdepot,file")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=0, help="prompt length (default 4096; 2048 with --quick)")
    ap.add_argument("--json", help="write every record here")
    ap.add_argument("--workdir", help="keep logs here (default: a fresh temporary dir)")
    a = ap.parse_args()
    shape = QUICK if a.quick else FULL
    n_tokens = a.tokens or (2048 if a.quick else 4096)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvd-sglang-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(work / "model", shape)
    SHAPE_OF[model.path] = shape
    rng = random.Random(7)
    prompts = [[rng.randrange(FIRST_WORD, VOCAB) for _ in range(n_tokens)] for _ in range(a.prompts)]
    kv_bytes = kv_bytes_per_token(shape) * ((n_tokens - 1) // PAGE * PAGE)
    load_avg = os.getloadavg()[0]
    floor = memcpy_s(kv_bytes)
    records: list[dict] = []
    for name in a.configs.split(","):
        print(f"{name}:", flush=True)
        records += run_config(name, model.path, prompts, work)
    print(f"\nSGLang TTFT, {shape.layers} layers x hidden {shape.hidden} (bf16), {n_tokens}-token prompts, "
          f"{a.prompts} prompts, median; load average {load_avg:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"KV of a hit: {kv_bytes / 2**20:.1f} MiB; one memcpy of it here: {floor * 1e3:.1f} ms\n")
    print("| L3 | cold TTFT | TTFT after flush | after flush / cold | tokens from L3 | same first token |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name in a.configs.split(","):
        rs = [r for r in records if r["config"] == name]
        cold = statistics.median(r["cold_s"] for r in rs)
        hit = statistics.median(r["hit_s"] for r in rs)
        summary[name] = {"cold_s": cold, "hit_s": hit, "ratio": hit / cold}
        print(f"| {name} | {cold * 1e3:.0f} ms | {hit * 1e3:.0f} ms | {hit / cold:.2f} | "
              f"{statistics.median(r['from_l3'] for r in rs):.0f} | {all(r['same_first_token'] for r in rs)} |")  # fmt: skip
    if "kvdepot" in summary:
        load = statistics.median(r["kvdepot_load_s"] for r in records if r["config"] == "kvdepot")
        summary["kvdepot"]["load_s"] = load
        print(f"\nkvdepot's part of a hit, the L3 read alone (same pages, same server, shm): {load * 1e3:.1f} ms = "
              f"{load / floor:.2f} x one memcpy of the same bytes ({floor * 1e3:.1f} ms); the rest of the hit's TTFT is "
              f"SGLang (its prefetch hand-off, the host->device load, the last page's prefill)")  # fmt: skip
    if "kvdepot" in summary and "file" in summary:
        print(f"kvdepot hit / file hit: {summary['kvdepot']['hit_s'] / summary['file']['hit_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"records": records, "summary": summary, "memcpy_s": floor, "kv_bytes": kv_bytes}, indent=1))


if __name__ == "__main__":
    main()
