"""``valkey``: an L2 tier on a Valkey (or Redis) server, with large objects split into parts.

Layout, for an object key ``K`` (hex) under ``prefix``::

    <prefix>{<K>}               manifest: meta (magic, part count, part size, generation) + envelope header
                                + key, and, when the whole object fits in one value, the payload itself
    <prefix>{<K>}:<gen>:<i>     part i of the payload (only when it does not fit), at most max_value_mib
    <prefix>#objects            how many manifests this prefix holds (a counter, for ``usage``)

The brace after the prefix is what makes the names of two tiers distinct: a prefix has no brace (the
config refuses one) and hex has none, so ``p``'s names are never ``p1a``'s, and a clear scans exactly
``<prefix>{*`` (plus its counter). Before this layout a single server's names were ``<prefix><K>``, and
a clear of ``p`` also deleted every object of a tier whose prefix is ``p`` followed by hex digits (its
SCAN ``p*`` matched them as hex). Objects stored under that old layout are not read, counted (beyond the
counter's estimate) nor cleared by this version: they are misses, and stay until the server evicts or
expires them or an operator deletes them (``valkey-cli --scan --pattern '<prefix>*'`` lists them: the
names without a brace after the prefix). Cluster names were always braced and are unchanged.

Why it cannot tear: parts are written first, each under a short orphan TTL; one server-side script then
checks that every part still exists, makes them permanent, and writes the manifest. The manifest is the
commit point, so a reader never finds an object before all its parts exist, and a store that dies half
way leaves only parts that expire on their own. Parts are named by a random generation, so overwriting a
key never mixes an old manifest with new parts; the old generation's parts are deleted after the swap.

A load reads the manifest, then the parts (MGET, a few at a time) into ``dest``, then checks the
checksum over ``dest``. A missing part (evicted by the server's maxmemory policy, or deleted behind our
back) is a miss, and the orphaned manifest is dropped if it is still the same generation. On a miss or
a corrupt object the contents of ``dest`` are unspecified (the caller discards them).

Valkey / Redis Cluster (``cluster=auto`` asks the server, ``on``/``off`` say so): the braces around an
object's hex key are a hash tag there, so the manifest and every part live in one hash slot, the commit and drop scripts run on that slot's node, and objects spread over
the cluster's primaries by key. The client library's cluster mode routes each command, follows MOVED/ASK
and learns the new topology after a failover; while a failed primary's slots have no new primary yet,
their operations fail and the tier's breaker handles it as any outage. The object counter has a slot of
its own, so it is updated beside the commit rather than inside it (it is an estimate in either mode).

``valkey`` (the Python client) is imported when the adapter first connects, so kvdepot imports without
it; it connects at the first operation, so a tier whose server is down at start is down, not fatal.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import re
import struct
import threading
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

from kvdepot.config import ConfigError, ConfigStruct, option
from kvdepot.redact import mask_url
from kvdepot.storage.l2 import envelope
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import AdapterType, TierServices
from kvdepot.storage.l2.envelope import CorruptObject, DestinationMismatch, RejectedObject
from kvdepot.types import ObjectKey

log = logging.getLogger(__name__)

_META = struct.Struct("<4sII8s")  # magic, part count (0: payload inline), part size, generation
_META_MAGIC = b"KVV1"
ORPHAN_TTL_S = 600  # parts of a store that never committed expire after this
_MGET_BYTES = 64 << 20  # read at most this much per round trip on load
_MAX_PARTS = 1 << 20  # more than this in a manifest means it is damaged
# What this tier writes after its prefix and brace: a manifest or a part (the counter is named apart).
# A clear deletes only these: another application's keys that share the prefix are never touched, and
# another tier's longer prefix cannot match ``<prefix>{`` at all (a prefix has no brace).
_OUR_OBJECT = re.compile(rb"\{[0-9a-f]+\}(?::[0-9a-f]+:[0-9]+)?")

# The parts a manifest's meta names (``part_names``), given the orphan TTL by the script that replaces or
# drops that manifest: the client deletes them right after, and if it never gets to (it died, its link
# dropped), they still expire instead of staying forever. Same hash slot as the manifest (the braces).
_EXPIRE_PARTS = """
local function expire_parts(mkey, meta, orphan_ttl)
  if #meta < 20 or string.sub(meta, 1, 4) ~= 'KVV1' then return end
  local nparts = struct.unpack('<I4', meta, 5)
  if nparts > 1048576 then return end
  local gen = (string.gsub(string.sub(meta, 13, 20), '.', function(c) return string.format('%02x', string.byte(c)) end))
  for i = 0, nparts - 1 do redis.call('EXPIRE', mkey .. ':' .. gen .. ':' .. i, orphan_ttl) end
end
"""

# KEYS: manifest, [counter,] parts...; ARGV: manifest value, ttl (0: none), meta length, "1" when KEYS[2]
# is the counter (one server), "0" when it is not (a cluster: the counter lives in another slot), orphan TTL.
# Returns the previous manifest's meta ("" if there was none); errors if a part vanished.
_COMMIT = _EXPIRE_PARTS + """
local ttl = tonumber(ARGV[2])
local counted = ARGV[4] == '1'
local first = counted and 3 or 2
for i = first, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('KVDEPOT part ' .. KEYS[i] .. ' vanished before commit')
  end
end
for i = first, #KEYS do
  if ttl > 0 then redis.call('EXPIRE', KEYS[i], ttl + 60) else redis.call('PERSIST', KEYS[i]) end
end
local old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
if ttl > 0 then redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl) else redis.call('SET', KEYS[1], ARGV[1]) end
if old == '' and counted then redis.call('INCR', KEYS[2]) end
if old ~= '' and old ~= string.sub(ARGV[1], 1, tonumber(ARGV[3])) then expire_parts(KEYS[1], old, tonumber(ARGV[5])) end
return old
"""

# KEYS: manifest, [counter]; ARGV: meta length, expected meta ("" = any), orphan TTL.
# Deletes the manifest (if its meta matches) and returns its meta ("" if nothing was deleted).
_DROP = _EXPIRE_PARTS + """
local old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if old == '' or (ARGV[2] ~= '' and old ~= ARGV[2]) then return '' end
redis.call('DEL', KEYS[1])
if #KEYS > 1 then redis.call('DECR', KEYS[2]) end
expire_parts(KEYS[1], old, tonumber(ARGV[3]))
return old
"""

# KEYS: counter. After a clear: a counter at (or, drifted, below) zero goes, so a cleared tier leaves no key.
_DROP_ZERO = """
if (tonumber(redis.call('GET', KEYS[1]) or '0') or 0) <= 0 then redis.call('DEL', KEYS[1]) end
return 0
"""


INLINE_VALUE_BYTES = 64 << 10  # objects up to this size are stored inside their manifest


URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


class ClusterMode(str, enum.Enum):
    """Whether the server is a Valkey/Redis Cluster: ``auto`` asks it (``INFO cluster``) at the first connection."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ValkeyConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    url: Annotated[str, option(f"the server ({', '.join(URL_SCHEMES)})")] = "redis://127.0.0.1:6379/0"
    prefix: Annotated[str, option("key prefix of this tier's objects (clear removes only these)", min_length=1)] = "kvdepot:"
    max_value_mib: Annotated[int, option("largest value one command carries; bigger objects go as parts", ge=1, le=512)] = 4
    pool_size: Annotated[int, option("pooled connections", ge=1, le=4096)] = 8
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 2
    socket_timeout_s: Annotated[float, option("a hung server fails an operation after this long", gt=0)] = 5.0
    ttl_s: Annotated[int, option("objects expire after this long; 0: they live until deleted or evicted by maxmemory", ge=0)] = 0
    cluster: Annotated[ClusterMode, option("Valkey/Redis Cluster: auto asks the server at the first connection; on or off says so")] = (
        ClusterMode.AUTO
    )

    def _check_together(self) -> None:
        if not self.url.startswith(URL_SCHEMES):
            raise ConfigError(f"url {mask_url(self.url)!r} must start with one of {', '.join(URL_SCHEMES)}")
        problem = _url_problem(self.url)
        if problem:  # the client parses the URL only when it connects: the tier was down for good
            raise ConfigError(f"url {mask_url(self.url)!r} {problem}")
        if "{" in self.prefix or "}" in self.prefix:
            raise ConfigError(f"prefix {self.prefix!r} has a brace: in a cluster it would set every key's hash slot")


def _url_problem(url: str) -> str:
    """What keeps the client from ever using ``url`` ('' if nothing). A password with a '/', '?', '#'
    or '@' that is not percent-encoded ends the URL's address early: the client then read the rest as
    the port (and printed it, the password's first part, in every failure) or dropped it."""
    encode = "(percent-encode a '/', '?', '#' or '@' in a password: urllib.parse.quote(password, safe=''))"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number from 0 to 65535)
    except ValueError:
        return f"does not parse: its port is not a number from 0 to 65535 {encode}"
    if parts.fragment or (parts.scheme != "unix" and not parts.hostname):
        return f"has no host {encode}"
    if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        return "names no database: the path is a database number (redis://HOST:PORT/0)"
    return ""


class ValkeyAdapter(BackendAdapter):
    kind = "valkey"

    def __init__(self, name: str, config: ValkeyConfig, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self._config = config
        self._prefix = config.prefix.encode()
        self._counter = self._prefix + b"#objects"
        self._part_bytes = config.max_value_mib << 20
        self._client: Any = None
        self._commit: Any = None
        self._drop: Any = None
        self._drop_zero: Any = None
        self._in_cluster = False  # known once connected
        self._connect_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ValkeyAdapter({self.name!r}, url={mask_url(self._config.url)!r}, prefix={self._config.prefix!r}, healthy={self._healthy})"

    def _withheld(self) -> tuple[str, ...]:
        try:
            password = urlsplit(self._config.url).password
        except ValueError:
            return ()
        return (password,) if password else ()

    @property
    def in_cluster(self) -> bool:
        """Whether the server is a cluster (False until the first connection)."""
        return self._in_cluster

    @property
    def _valkey(self) -> Any:
        """The client, connected at the first use: a server that is down at start fails that operation
        (the breaker takes it from there), and ``cluster=auto`` needs the server to answer."""
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    self._connect()
                client = self._client
        return client

    def _connect(self) -> None:
        import valkey  # lazily: kvdepot imports without the client installed

        cfg = self._config
        timeouts = {"socket_timeout": cfg.socket_timeout_s, "socket_connect_timeout": cfg.socket_timeout_s, "socket_keepalive": True}
        in_cluster = cfg.cluster is ClusterMode.ON
        if cfg.cluster is ClusterMode.AUTO:
            probe = valkey.Valkey.from_url(cfg.url, **timeouts)
            try:
                in_cluster = self._is_cluster(probe)
            finally:
                probe.close()
        if in_cluster:
            from valkey.cluster import ValkeyCluster

            # The library follows MOVED/ASK and, on a connection error, reloads the topology and tries
            # again a few times: that is what carries an operation across a failover.
            client = ValkeyCluster.from_url(cfg.url, max_connections=cfg.pool_size, **timeouts)
        else:
            pool = valkey.BlockingConnectionPool.from_url(
                cfg.url, max_connections=cfg.pool_size, timeout=cfg.socket_timeout_s, **timeouts
            )  # no retries: a dead server must fail the operation now, so the tier is marked down
            client = valkey.Valkey(connection_pool=pool)
        self._commit = client.register_script(_COMMIT)
        self._drop = client.register_script(_DROP)
        self._drop_zero = client.register_script(_DROP_ZERO)
        self._in_cluster = in_cluster
        self._client = client

    def _is_cluster(self, probe: Any) -> bool:
        """``cluster=auto``: ask ``INFO cluster``; an account that may not run INFO (it is @dangerous, which
        least-privilege ACLs take away) is asked ``CLUSTER INFO``, and one that may run neither is taken
        for a single server (a cluster then answers MOVED: the tier fails, never wrong bytes)."""
        from valkey.exceptions import NoPermissionError, ResponseError

        try:
            return int(probe.info("cluster").get("cluster_enabled", 0)) == 1
        except NoPermissionError:
            pass
        try:
            probe.execute_command("CLUSTER", "INFO")
        except NoPermissionError:
            log.warning("L2 %s: the account may run neither INFO nor CLUSTER INFO, so cluster=auto cannot tell: "
                        "the server is taken for a single one (set cluster=on for a cluster)", self.name)  # fmt: skip
            return False
        except ResponseError:  # "This instance has cluster support disabled"
            return False
        return True

    def _probe(self) -> None:
        """EXISTS of this tier's object counter: the command every lookup sends, on a key under the
        prefix (what a least-privileged ACL user of this tier may touch), sent to the counter's node in a
        cluster. The connection proves the password; a NOPERM refusal is an answer all the same."""
        from valkey.exceptions import NoPermissionError

        try:
            self._valkey.exists(self._counter)
        except NoPermissionError:
            pass

    def _close_backend(self) -> None:
        with self._connect_lock:
            if self._in_cluster and self._client is not None:
                self._client.close()
            elif self._client is not None:
                self._client.connection_pool.disconnect()
            self._client = None

    # --- names ---------------------------------------------------------------------------------------

    def manifest_name(self, key: ObjectKey) -> bytes:
        """``<prefix>{<K>}``: the brace ends the prefix unambiguously (and is the hash tag in a cluster)."""
        return self._prefix + b"{" + key.hex().encode() + b"}"

    def part_names(self, key: ObjectKey, meta: bytes) -> list[bytes]:
        """The part keys a manifest's meta names (empty for an inline object)."""
        _, nparts, _, gen = _META.unpack(meta)
        base = self.manifest_name(key) + b":" + gen.hex().encode() + b":"
        return [base + str(i).encode() for i in range(nparts)]

    # --- primitives ----------------------------------------------------------------------------------

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        client = self._valkey  # connected first: the commit script and the cluster mode come with the client
        data = memoryview(payload).cast("B")
        head = envelope.encode_header(key, data)
        gen = os.urandom(8)
        mkey = self.manifest_name(key)
        ttl = self._config.ttl_s
        # Small values ride in the manifest; larger ones go as plain SETs of parts, since a big EVAL
        # argument costs extra copies inside the server (measured: 2 MiB stores ran at 0.4x raw SET).
        if _META.size + len(head) + data.nbytes <= INLINE_VALUE_BYTES:
            meta = _META.pack(_META_MAGIC, 0, 0, gen)
            parts: list[bytes] = []
            value = b"".join((meta, head, data))
        else:
            nparts = math.ceil(data.nbytes / self._part_bytes)
            meta = _META.pack(_META_MAGIC, nparts, self._part_bytes, gen)
            parts = self.part_names(key, meta)
            value = meta + head
        from valkey.exceptions import OutOfMemoryError, ResponseError  # imported with the client, at start

        try:
            if parts:
                pipe = client.pipeline(transaction=False)
                for i, name in enumerate(parts):
                    pipe.set(name, data[i * self._part_bytes : (i + 1) * self._part_bytes], ex=ORPHAN_TTL_S)
                pipe.execute()
            if self._in_cluster:
                old = self._commit(keys=[mkey, *parts], args=[value, ttl, _META.size, 0, ORPHAN_TTL_S], client=client)
                # Our own meta back (its generation is this store's): the client ran the script again after
                # the reply was lost, and the first run was the one that found no manifest.
                if not old or old == meta:
                    client.incr(self._counter)
            else:
                old = self._commit(keys=[mkey, self._counter, *parts], args=[value, ttl, _META.size, 1, ORPHAN_TTL_S], client=client)
        except OutOfMemoryError as exc:
            # The server is at maxmemory with noeviction (Valkey's default policy): it refuses this
            # object, and it still serves what it holds. Taken for a dead server, it kept the tier down
            # (every push failed again), and the objects already stored could not be loaded either.
            self._forget_parts(parts)
            raise RejectedObject(f"the server is full: {exc}") from None
        except ResponseError as exc:
            if "vanished before commit" not in str(exc):
                raise
            # Valkey evicted a part (a volatile-* maxmemory policy takes keys with a TTL first) or a clear
            # removed it: this object is not stored, and the server is fine.
            raise RejectedObject(str(exc)) from None
        if old and old != meta:
            self._delete_parts(key, old)

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        client = self._valkey
        raw = client.get(self.manifest_name(key))
        if raw is None:
            return False
        meta, nparts, part_bytes = _parse_meta(raw)
        body = memoryview(raw)[_META.size :]
        if nparts == 0:
            envelope.decode_into(key, body, dest)
            return True
        header = envelope.decode_header(body)
        want = envelope.HEADER_BYTES + header.key_len
        if len(body) != want:
            raise CorruptObject(f"manifest has {len(body)} bytes after its meta, expected {want}")
        dst = memoryview(dest).cast("B")
        if dst.nbytes != header.payload_len:
            raise DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
        if nparts != math.ceil(header.payload_len / part_bytes):
            raise CorruptObject(f"manifest names {nparts} parts of {part_bytes} bytes for {header.payload_len}")
        envelope.check_key(key, body[envelope.HEADER_BYTES :])
        names = self.part_names(key, meta)
        per_round = max(1, _MGET_BYTES // part_bytes)
        running = envelope.start_checksum(key)
        pos = 0
        for first in range(0, nparts, per_round):
            for value in client.mget(names[first : first + per_round]):  # one slot: one node, even in a cluster
                if value is None:  # evicted or deleted behind our back: a miss; drop the broken manifest
                    if self._drop_object(key, meta):
                        self._tell_removed((key,), "lost")  # it left through us: a router must not keep it
                    return False
                size = min(part_bytes, header.payload_len - pos)
                if len(value) != size:
                    raise CorruptObject(f"part has {len(value)} bytes, expected {size}")
                envelope.copy_hashed(running, value, dst[pos : pos + size])
                pos += size
        envelope.check_digest(header, running)  # of the bytes as they reached the caller
        return True

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        pipe = self._valkey.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.manifest_name(key))
        return [bool(n) for n in pipe.execute()]

    def _delete(self, key: ObjectKey) -> None:
        self._drop_object(key, b"")

    def _clear(self) -> int:
        """Every key of ours (manifests, parts and the counter) goes; another tier's (whatever its
        prefix), the rest of the server's, or keys of another shape under our prefix are never touched."""
        client = self._valkey
        skip = len(self._prefix)
        manifests: list[bytes] = []
        parts: list[bytes] = []
        removed = 0

        def flush(batch: list[bytes], counted: bool) -> None:
            nonlocal removed
            n = int(client.unlink(*batch))  # split by slot in a cluster (the counts summed)
            if counted and n:
                # Exactly the manifests this clear removed: a store that commits meanwhile counts its own
                # (unlinking the counter instead lost the INCR of a commit that landed after the scan).
                client.decrby(self._counter, n)
                removed += n
            batch.clear()

        for name in self._our_objects():
            batch = parts if b":" in name[skip:] else manifests
            batch.append(name)
            if len(batch) >= 512:
                flush(batch, batch is manifests)
        if manifests:
            flush(manifests, True)
        if parts:
            flush(parts, False)
        self._drop_zero(keys=[self._counter], client=client)
        return removed

    def _our_objects(self) -> Iterator[bytes]:
        """The manifests and parts this tier wrote: ``<prefix>{*`` scanned (on every primary, in a
        cluster), and only names of our shapes kept."""
        skip = len(self._prefix)
        for name in self._valkey.scan_iter(match=_glob_escape(self._prefix) + b"{*", count=1000):
            if _OUR_OBJECT.fullmatch(name, skip):
                yield name

    def _usage(self) -> tuple[int, int, int]:
        """(server used_memory, server maxmemory or 0, manifests under our prefix). Memory figures are
        the whole server's (in a cluster, summed over its primaries); the object count is a counter that
        misses TTL expiry and server-side eviction, so it is reported as 0 (unknown) when ``ttl_s`` is set."""
        if not self._healthy:
            return 0, 0, 0  # never block a status call on a tier that is down
        client = self._valkey
        count = client.get(self._counter)
        if self._in_cluster:
            per_node = client.info("memory", target_nodes=type(client).PRIMARIES)
            infos = list(per_node.values()) if per_node and all(isinstance(v, dict) for v in per_node.values()) else [per_node]
        else:
            infos = [client.info("memory")]
        objects = max(0, int(count or 0)) if self._config.ttl_s == 0 else 0
        return sum(int(i.get("used_memory", 0)) for i in infos), sum(int(i.get("maxmemory", 0)) for i in infos), objects

    # --- helpers -------------------------------------------------------------------------------------

    def _drop_object(self, key: ObjectKey, expected_meta: bytes) -> bool:
        """Delete the manifest first (the object is gone from then on), then its parts. False: there was
        none (or, with ``expected_meta``, a newer store replaced it), and nothing was deleted."""
        client = self._valkey
        if self._in_cluster:
            old = self._drop(keys=[self.manifest_name(key)], args=[_META.size, expected_meta, ORPHAN_TTL_S], client=client)
            if old:
                client.decr(self._counter)
        else:
            old = self._drop(keys=[self.manifest_name(key), self._counter], args=[_META.size, expected_meta, ORPHAN_TTL_S], client=client)
        if old:
            self._delete_parts(key, old)
        return bool(old)

    def _forget_parts(self, names: list[bytes]) -> None:
        """Delete the parts of a store that will not commit (a DEL is allowed at maxmemory), rather than
        leave them filling the server until their orphan TTL; they expire anyway if this fails."""
        try:
            for first in range(0, len(names), 512):
                self._valkey.delete(*names[first : first + 512])
        except Exception:
            pass

    def _delete_parts(self, key: ObjectKey, meta: bytes) -> None:
        try:
            _parse_meta(meta)
        except CorruptObject:
            return  # unreadable meta: its parts cannot be named (if it had any, they are orphaned)
        names = self.part_names(key, meta)
        for first in range(0, len(names), 512):
            self._valkey.delete(*names[first : first + 512])

    def corrupt_for_test(self, key: ObjectKey, offset: int, mask: int = 0xFF) -> None:
        """Flip one byte of the stored envelope (its ``mask`` bits; header + key + payload; ``offset`` counts from its
        start, as in the memory tier), wherever it lives: the manifest or a part."""
        client = self._valkey
        mkey = self.manifest_name(key)
        raw = client.get(mkey)
        if raw is None:
            raise KeyError(key)
        meta, nparts, part_bytes = _parse_meta(raw)
        inline = len(raw) - _META.size
        if nparts == 0 or offset < inline:
            name, at = mkey, _META.size + offset
        else:
            payload_off = offset - inline
            name, at = self.part_names(key, meta)[payload_off // part_bytes], payload_off % part_bytes
        byte = client.getrange(name, at, at)
        if len(byte) != 1:
            raise IndexError(f"offset {offset} is past the object's end")
        client.setrange(name, at, bytes([byte[0] ^ mask]))


def _parse_meta(raw: bytes) -> tuple[bytes, int, int]:
    """(meta bytes, part count, part size) of a manifest; CorruptObject if it is not one."""
    if len(raw) < _META.size:
        raise CorruptObject(f"manifest of {len(raw)} bytes is shorter than its meta")
    meta = bytes(raw[: _META.size])
    magic, nparts, part_bytes, _ = _META.unpack(meta)
    if magic != _META_MAGIC:
        raise CorruptObject(f"bad manifest magic {magic!r}")
    if nparts > _MAX_PARTS or (nparts and part_bytes == 0):
        raise CorruptObject(f"manifest names {nparts} parts of {part_bytes} bytes")
    return meta, nparts, part_bytes


ADAPTER = AdapterType(
    "valkey",
    ValkeyConfig,
    ValkeyAdapter,
    help="Valkey/Redis server; objects above max_value_mib are split into parts behind a manifest",
)


def _glob_escape(prefix: bytes) -> bytes:
    """``prefix`` for a SCAN MATCH pattern: its glob characters taken literally."""
    out = bytearray()
    for b in prefix:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)
