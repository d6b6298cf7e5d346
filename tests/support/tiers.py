"""Shared pieces of the L2 tier tests (``test_tiers``, ``test_tier_faults``, ``test_tier_restart``, and
the integrity suite): tier specs, prompts, and waiting on the store controller.

Every server is a real ``kvdepot server`` process (``make_server``) and every tier a real backend:
``fs`` on a local directory, a ``valkey-server`` process, SeaweedFS ``weed mini`` for S3. The backends
and their fixtures (``valkey_server``, ``s3_server``, and for fault tests that kill them
``own_valkey``, ``own_weed``, ``remote_backend``) are in ``backends.py`` and ``plugin.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdepot import KVClient

from support.backends import _unique  # one counter with the contract suite's prefixes: they share servers
from support.servers import CHUNK, LAYOUT, Server, as_bits, make_kv, make_tokens, wait_until

BIG_CHUNK = 64  # tokens: 64 x 512 B = 32 KiB objects, for the tests that overflow a small L1
TINY_L1_GB = "0.01"  # ~10 MiB: about 300 chunks of 32 KiB
STORE_IDLE_TIMEOUT_S = 60.0


def unique(label: str) -> str:
    """A name no other test in this run uses (valkey/s3 prefixes, tier names)."""
    return f"{label}-{os.getpid():x}-{next(_unique)}"


# --- tier specs (the --l2 CLI forms) ----------------------------------------------------------------


def fs_spec(path: Path | str, name: str = "disk", **options: object) -> str:
    opts = {"path": str(path), "name": name, "size_gb": 1, **options}
    return "fs:" + ",".join(f"{k}={v}" for k, v in opts.items())


def valkey_spec(url: str, name: str = "kv", **options: object) -> str:
    # socket_timeout_s bounds how long one operation on a hung server waits before the tier goes down.
    opts = {"url": url, "name": name, "prefix": unique("kvt") + ":", "socket_timeout_s": 2, **options}
    return "valkey:" + ",".join(f"{k}={v}" for k, v in opts.items())


def s3_spec(endpoint: str, name: str = "obj", **options: object) -> str:
    """The JSON form of ``--l2`` (the other form is exercised by the fs and valkey specs)."""
    spec = {
        "type": "s3",
        "name": name,
        "bucket": "kvdepot-itest",
        "prefix": unique("t") + "/",
        "endpoint_url": endpoint,
        "access_key_id": "kvdepot",
        "secret_access_key": "kvdepot-secret",
        "create_bucket": True,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0,
        "max_attempts": 1,
        **options,
    }
    return json.dumps(spec)


def start_tier_server(
    make_server: Callable[..., Server],
    *specs: str,
    chunk: int = CHUNK,
    l1_gb: str | None = None,
    extra: tuple[str, ...] = (),
    name: str | None = None,
) -> Server:
    """A server with the given ``--l2`` tiers (conftest's defaults for the rest; later options win)."""
    args = ["--chunk-size", str(chunk)]
    if l1_gb is not None:
        args += ["--l1-size-gb", l1_gb]
    for spec in specs:
        args += ["--l2", spec]
    return make_server(*args, *extra, name=name)


# --- prompts ----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # identity equality: the arrays do not compare to one bool
class Prompt:
    tokens: np.ndarray
    kv: np.ndarray
    chunk: int

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_chunks(self) -> int:
        return len(self.tokens) // self.chunk

    def __repr__(self) -> str:
        return f"Prompt({self.n_chunks} chunks of {self.chunk} tokens, first token {int(self.tokens[0])})"

    def head(self, n_chunks: int) -> Prompt:
        """The prompt's first ``n_chunks`` chunks (the same objects)."""
        n = n_chunks * self.chunk
        return Prompt(self.tokens[:n], self.kv[:, :, :n], self.chunk)


def make_prompt(n_chunks: int, seed: int, chunk: int = CHUNK) -> Prompt:
    tokens = make_tokens(n_chunks * chunk, seed)
    return Prompt(tokens, make_kv(LAYOUT, len(tokens), seed), chunk)


def extend_prompt(base: Prompt, more_chunks: int, seed: int) -> Prompt:
    """``base`` followed by ``more_chunks`` new chunks: its first chunks are the same objects."""
    extra = make_prompt(more_chunks, seed, base.chunk)
    return Prompt(np.concatenate([base.tokens, extra.tokens]), np.concatenate([base.kv, extra.kv], axis=2), base.chunk)


def store_full(c: KVClient, p: Prompt) -> None:
    assert c.store(p.tokens, p.kv) == p.n_tokens, "the store did not keep every chunk in L1"


def assert_prefix_bytes(got: np.ndarray, p: Prompt, n_tokens: int) -> None:
    """``got`` is exactly the first ``n_tokens`` of ``p``'s KV, bit for bit."""
    assert got.shape[2] == n_tokens, f"got {got.shape[2]} tokens, expected {n_tokens}"
    want = p.kv[:, :, :n_tokens]
    assert got.shape == want.shape
    assert np.array_equal(as_bits(np.asarray(got)), as_bits(want)), "bytes differ"


def assert_served_whole(c: KVClient, p: Prompt) -> None:
    """The simple API finds every chunk and returns the exact bytes."""
    found = c.lookup(p.tokens)
    assert found == p.n_tokens, f"lookup found {found} of {p.n_tokens} tokens"
    assert_prefix_bytes(c.retrieve(p.tokens), p, p.n_tokens)


def assert_consistent(c: KVClient, p: Prompt) -> int:
    """Whatever lookup reports, retrieve returns that many tokens, bit-exact; returns the count."""
    n = c.lookup(p.tokens)
    assert n % p.chunk == 0 and 0 <= n <= p.n_tokens
    got = c.retrieve(p.tokens)
    # retrieve may find more than the lookup did (a prefetch between them), never other bytes
    assert got.shape[2] >= n, f"lookup said {n} tokens, retrieve returned {got.shape[2]}"
    assert_prefix_bytes(got, p, got.shape[2])
    return n


def wait_prefetch(c: KVClient, session_id: str) -> int:
    """Ask QUERY_PREFETCH_STATUS until the session's prefetch has ended; returns the final hits."""
    box: list[int] = []

    def done() -> bool:
        hits = c.query_prefetch_status(session_id)
        if hits is not None:
            box.append(hits)
        return hits is not None

    wait_until(done, timeout_s=30, interval_s=0.005, what=f"the prefetch of session {session_id!r}")
    return box[0]


# --- status -----------------------------------------------------------------------------------------


def tier_of(status: dict, name: str) -> dict:
    found = [t for t in status["tiers"] if t["name"] == name]
    assert len(found) == 1, f"no single tier named {name!r} in {status['tiers']}"
    return found[0]


def store_stats(status: dict) -> dict:
    return status["l2_controllers"]["store"]


def prefetch_stats(status: dict) -> dict:
    return status["l2_controllers"]["prefetch"]


def wait_store_idle(srv: Server, timeout_s: float = STORE_IDLE_TIMEOUT_S, accounted: int | None = None) -> dict:
    """Poll /status until the store controller has nothing queued and nothing in flight; then return a
    fresh /status (one document reads the tiers' usage *before* the controllers, so the document that
    first shows the controller idle may predate the last completed store's effect on a tier).

    The controller pops a batch from its queue before it counts it in flight, so "idle" can be seen for
    a moment while a batch is on its way to the tiers: idle counts only when two polls in a row see it
    with the same counters. ``accounted``: also wait until that many objects are accounted for
    (submitted, dropped or skipped_gone)."""
    last: list[tuple] = []

    def idle() -> bool:
        s = store_stats(srv.status())
        if accounted is not None and s["submitted"] + s["dropped"] + s["skipped_gone"] < accounted:
            return False
        if s["queued"] or s["in_flight"]:
            last.clear()
            return False
        counters = tuple(sorted(s.items()))
        settled = last == [counters]
        last[:] = [counters]
        return settled

    wait_until(idle, timeout_s=timeout_s, interval_s=0.02, what="the L2 store controller to go idle")
    return srv.status()


def wait_tier(srv: Server, name: str, predicate: Callable[[dict], bool], what: str, timeout_s: float = 30.0) -> dict:
    def check() -> dict | None:
        t = tier_of(srv.status(), name)
        return t if predicate(t) else None

    return wait_until(check, timeout_s=timeout_s, interval_s=0.05, what=what)  # type: ignore[return-value]


def assert_no_loss_counters(status: dict) -> None:
    """Every object that became READY was pushed to every tier (nothing failed, dropped or evicted first)."""
    s = store_stats(status)
    assert (s["failed"], s["dropped"], s["skipped_gone"]) == (0, 0, 0), s
    assert (status["l1"]["evicted_awaiting_l2"], status["request_failures"]["lost_before_l2"]) == (0, 0)


def fs_object_file(tier_dir: Path, c: KVClient, p: Prompt, chunk_index: int) -> Path:
    """The fs tier's file for one chunk: ``<xx>/<namespace hex><chunk hash hex>``."""
    chunk_hash = c.hashes(p.tokens)[chunk_index].hex()
    found = [f for f in tier_dir.glob(f"??/*{chunk_hash}") if not f.name.startswith(".tmp-")]
    assert len(found) == 1, f"expected one file for chunk {chunk_index}, found {found}"
    return found[0]
