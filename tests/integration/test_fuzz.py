"""A seeded fuzz run: thousands of random, garbled and half-valid messages from several DEALER sockets.

Afterwards the server must be alive (PING, /healthcheck 200), every message must have had exactly one
reply, no handler may have crashed (INTERNAL), data stored before the storm must come back bit-exact,
and once the fuzzing clients are declared gone no lease, session or context of theirs may be left.

Set KVDEPOT_FUZZ_SEED to replay another seed.
"""

from __future__ import annotations

import os
import random
from collections import deque

import httpx
import msgspec
import pytest

from kvdepot.errors import ErrorCode
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.identity import boot_id, pid_namespace

from support.servers import CHUNK, LAYOUT, MODEL, RawPeer, assert_bytes_equal, make_kv, make_tokens, wait_until

SEED = int(os.environ.get("KVDEPOT_FUZZ_SEED", "20240611"))
PEERS = 4
ROUNDS = 30
BATCH = 25  # 4 * 30 * 25 = 3000 messages
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
ROWS = LAYOUT.kv_factor * LAYOUT.num_layers
# CLEAR would (legitimately) wipe the data the test checks afterwards: never sent with a valid body.
TYPES = [t for t in m.RequestType if t is not m.RequestType.CLEAR]
_enc = msgspec.msgpack.Encoder()


class Fuzzer:
    def __init__(self, rng: random.Random, peer: RawPeer, real_hashes: list[list[bytes]]) -> None:
        self.rng = rng
        self.peer = peer
        self.real_hashes = real_hashes
        self.leases: deque[int] = deque(maxlen=32)
        self.sessions = ["s0", "s1", "s2", ""]
        self.sent = 0
        self.received = 0
        self.internal: list[str] = []
        self.history: deque[tuple[str, list[bytes]]] = deque(maxlen=10)
        self.needs_register = False
        self.ok = 0

    # --- random pieces ---------------------------------------------------------------------------------

    def rbytes(self, lo: int = 0, hi: int = 48) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))

    def rint(self) -> int:
        r = self.rng
        return r.choice([0, 1, -1, 2, 3, r.randint(-(2**63), 2**63 - 1), r.randint(0, 100), 2**64 - 1, self.peer.context_id])

    def rvalue(self, depth: int = 0):
        r = self.rng
        kinds = ["int", "str", "bytes", "float", "none", "bool"] + (["list", "map"] if depth < 3 else [])
        k = r.choice(kinds)
        if k == "int":
            return self.rint()
        if k == "str":
            return "".join(chr(r.randint(32, 0x2FF)) for _ in range(r.randint(0, 12)))
        if k == "bytes":
            return self.rbytes()
        if k == "float":
            return r.choice([0.0, -1.5, 1e308, float("inf"), float("nan")])
        if k == "none":
            return None
        if k == "bool":
            return r.random() < 0.5
        if k == "list":
            return [self.rvalue(depth + 1) for _ in range(r.randint(0, 4))]
        return {str(self.rvalue(depth + 1)): self.rvalue(depth + 1) for _ in range(r.randint(0, 4))}

    def keys(self) -> list[bytes]:
        r = self.rng
        roll = r.random()
        if roll < 0.35 and self.real_hashes:
            chain = r.choice(self.real_hashes)
            start = r.randint(0, 2)
            return chain[start : start + r.randint(0, len(chain))]
        if roll < 0.85:
            return [r.randbytes(32) for _ in range(r.randint(0, 6))]
        return [r.randbytes(r.choice([0, 1, 16, 31, 33, 64])) for _ in range(r.randint(1, 3))]

    def lease(self) -> int:
        r = self.rng
        if self.leases and r.random() < 0.6:
            return r.choice(list(self.leases))
        return r.choice([0, r.randint(1, 200), -1, 2**62])

    def session(self) -> str:
        return self.rng.choice(self.sessions)

    def ctx(self) -> int:
        r = self.rng
        return self.peer.context_id if r.random() < 0.85 else r.choice([0, r.randint(1, 50), -7])

    def good_register(self) -> m.RegisterContextRequest:
        return m.RegisterContextRequest(
            protocol_version=m.PROTOCOL_VERSION,
            model=MODEL,
            layout=m.LayoutSpec(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim),
            client=self.client_info(),
        )

    def layout_spec(self) -> m.LayoutSpec:
        r = self.rng
        if r.random() < 0.5:
            return m.LayoutSpec(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim)
        return m.LayoutSpec(
            num_layers=r.choice([0, 1, 2, 3, -1, 10**9]),
            num_kv_heads=r.choice([1, 2, 0]),
            head_dim=r.choice([8, 32, 64, 0]),
            dtype=r.choice(["float16", "bfloat16", "float8_e4m3fn", "float32", "bogus", ""]),
            use_mla=r.random() < 0.2,
        )

    def client_info(self) -> m.ClientInfo:
        r = self.rng
        roll = r.random()
        if roll < 0.5:
            return m.ClientInfo()
        if roll < 0.8:  # looks same-host, names a pid that (almost surely) does not exist
            return m.ClientInfo(pid=r.randint(4_000_000, 2**31 - 1), hostname="x", boot_id=boot_id(), pid_namespace=pid_namespace())
        return m.ClientInfo(pid=r.randint(-5, 2**31), hostname=self.rbytes().hex(), boot_id=self.rbytes().hex(), pid_namespace=r.randint(0, 9))

    def payload(self, n_keys: int, rpf: int) -> list[bytes]:
        r = self.rng
        roll = r.random()
        if roll < 0.5 and rpf == ROWS:
            return [r.randbytes(CHUNK_BYTES) for _ in range(n_keys)]  # well-formed
        if roll < 0.8:
            return [r.randbytes(r.choice([0, 1, CHUNK_BYTES // 4, CHUNK_BYTES - 1, CHUNK_BYTES])) for _ in range(r.randint(0, 5))]
        return []

    def valid_body(self, rtype: m.RequestType) -> tuple[msgspec.Struct, list[bytes]]:
        r, R = self.rng, m.RequestType
        if rtype is R.PING:
            return m.PingRequest(), []
        if rtype is R.REGISTER_CONTEXT:
            return (
                m.RegisterContextRequest(
                    protocol_version=r.choice([m.PROTOCOL_VERSION] * 4 + [0, 2]),
                    model=r.choice([MODEL, MODEL, "", "other"]),
                    layout=self.layout_spec(),
                    world_size=r.choice([1, 1, 2, 0, -1]),
                    rank=r.choice([0, 0, 1, -1, 5]),
                    chunk_size=r.choice([0, 0, CHUNK, 1, 7, -3, 1 << 22]),
                    client=self.client_info(),
                ),
                [],
            )
        if rtype is R.UNREGISTER_CONTEXT:
            return m.UnregisterContextRequest(context_id=self.ctx() if r.random() < 0.1 else r.randint(1000, 2000)), []
        if rtype is R.GET_CHUNK_SIZE:
            return m.GetChunkSizeRequest(), []
        if rtype is R.LOOKUP:
            return m.LookupRequest(context_id=self.ctx(), keys=self.keys(), cache_salt=r.choice(["", "a"]), session_id=self.session()), []
        if rtype is R.QUERY_PREFETCH_STATUS:
            return m.QueryPrefetchStatusRequest(context_id=self.ctx(), session_id=self.session()), []
        if rtype is R.FREE_LOOKUP_LOCKS:
            return m.FreeLookupLocksRequest(context_id=self.ctx(), session_id=self.session(), start=self.rint(), end=self.rint()), []
        if rtype is R.PREPARE_STORE:
            keys = self.keys()
            tokens = r.choice([[], [], list(range(len(keys) * CHUNK)), [1, 2, 3], [-1] * (len(keys) * CHUNK), [1 << 40] * (len(keys) * CHUNK)])
            return m.PrepareStoreRequest(context_id=self.ctx(), keys=keys, cache_salt=r.choice(["", "a"]), token_ids=tokens,
                                         agent_session=r.choice(["", "", "conv"])), []  # fmt: skip
        if rtype is R.COMMIT_STORE:
            return m.CommitStoreRequest(context_id=self.ctx(), lease_id=self.lease(), abort=r.random() < 0.5), []
        if rtype is R.PREPARE_RETRIEVE:
            return (
                m.PrepareRetrieveRequest(context_id=self.ctx(), keys=self.keys(), session_id=self.session(), start=r.choice([0, 0, 1, 2, -1, 99])),
                [],
            )
        if rtype is R.COMMIT_RETRIEVE:
            return m.CommitRetrieveRequest(context_id=self.ctx(), lease_id=self.lease()), []
        if rtype is R.STORE_INLINE:
            keys = self.keys()
            first = r.choice([0, 0, 0, 1, -1, len(keys), len(keys) + 1])
            rpf = r.choice([ROWS, ROWS, ROWS, 1, 2, 0, -1, 10**6])
            return (
                m.StoreInlineRequest(context_id=self.ctx(), keys=keys, rows_per_frame=rpf, cache_salt=r.choice(["", "a"]), first=first),
                self.payload(max(0, len(keys) - max(first, 0)), rpf),
            )
        if rtype is R.RETRIEVE_INLINE:
            return (
                m.RetrieveInlineRequest(context_id=self.ctx(), keys=self.keys(), session_id=self.session(), start=r.choice([0, 0, 1, -1, 50])),
                [],
            )
        if rtype is R.END_SESSION:
            return m.EndSessionRequest(context_id=self.ctx(), session_id=self.session()), []
        if rtype is R.REPORT_BLOCK_ALLOCATION:
            return m.ReportBlockAllocationRequest(context_id=self.ctx(), allocated_blocks=self.rint(), freed_blocks=self.rint()), []
        if rtype is R.RENEW_LEASES:
            leases = [self.lease() for _ in range(r.choice([0, 1, 3]))]
            sessions = [self.session() for _ in range(r.choice([0, 1, 2]))]
            return m.RenewLeasesRequest(context_id=self.ctx(), lease_ids=leases, sessions=sessions), []
        if rtype is R.PIN_PREFIX:
            return m.PinPrefixRequest(context_id=self.ctx(), keys=self.keys(), cache_salt=r.choice(["", "a"]), ttl_s=r.choice([0.0, 5.0, -1.0, 1e12])), []
        if rtype is R.UNPIN:
            return m.UnpinRequest(pin_id=self.rint()), []
        if rtype is R.CLOSE_AGENT_SESSION:
            return m.CloseAgentSessionRequest(name=r.choice(["", "conv", "x" * 5000]), cache_salt=r.choice(["", "a"])), []
        if rtype is R.REGISTER_KV_CACHE:  # memory the server must never map: files elsewhere, bogus CUDA handles
            memories: list = [
                r.choice([
                    m.HostFileMemory(path=r.choice(["/etc/passwd", "/dev/shm/kvdepot-kvcache-nope", "../kvdepot-kvcache-x", "", "/dev/shm"]),
                                     size=self.rint(), offset=self.rint()),
                    m.CudaIpcMemory(device_uuid=r.choice(["", "GPU-0", "x" * 300]), handle=self.rbytes(0, 80), size=self.rint(), offset=self.rint(),
                                    ref_counter_handle=self.rbytes(), ref_counter_offset=self.rint()),
                ])
                for _ in range(r.choice([0, 1, 2]))
            ]  # fmt: skip
            layers = [
                m.PagedLayerSpec(memory=r.choice([0, 1, -1, 5]), offset=self.rint(), shape=[self.rint() for _ in range(r.choice([0, 4, 5]))],
                                 stride=[self.rint() for _ in range(r.choice([0, 5]))], dtype=r.choice(["bfloat16", "float16", "nope", ""]),
                                 format=r.choice(["kv_first", "block_first", "head_major", "??"]), group=self.rint())
                for _ in range(r.choice([0, 1, LAYOUT.num_layers]))
            ]  # fmt: skip
            return m.RegisterKVCacheRequest(context_id=self.ctx(), memories=memories, layers=layers, block_size=r.choice([0, 1, 16, -4, 1 << 40])), []
        if rtype is R.UNREGISTER_KV_CACHE:
            return m.UnregisterKVCacheRequest(context_id=self.ctx(), cache_id=self.rint()), []
        if rtype in (R.STORE_BLOCKS, R.RETRIEVE_BLOCKS):
            keys = self.keys()
            ids = [[self.rint() for _ in range(r.choice([0, 1, 4]))] for _ in range(r.choice([0, 1, 2]))]
            if rtype is R.STORE_BLOCKS:
                body = m.StoreBlocksRequest(context_id=self.ctx(), cache_id=self.rint(), keys=keys, block_ids=ids, first=r.choice([0, 1, -1, 99]),
                                            ready_event=self.rbytes(0, 64))  # fmt: skip
            else:
                body = m.RetrieveBlocksRequest(context_id=self.ctx(), cache_id=self.rint(), keys=keys, block_ids=ids, session_id=self.session(),
                                               start=r.choice([0, 1, -1]), skip_first_n_tokens=self.rint(), ready_event=self.rbytes(0, 64))  # fmt: skip
            return body, []
        if rtype.name.startswith("PEER_"):  # node-to-node requests: a kvdepot server answers them with an error
            node = m.PeerNodeInfo(id="10.0.0.9:31995", host="10.0.0.9", control_port=31995, data_port=31996)
            keys = self.keys()
            return {
                R.PEER_JOIN: m.PeerJoinRequest(node=node),
                R.PEER_HEARTBEAT: m.PeerHeartbeatRequest(node=node),
                R.PEER_PUBLISH: m.PeerPublishRequest(records=[m.PeerLocation(key=k, node=node.id, offset=0, length=1, generation=1, checksum=b"")
                                                              for k in keys]),
                R.PEER_UNPUBLISH: m.PeerUnpublishRequest(keys=keys, node=node.id, generations=[1] * len(keys)),
                R.PEER_RESOLVE: m.PeerResolveRequest(keys=keys, own_pages=r.random() < 0.5),
                R.PEER_STATUS: m.PeerStatusRequest(),
                R.PEER_PROMOTE: m.PeerPromoteRequest(keys=keys),
            }[rtype], []  # fmt: skip
        raise AssertionError(rtype)

    def header(self, rtype: int) -> bytes:
        r = self.rng
        version = m.PROTOCOL_VERSION if r.random() < 0.9 else r.choice([0, 2, -1, 255])
        timeout_ms = r.choice([0, 0, 10_000, -1, 2**40])
        rid = r.choice([r.randint(1, 2**31), 0, -1, 2**63 - 1])
        return _enc.encode(m.RequestHeader(version, rid, rtype, timeout_ms))

    def garble(self, body: msgspec.Struct) -> bytes:
        r = self.rng
        d = msgspec.to_builtins(body)
        roll = r.random()
        if roll < 0.25 and d:
            d.pop(r.choice(list(d)))
        elif roll < 0.5:
            d[r.choice(list(d) + ["extra", "zz"])] = self.rvalue()
        elif roll < 0.7:
            d = self.rvalue()
        elif roll < 0.85:
            raw = bytearray(_enc.encode(d))
            for _ in range(r.randint(1, 4)):
                if raw:
                    raw[r.randrange(len(raw))] = r.randrange(256)
            return bytes(raw)
        else:
            raw = _enc.encode(d)
            return raw[: r.randint(0, len(raw))]
        return _enc.encode(d)

    # --- messages --------------------------------------------------------------------------------------

    def message(self) -> tuple[str, list[bytes]]:
        r = self.rng
        roll = r.random()
        if roll < 0.1:
            return "random-frames", [self.rbytes() for _ in range(r.randint(1, 5))]
        if roll < 0.2:
            return "random-body", [self.header(r.choice([int(t) for t in TYPES] + [0, 99, -3])), self.rbytes(), *[self.rbytes() for _ in range(r.randint(0, 2))]]
        rtype = r.choice(TYPES)
        body, payload = self.valid_body(rtype)
        if roll < 0.45:
            return f"garbled-{rtype.name}", [self.header(int(rtype)), self.garble(body), *payload]
        # A well-formed request (the header may still carry an odd version / deadline).
        return f"valid-{rtype.name}", [self.header(int(rtype)), _enc.encode(body), *payload]

    def send_batch(self, n: int) -> None:
        for i in range(n):
            kind, frames = self.message()
            if i == 0 and self.needs_register:  # keep most requests reaching the handlers
                self.needs_register = False
                kind, frames = "register", codec.encode_request(self.rng.randint(1, 2**31), self.good_register())
            self.history.append((kind, frames))
            self.peer.sock.send_multipart(frames)
            self.sent += 1

    def drain(self, timeout_s: float = 20.0) -> None:
        """Collect replies until every sent message is answered (exactly once: no extras either)."""
        import time

        deadline = time.monotonic() + timeout_s
        while self.received < self.sent:
            left = deadline - time.monotonic()
            assert left > 0 and self.peer.sock.poll(int(left * 1000)), (
                f"seed {SEED}: {self.sent - self.received} of {self.sent} messages got no reply; "
                f"last sent: {[k for k, _ in self.history]}"
            )
            reply = self.peer.sock.recv_multipart()
            self.received += 1
            self.check_reply(reply)
        assert not self.peer.sock.poll(50), f"seed {SEED}: more replies than requests"

    def check_reply(self, reply: list[bytes]) -> None:
        assert len(reply) >= 2, f"a reply has header and body frames: {reply!r}"
        header = codec.decode_reply_header(reply[0])
        assert header.version == m.PROTOCOL_VERSION
        code = ErrorCode(header.status)  # raises on a code outside the enum
        if code is ErrorCode.OK:
            self.ok += 1
            try:
                d = msgspec.msgpack.decode(reply[1])
            except msgspec.DecodeError:
                raise AssertionError(f"undecodable success body {reply[1]!r}") from None
            if isinstance(d, dict) and "lease_id" in d and d["lease_id"]:
                self.leases.append(d["lease_id"])
            if isinstance(d, dict) and "context_id" in d and "chunk_size" in d:
                self.peer.context_id = d["context_id"]  # the newest registration is the one we use
        else:
            err = msgspec.msgpack.decode(reply[1], type=m.ErrorReply)
            assert err.code == header.status
            if code is ErrorCode.UNKNOWN_CONTEXT:
                self.needs_register = True
            if code is ErrorCode.INTERNAL:
                self.internal.append(err.message)


@pytest.fixture
def fuzz_server(make_server):
    # Fuzzing peers never say goodbye; a short client timeout lets the server declare them gone.
    return make_server("--client-timeout-s", "2", "--heartbeat-interval-s", "0.3", "--max-frame-mib", "1")


def test_fuzz_storm_leaves_the_server_healthy(fuzz_server):
    srv = fuzz_server
    rng = random.Random(SEED)
    prompts = []
    with srv.client() as c, srv.client(srv.ipc_url, transport="inline") as ci:
        for i in range(6):
            tokens = make_tokens((3 + i) * CHUNK, SEED + i)
            kv = make_kv(LAYOUT, len(tokens), SEED + i)
            assert (c if i % 2 else ci).store(tokens, kv) == (3 + i) * CHUNK
            prompts.append((tokens, kv))
        real_hashes = [c.hashes(t) for t, _ in prompts]
        before = srv.status()

        peers = [RawPeer(srv.url if i % 2 == 0 else srv.ipc_url) for i in range(PEERS)]
        fuzzers = [Fuzzer(random.Random(rng.getrandbits(64)), p, real_hashes) for p in peers]
        try:
            for f in fuzzers:
                f.peer.register(client=m.ClientInfo())  # anonymous, like a remote peer: never given arena offsets
            for _ in range(ROUNDS):
                for f in fuzzers:
                    f.send_batch(BATCH)
                for f in fuzzers:
                    f.drain()
            for f in fuzzers:  # nothing more trickles in: exactly one reply per message
                assert not f.peer.sock.poll(300), f"seed {SEED}: a reply too many"
        finally:
            for p in peers:
                p.close()

        total = sum(f.sent for f in fuzzers)
        assert total == PEERS * ROUNDS * BATCH
        assert sum(f.received for f in fuzzers) == total
        # Enough of the storm got past decoding into the handlers to mean something.
        assert sum(f.ok for f in fuzzers) >= total // 10
        internal = [msg for f in fuzzers for msg in f.internal]
        assert not internal, f"seed {SEED}: handlers crashed on fuzzed input: {internal[:5]}"

        # Alive and healthy.
        with RawPeer(srv.url) as p:
            assert p.ping()
        r = httpx.get(f"{srv.http}/healthcheck", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert srv.alive()

        # The data stored before the storm is intact, over both transports.
        for tokens, kv in prompts:
            for cl in (c, ci):
                assert cl.lookup(tokens) == len(tokens)
                assert_bytes_equal(cl.retrieve(tokens), kv)

        # Once the fuzzing peers are declared gone (client timeout), nothing of theirs remains.
        def settled():
            st = srv.status()
            ok = st["leases"] == 0 and st["sessions"] == 0 and st["contexts"] == 2
            return ok and st["l1"]["writing"] == 0 and st["l1"]["read_locked"] == 0

        wait_until(settled, timeout_s=30, what="the fuzzers' leases, sessions and contexts to be released")
        st = srv.status()
        assert st["requests"].get("PING", 0) >= 1
        assert st["l1"]["objects"] >= before["l1"]["objects"]
        # Everything stored is still intact after the cleanup as well.
        for tokens, kv in prompts:
            assert_bytes_equal(c.retrieve(tokens), kv)
