"""What the vLLM scheduler side tells a lookup besides the hashes: a router's hint of where the prompt's
KV was computed, and the engine's measured prefill rate (for the peer tier's pull-or-recompute).

- The hint comes with the request, in vLLM's per-request ``kv_transfer_params``: ``kv_cache_source``
  (``HOST[:PORT]``, what llm-d passes as the ``x-kv-cache-source-host-port`` header), or the
  ``remote_host``/``remote_port`` pair that prefill/decode routers set for the decode side.
- An agent session (a conversation whose prefix kvdepot keeps across tool-call gaps) is named in the same
  ``kv_transfer_params`` as ``kvdepot_agent_session``: the agent framework sets it per conversation, vLLM
  passes it through untouched, and the lookup carries it to the server (which renews the session).
- The prefill rate is measured on the scheduler: tokens scheduled in a step over the time until the
  next step is scheduled, for steps that are mostly prefill (``MIN_PREFILL_TOKENS`` or more), as a moving
  average. It is 0 (unknown) until such a step was seen.
"""

from __future__ import annotations

import time
from typing import Any

MIN_PREFILL_TOKENS = 256
WEIGHT = 0.3
MAX_STEP_S = 30.0  # a gap longer than this is an idle engine, not a step


def source_hint(kv_transfer_params: dict[str, Any] | None) -> str:
    params = kv_transfer_params or {}
    source = params.get("kv_cache_source") or params.get("kv_cache_source_host_port")
    if source:
        return str(source)
    host, port = params.get("remote_host"), params.get("remote_port")
    if host:
        return f"{host}:{port}" if port else str(host)
    return ""


MAX_AGENT_SESSION_NAME = 256  # the server refuses longer names (a bad request would fail the lookup)


def agent_session(kv_transfer_params: dict[str, Any] | None) -> str:
    """The request's agent session name, or "" (none, not a string, or too long to be one)."""
    name = (kv_transfer_params or {}).get("kvdepot_agent_session")
    return name if isinstance(name, str) and len(name) <= MAX_AGENT_SESSION_NAME else ""


class PrefillRate:
    """Tokens per second the engine computes, from the scheduler's steps."""

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        self._last_step: tuple[float, int] | None = None  # (when scheduled, tokens scheduled)

    def step(self, scheduled_tokens: int, now: float | None = None) -> None:
        """Call once per scheduled step with its token count."""
        now = time.monotonic() if now is None else now
        last = self._last_step
        if last is not None:
            since, tokens = last
            seconds = now - since
            if tokens >= MIN_PREFILL_TOKENS and 0 < seconds < MAX_STEP_S:
                sample = tokens / seconds
                self.tokens_per_s = sample if self.tokens_per_s == 0 else (1 - WEIGHT) * self.tokens_per_s + WEIGHT * sample
        self._last_step = (now, scheduled_tokens)
