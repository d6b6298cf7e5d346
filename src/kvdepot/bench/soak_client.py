"""One client of ``kvdepot bench soak``: an engine-like mixed workload that checks every byte it reads.

Run as ``python -m kvdepot.bench.soak_client SPEC`` (a JSON object). Each round picks a prompt: a
conversation of its own grows by a turn, a new one starts on one of the shared system prompts, or an
old one comes back (by then often evicted from L1 and read from L2, or gone). Then, as an engine does:
LOOKUP (a Python list of token ids), read the hit (zero-copy views under a lease, or a copy), store
what was missing, and now and then PING. Some reads hold their lease a while, so that a SIGSTOP often
lands inside one.

Every chunk's bytes are a function of its tokens alone (``chunk_pattern``), so any client can check
any chunk, whoever stored it: a read that returns other bytes is counted as a mismatch. Every call
is counted by outcome: answered, refused with a kvdepot error (by class: a per-request problem, such
as a lease revoked while this process was stopped), or unanswered (a timeout, the server unreachable).

Protocol with the parent: one JSON line of counters on stdout every ``report_every_s`` and a last one
when stdin says ``stop`` (or closes); a crash of the client's own code is counted, not fatal.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
import traceback
from collections import Counter

import numpy as np

from kvdepot.layout import KVLayout

# 2 layers of 4 KV heads of 64, fp16: 2 KiB a token, so a 256-token chunk is 512 KiB: a small L1
# overflows within seconds and the disk tier fills soon after.
SOAK_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16")
CHUNK_TOKENS = 256
SYSTEM_PROMPTS = 4  # shared by every client: chunk ids 0 .. SYSTEM_PROMPTS * SYSTEM_CHUNKS - 1
SYSTEM_CHUNKS = 2
MAX_CONVERSATIONS = 6
MAX_CHUNKS = 12  # a conversation that reaches this many chunks is replaced by a new one

_BASE = np.arange(int(np.prod(SOAK_LAYOUT.chunk_shape(CHUNK_TOKENS))), dtype=np.uint32)


def chunk_tokens(cid: int) -> range:
    """The token ids of chunk ``cid``: distinct for every chunk id (ids stay below 2**24)."""
    return range(cid * CHUNK_TOKENS, (cid + 1) * CHUNK_TOKENS)


def chunk_pattern(cid: int) -> np.ndarray:
    """The KV bytes of chunk ``cid`` (uint16 bits, the chunk's shape): different in every element for
    two different ids (almost everywhere), so a chunk served for another, or partly overwritten, cannot pass."""
    mixed = (_BASE + np.uint32((cid * 0x9E3779B1) & 0xFFFFFFFF)) * np.uint32(0x85EBCA6B)
    return (mixed >> np.uint32(16)).astype(np.uint16).reshape(SOAK_LAYOUT.chunk_shape(CHUNK_TOKENS))


class Workload:
    """The prompts of one client: its conversations (lists of chunk ids) on the shared system prompts."""

    def __init__(self, uid: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.uid = uid  # 1..255: its chunk ids are uid << 16 | n
        self.made = 0
        self.conversations: list[list[int]] = []

    def _new_chunk(self) -> int:
        self.made = (self.made + 1) & 0xFFFF
        return self.uid << 16 | self.made

    def next_prompt(self) -> list[int]:
        r = self.rng.random()
        if self.conversations and r < 0.35:  # an old conversation comes back unchanged
            return self.rng.choice(self.conversations)
        if self.conversations and r < 0.8:  # a conversation grows by a turn
            conv = self.rng.choice(self.conversations)
            if len(conv) + 2 <= MAX_CHUNKS:
                conv.extend(self._new_chunk() for _ in range(self.rng.randint(1, 2)))
                return conv
            self.conversations.remove(conv)
        system = self.rng.randrange(SYSTEM_PROMPTS)
        conv = [system * SYSTEM_CHUNKS + i for i in range(SYSTEM_CHUNKS)] + [self._new_chunk()]
        self.conversations.append(conv)
        if len(self.conversations) > MAX_CONVERSATIONS:
            self.conversations.pop(0)
        return conv


class Tally:
    """Counters shared by the round loop and the reporter thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.mismatch_examples: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def mismatch(self, what: str) -> None:
        with self.lock:
            self.counts["mismatched_chunks"] += 1
            if len(self.mismatch_examples) < 5:
                self.mismatch_examples.append(what)

    def snapshot(self, final: bool = False) -> str:
        with self.lock:
            return json.dumps({"counts": dict(self.counts), "mismatches": list(self.mismatch_examples), "final": final})


def _check(tally: Tally, cids: list[int], chunks: list[np.ndarray], how: str) -> None:
    for j, got in enumerate(chunks):
        if np.array_equal(got.view(np.uint16), chunk_pattern(cids[j])):
            tally.add("verified_chunks")
            tally.add("verified_bytes", got.nbytes)
        else:
            tally.mismatch(f"{how}: chunk {j} (id {cids[j]}) differs")


def one_round(c, work: Workload, tally: Tally, rng: random.Random) -> None:
    """LOOKUP, read the hit and check it, store the rest: one request as an engine makes it."""
    cids = work.next_prompt()
    tokens = [t for cid in cids for t in chunk_tokens(cid)]  # a Python list, as vLLM hands them over
    hashes = c.hashes(tokens)
    found = c.lookup(tokens) // CHUNK_TOKENS
    tally.add("answered.lookup")
    tally.add("hit_chunks", found)
    tally.add("asked_chunks", len(cids))
    if found:
        if rng.random() < 0.5:
            with c.prepare_retrieve(hashes[:found]) as views:
                tally.add("answered.prepare_retrieve")
                if rng.random() < 0.2:
                    time.sleep(0.05)  # a slow step holding its lease
                _check(tally, cids, list(views), "zero-copy read")
            tally.add("sent.release")  # sent behind: no reply is waited for, so not counted as answered
        else:
            kv = c.retrieve(tokens[: found * CHUNK_TOKENS])
            tally.add("answered.retrieve")
            _check(tally, cids, [kv[:, :, j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS] for j in range(kv.shape[2] // CHUNK_TOKENS)], "copy read")
    if found < len(cids):
        kv = np.concatenate([chunk_pattern(cid) for cid in cids], axis=2).view(np.float16)
        c.store(tokens, kv)
        tally.add("answered.store")
        tally.add("stored_chunks", len(cids) - found)
    if rng.random() < 0.2:
        c.ping()
        tally.add("answered.ping")


class _LogTally(logging.Handler):
    """What the client library only logs, counted: an error it logged (e.g. a release answered LEASE_EXPIRED:
    the server let go of a reader's pins while it read) and a release it could not send."""

    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.tally.add("client_errors_logged")
        elif "could not send" in str(record.msg):
            self.tally.add("unanswered")
            self.tally.add("unanswered.release")


def main(spec: dict) -> int:
    from kvdepot.client.client import ClientOptions, KVClient
    from kvdepot.errors import KVDepotError, KVDepotTimeout, PrefetchTooSlow, ServerUnreachable

    tally = Tally()
    stop = threading.Event()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # still into client-N.log
    logging.getLogger("kvdepot").addHandler(_LogTally(tally))

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    def report() -> None:
        while not stop.wait(spec.get("report_every_s", 0.5)):
            print(tally.snapshot(), flush=True)

    threading.Thread(target=read_stdin, daemon=True).start()
    threading.Thread(target=report, daemon=True).start()
    rng = random.Random(spec["seed"])
    work = Workload(spec["uid"], spec["seed"])
    options = ClientOptions(chunk_size=CHUNK_TOKENS, transport=spec["transport"], timeout_s=spec["timeout_s"])
    with KVClient(spec["url"], "bench-soak", SOAK_LAYOUT, options=options) as c:
        tally.add("connected")
        while not stop.is_set():
            try:
                one_round(c, work, tally, rng)
                tally.add("rounds")
            except (KVDepotTimeout, ServerUnreachable) as e:
                tally.add("unanswered")
                tally.add(f"unanswered.{type(e).__name__}")
            except PrefetchTooSlow as e:
                if isinstance(e.__context__, KVDepotTimeout):  # a prefetch poll the server never answered
                    tally.add("unanswered")                     # (ContextLink.stored_chunks says "too slow")
                    tally.add("unanswered.prefetch_poll")
                else:
                    tally.add(f"refused.{e.code.name}")
            except KVDepotError as e:  # a per-request problem the server answered: this request's miss
                tally.add(f"refused.{e.code.name}")
            except Exception:  # the client's own bug: counted (the soak fails on it), and the loop goes on
                tally.add("client_crashes")
                traceback.print_exc()
            time.sleep(spec.get("pause_s", 0.0))
    print(tally.snapshot(final=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
