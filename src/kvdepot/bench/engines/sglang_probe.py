"""Where an SGLang request's time goes, measured inside SGLang's own processes (benchmarks only).

``benchmarks/sglang_ttft.py`` starts SGLang with ``probe_env(path)``: a ``sitecustomize`` on
``PYTHONPATH`` calls ``install()`` in every SGLang process (the scheduler is spawned, so patching the
launcher would not reach it). ``install`` adds a ``sys.meta_path`` finder that, right after SGLang (or
kvdepot's backend) imports the modules named in ``PROBES``, wraps these functions to time them. Nothing
of SGLang's files changes, and nothing is patched without the environment variable.

Each call of a wrapped function appends one JSON line to ``path``: ``{"what", "start", "seconds", "pid",
"tokens"?}`` where ``start`` is wall-clock time (comparable across processes) and ``what`` is one of

- ``backend.lookup`` / ``backend.read``: the L3 backend's own ``batch_exists`` and ``batch_get_v1`` /
  ``batch_get`` (kvdepot's or SGLang's ``file`` backend alike): the storage calls a hit waits for;
- ``l3.lookup`` / ``l3.read``: SGLang's HiCache controller around them (its page hashes, and for a
  backend without ``batch_get_v1`` its own copy of each page into the host pool);
- ``h2d``: HiCache's host-to-device load of a request's pages (``submit_host_to_device``; synchronous on a CPU);
- ``forward``: the model's forward pass (``ModelRunner.forward``), with the batch's new tokens.

``split(records, t0, t1)`` sums them over one request's wall-clock window.

A what-if, apart from the timing: with ``KVDEPOT_SGLANG_PROBE_EXTEND=new-queries`` as well, SGLang's CPU
attention (``torch_native``) computes an extend's attention for its new queries only, under the causal
mask offset by the cached prefix, instead of padding the queries to the whole sequence and attending
over all of it (what 0.5.23 does). The outputs are the same; the time is what a hit costs when the
engine's attention does not recompute the prefix. The benchmark labels every row it measures so.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import threading
import time
from pathlib import Path

ENV = "KVDEPOT_SGLANG_PROBE"
EXTEND_ENV = "KVDEPOT_SGLANG_PROBE_EXTEND"
TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"

# module -> [(class, method, what)]
PROBES: dict[str, list[tuple[str, str, str]]] = {
    "kvdepot.connectors.sglang.backend": [
        ("KVDepotHiCacheStorage", "batch_exists", "backend.lookup"),
        ("KVDepotHiCacheStorage", "batch_get_v1", "backend.read"),
        ("KVDepotHiCacheStorage", "batch_get", "backend.read"),
    ],
    "sglang.srt.mem_cache.hicache_storage": [
        ("HiCacheFile", "batch_exists", "backend.lookup"),
        ("HiCacheFile", "batch_get_v1", "backend.read"),
        ("HiCacheFile", "batch_get", "backend.read"),
    ],
    "sglang.srt.managers.cache_controller": [
        ("HiCacheController", "_storage_hit_query", "l3.lookup"),
        ("HiCacheController", "_page_get_zero_copy", "l3.read"),
        ("HiCacheController", "_generic_page_get", "l3.read"),
    ],
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller": [("HybridCacheController", "_storage_hit_query", "l3.lookup")],
    "sglang.srt.mem_cache.l2_transfer": [("L2TransferEngine", "submit_host_to_device", "h2d")],
    "sglang.srt.model_executor.model_runner": [("ModelRunner", "forward", "forward")],
    TORCH_NATIVE: [],  # only for the what-if (``_new_queries_only``)
}

_lock = threading.Lock()


def probe_env(path: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for an SGLang process whose calls are timed into ``path``."""
    site = path.parent / "probe-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("from kvdepot.bench.engines import sglang_probe\n\nsglang_probe.install()\n")
    return {**env, ENV: str(path), "PYTHONPATH": os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)}


def install() -> None:
    """Add the finder (once) when ``KVDEPOT_SGLANG_PROBE`` names the output file."""
    if os.environ.get(ENV) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _record(what: str, start: float, seconds: float, tokens: int | None) -> None:
    line = {"what": what, "start": start, "seconds": seconds, "pid": os.getpid()}
    if tokens is not None:
        line["tokens"] = tokens
    with _lock, open(os.environ[ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


def _tokens(what: str, args: tuple) -> int | None:
    if what == "forward" and args:
        n = getattr(args[0], "extend_num_tokens", None)  # the forward batch: its new tokens on an extend
        return int(n) if isinstance(n, int) else None
    if what.startswith("backend.") and args and isinstance(args[0], list):
        return len(args[0])  # pages (keys)
    if what == "l3.read" and len(args) > 1 and isinstance(args[1], list):
        return len(args[1])  # (operation, hash_values, ...): pages
    return None


def _wrap(cls: type, method: str, what: str) -> None:
    inner = getattr(cls, method, None)  # inherited too (SGLang's file backend inherits batch_exists)
    if inner is None or getattr(inner, "_kvdepot_probe", False):
        return

    @functools.wraps(inner)
    def timed(self, *args, **kwargs):
        start, t0 = time.time(), time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _record(what, start, time.perf_counter() - t0, _tokens(what, args))

    timed._kvdepot_probe = True
    setattr(cls, method, timed)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in PROBES:
            return None
        for finder in sys.meta_path:  # the real spec, from the finders after this one
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, name)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str) -> None:
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        for cls_name, method, what in PROBES[self._name]:
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type):
                _wrap(cls, method, what)
        if self._name == TORCH_NATIVE and os.environ.get(EXTEND_ENV) == "new-queries":
            _new_queries_only(module.TorchNativeAttnBackend)


def _new_queries_only(cls: type) -> None:
    """Replace ``cls._run_sdpa_forward_extend`` for self-attention without a sliding window (the models
    the benchmark builds); anything else goes to SGLang's own."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    original = cls._run_sdpa_forward_extend

    def extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
               extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
               sliding_window_size=None):  # fmt: skip
        if encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                            extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)  # fmt: skip
        query = query.movedim(0, query.dim() - 2)  # [heads, tokens, head_dim]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_new, prefix, seq_len = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = query[:, start_q : start_q + n_new, :]
            tokens = req_to_token[req_pool_indices[i], :seq_len]
            k = k_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            v = v_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            mask = None
            if causal and prefix:  # new query t sits at position prefix + t and sees keys 0 .. prefix + t
                mask = torch.arange(seq_len, device=q.device)[None, :] <= (prefix + torch.arange(n_new, device=q.device))[:, None]
            # no prefix: SGLang's own call (SDPA's causal kernel), so a cold prefill costs what it costs unpatched
            out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa,
                                               scale=scaling, is_causal=causal and not prefix)  # fmt: skip
            output[start_q : start_q + n_new] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start_q += n_new
        return output

    cls._run_sdpa_forward_extend = extend


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(records: list[dict], t0: float, t1: float) -> dict[str, float]:
    """Seconds per ``what`` for calls that started inside the wall-clock window ``[t0, t1]``, with
    ``forward.extend`` (the forwards with new tokens) counted apart from decode steps."""
    out: dict[str, float] = {}
    for r in records:
        if t0 <= r["start"] <= t1:
            what = r["what"]
            if what == "forward":
                what = "forward.extend" if (r.get("tokens") or 0) > 1 else "forward.decode"
            out[what] = out.get(what, 0.0) + r["seconds"]
    return out
