"""What the SGLang backend needs to know of the SGLang running it: the prefetch policy and its budget, the
host<->device IO backend and the device, read from SGLang's own published configuration when the backend
is built inside SGLang, else SGLang 0.5.23's defaults (the version kvdepot is tested with).

SGLang's prefetch from L3, as 0.5.23 runs it (``unified_radix_cache``: ``_can_terminate_prefetch``):

- ``timeout`` (SGLang's default): the request waits for its prefetch at most
  ``prefetch_timeout_base + pages x page_size / 1024 x prefetch_timeout_per_ki_token`` seconds (1 s +
  0.25 s per 1,024 tokens by default; both keys of ``--hicache-storage-backend-extra-config``, which
  SGLang takes out before the backend sees the rest), counted from its first wait for admission; then
  it is admitted with what has arrived and computes the rest;
- ``wait_complete``: the request waits for the whole prefetch, however long;
- ``best_effort``: the request never waits; on this build the prefetch is ended at the first scheduling
  check, before any lookup has run, so nothing is ever loaded from L3.

A kvdepot call must end inside that budget: one that outlives it is wasted (SGLang recomputes anyway)
and, worse, holds SGLang's prefetch thread, so the next request's lookup waits behind it. So each call
gets ``budget_share`` of the budget for the pages it is asked about (and never more than ``timeout_s``).

This module does not import SGLang at import time (its tests run without it).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

# SGLang 0.5.23's defaults (server_args / arg_groups.fields.memory and HybridCacheController).
DEFAULT_PREFETCH_POLICY = "timeout"
DEFAULT_IO_BACKEND = "kernel"
DEFAULT_TIMEOUT_BASE_S = 1.0
DEFAULT_TIMEOUT_PER_KI_TOKEN_S = 0.25
TESTED_VERSION = "0.5.23"

POLICIES = ("timeout", "wait_complete", "best_effort")


@dataclass(frozen=True)
class SGLangRuntime:
    """SGLang's settings that decide whether, and how fast, a page comes back from L3."""

    prefetch_policy: str = DEFAULT_PREFETCH_POLICY
    io_backend: str = DEFAULT_IO_BACKEND
    device: str = ""  # "" when unknown
    kv_cache_dtype: str = ""  # --kv-cache-dtype ("auto", "fp8_e4m3", ...); "" when unknown
    timeout_base_s: float = DEFAULT_TIMEOUT_BASE_S
    timeout_per_ki_token_s: float = DEFAULT_TIMEOUT_PER_KI_TOKEN_S
    source: str = f"SGLang {TESTED_VERSION}'s defaults"  # where the values came from, for the log
    notes: tuple[str, ...] = field(default=())  # what could not be read, and why

    def prefetch_budget_s(self, tokens: int, page_size: int) -> float | None:
        """How long SGLang lets a prefetch of ``tokens`` run before it recomputes instead; None when it
        waits for the prefetch however long it takes (``wait_complete``)."""
        if self.prefetch_policy != "timeout":
            return None if self.prefetch_policy == "wait_complete" else 0.0
        pages = tokens // page_size if page_size > 0 else 0
        return self.timeout_base_s + pages * page_size / 1024 * self.timeout_per_ki_token_s

    def call_deadline_s(self, tokens: int, page_size: int, share: float, timeout_s: float) -> float:
        """How long one kvdepot call about ``tokens`` may take: ``share`` of SGLang's budget for them,
        at most ``timeout_s`` (all of it where SGLang waits however long)."""
        budget = self.prefetch_budget_s(tokens, page_size)
        if budget is None or budget <= 0:  # wait_complete; best_effort never waits, so any time is lost
            return timeout_s
        return min(timeout_s, share * budget)

    def with_budget(self, base_s: float | None, per_ki_token_s: float | None) -> SGLangRuntime:
        """The budget keys as the backend received them (an SGLang that does not take them out of the
        extra-config first hands them over; they are then what SGLang uses)."""
        if base_s is None and per_ki_token_s is None:
            return self
        return replace(
            self,
            timeout_base_s=self.timeout_base_s if base_s is None else base_s,
            timeout_per_ki_token_s=self.timeout_per_ki_token_s if per_ki_token_s is None else per_ki_token_s,
        )

    def problems(self) -> list[str]:
        """Settings that keep L3 hits from working on this build, each naming the flag to change."""
        found = []
        if self.prefetch_policy == "best_effort":
            found.append(
                "--hicache-storage-prefetch-policy best_effort loads nothing from L3 on this SGLang build (the prefetch "
                "is ended at the first scheduling check, before its lookup runs): use timeout (SGLang's default) or wait_complete"
            )
        if self.io_backend == "kernel" and self.device == "cpu":
            found.append(
                "--hicache-io-backend kernel needs SGLang's CUDA kernels and stops SGLang at the first backup on a CPU: "
                "use --hicache-io-backend direct (with --hicache-mem-layout layer_first or page_first_direct)"
            )
        return found

    @classmethod
    def read(cls) -> SGLangRuntime:
        """The running SGLang's settings (its published configuration, this process), else defaults."""
        try:
            from sglang.srt import runtime_context as rc
        except Exception as exc:  # noqa: BLE001 - not inside SGLang, or another version
            return cls(notes=(f"SGLang's runtime context is not importable ({type(exc).__name__}: {exc})",))
        values: dict[str, Any] = {}
        notes: list[str] = []
        try:
            memory = rc.get_memory()
            values["prefetch_policy"] = str(memory.hicache_storage_prefetch_policy)
            values["io_backend"] = str(memory.hicache_io_backend)
            extra = memory.hicache_storage_backend_extra_config
        except Exception as exc:  # noqa: BLE001 - not published (no server), or renamed
            return cls(notes=(f"SGLang's memory settings are not readable here ({type(exc).__name__}: {exc})",))
        try:
            values["device"] = str(rc.get_device().device or "")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"SGLang's device is not readable ({type(exc).__name__}: {exc})")
        try:
            values["kv_cache_dtype"] = str(rc.get_model().kv_cache_dtype or "")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"SGLang's --kv-cache-dtype is not readable ({type(exc).__name__}: {exc})")
        base, per_ki, why = _budget_keys(extra)
        if why:
            notes.append(why)
        return cls(
            timeout_base_s=base, timeout_per_ki_token_s=per_ki, source="SGLang's configuration", notes=tuple(notes), **values
        )

    def describe(self) -> str:
        if self.prefetch_policy == "timeout":
            budget = f"{self.timeout_base_s:g} s + {self.timeout_per_ki_token_s:g} s per 1,024 tokens"
        else:
            budget = "none" if self.prefetch_policy == "wait_complete" else "0 (never waits)"
        return f"prefetch policy {self.prefetch_policy} (budget {budget}), io backend {self.io_backend}, from {self.source}"


def _budget_keys(extra: Any) -> tuple[float, float, str]:
    """``prefetch_timeout_base`` and ``prefetch_timeout_per_ki_token`` from SGLang's extra-config (a JSON
    text or ``@file``), as SGLang reads them; defaults where absent or unreadable."""
    base, per_ki = DEFAULT_TIMEOUT_BASE_S, DEFAULT_TIMEOUT_PER_KI_TOKEN_S
    if not extra:
        return base, per_ki, ""
    try:
        if isinstance(extra, dict):
            config = extra
        elif str(extra).startswith("@"):
            config = _config_file(str(extra)[1:])
        else:
            config = json.loads(extra)
        base = float(config.get("prefetch_timeout_base", base))
        per_ki = float(config.get("prefetch_timeout_per_ki_token", per_ki))
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
        return DEFAULT_TIMEOUT_BASE_S, DEFAULT_TIMEOUT_PER_KI_TOKEN_S, f"the extra-config's budget keys are unreadable ({exc})"
    return base, per_ki, ""


def _config_file(path: str) -> dict:
    """An ``@file`` extra-config, in the formats SGLang reads (JSON, TOML, YAML)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".toml":
        import tomllib

        with open(path, "rb") as f:
            return tomllib.load(f)
    with open(path) as f:
        if ext in (".yaml", ".yml"):
            import yaml  # SGLang's own dependency, there when SGLang reads this file

            return yaml.safe_load(f) or {}
        return json.load(f)
