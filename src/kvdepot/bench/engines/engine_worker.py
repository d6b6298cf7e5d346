"""One vLLM engine in its own process, driven by JSON commands (``kvdepot.bench.engines.vllm_engines.Engine``),
started as ``python -m kvdepot.bench.engines.engine_worker``.

(Its harness module is not called ``vllm.py``: were this file run by path, its directory would come
first on its ``sys.path``, and that name would shadow vLLM.)

Commands arrive one per line on stdin; each gets exactly one JSON reply line on the file descriptor
given by --result-fd (stdout and stderr stay free for vLLM's logs, which go to a file):

    {"op": "generate", "prompts": [{"ids": [...], "salt": "...", "lora": ["name", id, "path"]}], "max_tokens": 16}
        (a prompt {"embeds": {"seed": s, "rows": n}} instead of "ids": n random embedding rows, for an
        engine started with enable_prompt_embeds; "audio": {"seed": s, "seconds": n} beside "ids": n
        seconds of random 16 kHz audio, for an audio model)
        -> {"outputs": [{"token_ids": [...], "num_cached_tokens": n, "ttft_s": t, "num_preemptions": p}],
            "seconds": s}
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "exit"}               -> {"ok": true}, then the engine shuts down

A failed command replies {"error": "..."}. The first line, once the engine is up, is {"ready": true}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", required=True, help="JSON, as for vLLM's OpenAI server; null: no connector")
    parser.add_argument("--result-fd", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--compiled", action="store_true", help="torch.compile instead of eager mode")
    parser.add_argument("--single-process", action="store_true", help="engine core and worker in this process")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON: more keyword arguments for vllm.LLM")
    parser.add_argument("--dtype", default="float32", help="the model's (and so the KV cache's) dtype")
    args = parser.parse_args()
    results = os.fdopen(args.result_fd, "w", buffering=1)

    def reply(obj) -> None:
        results.write(json.dumps(obj) + "\n")
        results.flush()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import EmbedsPrompt, TokensPrompt
    from vllm.lora.request import LoRARequest

    kv = json.loads(args.kv_transfer_config)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=not args.compiled,
        seed=0,
        disable_log_stats=False,
        distributed_executor_backend="uni" if args.single_process else None,
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        **json.loads(args.llm_kwargs),
    )
    def prompt(p: dict) -> TokensPrompt | EmbedsPrompt:
        salt = {"cache_salt": p["salt"]} if p.get("salt") else {}
        if p.get("embeds"):
            import torch

            spec = p["embeds"]
            hidden = llm.llm_engine.model_config.get_hidden_size()
            rows = torch.randn(spec["rows"], hidden, generator=torch.Generator().manual_seed(spec["seed"])) * 0.08
            return EmbedsPrompt(prompt_embeds=rows.to(llm.llm_engine.model_config.dtype), **salt)
        if p.get("audio"):
            import numpy as np

            spec = p["audio"]
            wave = np.random.default_rng(spec["seed"]).standard_normal(16000 * spec["seconds"]).astype(np.float32) * 0.1
            return TokensPrompt(prompt_token_ids=p["ids"], multi_modal_data={"audio": (wave, 16000)}, **salt)
        return TokensPrompt(prompt_token_ids=p["ids"], **salt)

    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "generate":
                prompts = [prompt(p) for p in cmd["prompts"]]
                loras = [LoRARequest(*p["lora"]) if p.get("lora") else None for p in cmd["prompts"]]
                params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None)
                seconds = time.perf_counter() - t0
                reply(
                    {
                        "seconds": seconds,
                        "outputs": [
                            {
                                "token_ids": list(o.outputs[0].token_ids),
                                "num_cached_tokens": o.num_cached_tokens or 0,
                                "ttft_s": getattr(o.metrics, "first_token_latency", None),
                                "num_preemptions": getattr(o.metrics, "num_preemptions", None),
                            }
                            for o in outs
                        ],
                    }
                )
            elif op == "reset_prefix_cache":
                reply({"ok": bool(llm.reset_prefix_cache())})
            elif op == "exit":
                reply({"ok": True})
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # one reply per command, errors included
            reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    del llm


if __name__ == "__main__":  # vLLM spawns processes: everything runs under the main guard
    main()
