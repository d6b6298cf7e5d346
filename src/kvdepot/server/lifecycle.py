"""The lifecycle controls an operator drives over HTTP (``admin/routes/lifecycle.py``): pin, agent
sessions, prefetch and delete of a prefix named by chunk hashes or token ids.

An object's key is its namespace (model, world size, rank, layout, chunk size, cache_salt) and its chunk
hash, and only an engine's REGISTER_CONTEXT tells the server a namespace. So a prefix named over HTTP is
resolved against the contexts registered now: those of ``model`` (which may be left out when every
registered context serves one model), one target per distinct namespace (a tensor-parallel engine's
ranks each get theirs). Token ids are hashed with each namespace's chunk size and the server's hash
algorithm; hex chunk hashes are taken as they are. With no such context registered, the request is
refused (409): the server cannot name the objects.
"""

from __future__ import annotations

import binascii
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum

from kvdepot.errors import BadRequest, ErrorCode, KVDepotError
from kvdepot.hashing import HASH_SCHEME, chunk_hashes
from kvdepot.keys import NamespaceSpec
from kvdepot.limits import MAX_KEYS
from kvdepot.server.state import ContextRegistry
from kvdepot.storage.manager import PinInfo, Prefetched, SessionInfo, StorageManager
from kvdepot.types import ClearScope, ObjectKey

MAX_PREFETCH_WAIT_S = 300.0


@dataclass(frozen=True)
class Target:
    spec: NamespaceSpec
    chunk_bytes: int
    keys: list[ObjectKey]


def _doc(info: PinInfo | SessionInfo) -> dict:
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(info).items()}


class Lifecycle:
    def __init__(self, storage: StorageManager, contexts: ContextRegistry) -> None:
        self._storage = storage
        self._contexts = contexts

    # --- naming a prefix -----------------------------------------------------------------------------

    def targets(self, model: str | None, cache_salt: str, chunk_hashes_hex: Sequence[str] | None, token_ids: Sequence[int] | None) -> list[Target]:
        if (chunk_hashes_hex is None) == (token_ids is None):
            raise BadRequest("name the prefix by exactly one of chunk_hashes (hex) or token_ids")
        registered = self._contexts.namespaces()
        models = sorted({spec.model for spec, _, _ in registered})
        if model is None:
            if len(models) > 1:
                raise BadRequest(f"several models are registered ({', '.join(models)}): name one in 'model'")
        else:
            registered = [r for r in registered if r[0].model == model]
        specs = [(spec, size) for spec, size, _ in registered]
        if token_ids is not None and registered:
            # Token ids become keys by kvdepot's own chain; an engine that names its chunks another way
            # (vLLM's native offloading: vLLM's block keys) stores objects no token-id hash ever names.
            foreign = sorted({s for _, _, schemes in registered for s in schemes if s not in ("", HASH_SCHEME)})
            specs = [(spec, size) for spec, size, schemes in registered if schemes & {"", HASH_SCHEME}]
            if not specs:
                raise BadRequest(
                    f"the engines registered for this model name their chunks their own way ({', '.join(foreign)}), not by "
                    f"kvdepot's token chain: token_ids cannot name their objects; name the prefix by chunk_hashes"
                )
        if not specs:
            known = f"registered: {', '.join(models)}" if models else "no engine is registered"
            raise KVDepotError(
                f"no registered context for model {model!r} ({known}): an object's key includes the model, rank, "
                f"layout and chunk size, which only a registered engine tells the server", ErrorCode.UNKNOWN_CONTEXT,
            )
        algorithm = self._storage.config.hash_algorithm
        if chunk_hashes_hex is not None:
            hashes = [_unhex(h, algorithm.digest_size) for h in chunk_hashes_hex]
        out = []
        for spec, chunk_bytes in specs:
            if token_ids is not None:
                try:
                    hashes = chunk_hashes(token_ids, spec.chunk_size, algorithm)
                except ValueError as exc:
                    raise BadRequest(f"token_ids: {exc}") from None
            if len(hashes) > MAX_KEYS:
                raise BadRequest(f"{len(hashes)} chunks in one request; at most {MAX_KEYS}")
            ns = spec.digest(cache_salt)
            out.append(Target(spec, chunk_bytes, [ObjectKey(ns + h) for h in hashes]))
        return out

    # --- the controls --------------------------------------------------------------------------------

    def pin(self, targets: list[Target], cache_salt: str, ttl_s: float | None) -> dict:
        pins: list[PinInfo] = []
        try:
            for t in targets:
                pins.append(self._storage.pin(t.keys, cache_salt, ttl_s))
        except BaseException:
            # One namespace's pin refused (its salt's quota, too many pins): the request fails whole, so
            # the pins already taken for the other targets go too (their ids are never told: a hard one
            # would protect its prefix, and count against the quota, for good).
            for p in pins:
                self._storage.unpin(p.id)
            raise
        return {
            "requested": sum(len(t.keys) for t in targets),
            "pinned": sum(p.pinned for p in pins),
            "pins": [_doc(p) | {"model": t.spec.model, "rank": t.spec.rank} for p, t in zip(pins, targets)],
        }

    def unpin(self, pin_id: int) -> dict:
        return _doc(self._storage.unpin(pin_id))

    def extend_pin(self, pin_id: int, ttl_s: float) -> dict:
        return _doc(self._storage.extend_pin(pin_id, ttl_s))

    def pins(self) -> list[dict]:
        return [_doc(p) for p in self._storage.pins()]

    def open_session(self, cache_salt: str, name: str, ttl_s: float | None, targets: list[Target]) -> dict:
        keys = [k for t in targets for k in t.keys]
        return _doc(self._storage.touch_agent_session(cache_salt, name, keys, ttl_s))

    def renew_session(self, cache_salt: str, name: str, ttl_s: float | None) -> dict:
        return _doc(self._storage.renew_agent_session(cache_salt, name, ttl_s))

    def close_session(self, cache_salt: str, name: str) -> dict:
        return _doc(self._storage.close_agent_session(cache_salt, name))

    def sessions(self) -> list[dict]:
        return [_doc(s) for s in self._storage.agent_sessions()]

    def prefetch(self, targets: list[Target], cache_salt: str, wait_s: float) -> dict:
        """Bring each target's prefix from the tiers into L1 (storage's LOOKUP prefetch path), waiting
        at most ``wait_s`` for all of them; then say how many leading chunks are in L1."""
        if not 0 <= wait_s <= MAX_PREFETCH_WAIT_S:
            raise BadRequest(f"wait_s must lie in [0, {MAX_PREFETCH_WAIT_S:g}]")
        before, done = [], []
        for t in targets:
            hits = self._storage.lookup(t.keys)
            before.append(hits)
            finished = threading.Event()
            done.append(finished)
            if hits >= len(t.keys) or not self._storage.prefetch(t.keys, hits, t.chunk_bytes, cache_salt, _setter(finished)):
                finished.set()  # all in L1 already, or no tier to fetch from
        # One deadline for all: each event waited wait_s anew, so prefetches ending one after another
        # (a slow tier serving the ranks in turn) held the request up to the rank count times wait_s.
        deadline = time.monotonic() + wait_s
        complete = all(event.wait(max(0.0, deadline - time.monotonic())) for event in done)
        after = [self._storage.lookup(t.keys) for t in targets]
        return {
            "requested": sum(len(t.keys) for t in targets),
            "in_l1_before": sum(before),
            "in_l1": sum(after),
            "complete": complete,  # False: wait_s passed first (the prefetch goes on in the background)
            "tiers": self._storage.tier_count,
            "targets": [
                {"model": t.spec.model, "rank": t.spec.rank, "requested": len(t.keys), "in_l1_before": b, "in_l1": a}
                for t, b, a in zip(targets, before, after)
            ],
        }

    def delete(self, targets: list[Target], scope: ClearScope) -> dict:
        results = [self._storage.delete(t.keys, scope) for t in targets]
        tiers: dict[str, int] = {}
        for r in results:
            for name, n in r.tiers_removed.items():
                tiers[name] = -1 if n < 0 or tiers.get(name, 0) < 0 else tiers.get(name, 0) + n
        return {
            "requested": sum(len(t.keys) for t in targets),
            "l1_removed": sum(r.l1_removed for r in results),
            "l1_doomed": sum(r.l1_doomed for r in results),
            "tiers_removed": tiers,
        }


def _setter(event: threading.Event):
    def on_done(_: Prefetched) -> None:
        event.set()

    return on_done


def _unhex(text: str, size: int) -> bytes:
    try:
        raw = binascii.unhexlify(text)
    except (binascii.Error, ValueError):
        raise BadRequest(f"chunk hash {text[:80]!r} is not hex") from None
    if len(raw) != size:
        raise BadRequest(f"chunk hashes must be {size} bytes ({2 * size} hex digits), got {len(raw)}")
    return raw
