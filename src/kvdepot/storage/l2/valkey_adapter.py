"""``valkey``: an L2 tier on a Valkey (or Redis) server, with large objects split into parts.

Layout, for an object key ``K`` (hex) under ``prefix``::

    <prefix><K>                 manifest: meta (magic, part count, part size, generation) + envelope header
                                + key, and, when the whole object fits in one value, the payload itself
    <prefix><K>:<gen>:<i>       part i of the payload (only when it does not fit), at most max_value_mib
    <prefix>#objects            how many manifests this prefix holds (a counter, for ``usage``)

Why it cannot tear: parts are written first, each under a short orphan TTL; one server-side script then
checks that every part still exists, makes them permanent, and writes the manifest. The manifest is the
commit point, so a reader never finds an object before all its parts exist, and a store that dies half
way leaves only parts that expire on their own. Parts are named by a random generation, so overwriting a
key never mixes an old manifest with new parts; the old generation's parts are deleted after the swap.

A load reads the manifest, then the parts (MGET, a few at a time) into ``dest``, then checks the
checksum over ``dest``. A missing part (evicted by the server's maxmemory policy, or deleted behind our
back) is a miss, and the orphaned manifest is dropped if it is still the same generation. On a miss or
a corrupt object the contents of ``dest`` are unspecified (the caller discards them).

``valkey`` (the Python client) is imported when the adapter starts, so kvdepot imports without it.
Cluster mode is not supported (the commit script touches several keys).
"""

from __future__ import annotations

import math
import os
import struct
from typing import Annotated, Any, ClassVar

from kvdepot.config import ConfigError, ConfigStruct, option
from kvdepot.storage.l2 import envelope
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import AdapterType, TierServices
from kvdepot.storage.l2.envelope import CorruptObject, DestinationMismatch
from kvdepot.types import ObjectKey

_META = struct.Struct("<4sII8s")  # magic, part count (0: payload inline), part size, generation
_META_MAGIC = b"KVV1"
ORPHAN_TTL_S = 600  # parts of a store that never committed expire after this
_MGET_BYTES = 64 << 20  # read at most this much per round trip on load
_MAX_PARTS = 1 << 20  # more than this in a manifest means it is damaged

# KEYS: manifest, counter, parts...; ARGV: manifest value, ttl (0: none), meta length.
# Returns the previous manifest's meta ("" if there was none); errors if a part vanished.
_COMMIT = """
local ttl = tonumber(ARGV[2])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('KVDEPOT part ' .. KEYS[i] .. ' vanished before commit')
  end
end
for i = 3, #KEYS do
  if ttl > 0 then redis.call('EXPIRE', KEYS[i], ttl + 60) else redis.call('PERSIST', KEYS[i]) end
end
local old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
if ttl > 0 then redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl) else redis.call('SET', KEYS[1], ARGV[1]) end
if old == '' then redis.call('INCR', KEYS[2]) end
return old
"""

# KEYS: manifest, counter; ARGV: meta length, expected meta ("" = any).
# Deletes the manifest (if its meta matches) and returns its meta ("" if nothing was deleted).
_DROP = """
local old = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if old == '' or (ARGV[2] ~= '' and old ~= ARGV[2]) then return '' end
redis.call('DEL', KEYS[1])
redis.call('DECR', KEYS[2])
return old
"""


INLINE_VALUE_BYTES = 64 << 10  # objects up to this size are stored inside their manifest


URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


class ValkeyConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    url: Annotated[str, option(f"the server ({', '.join(URL_SCHEMES)})")] = "redis://127.0.0.1:6379/0"
    prefix: Annotated[str, option("key prefix of this tier's objects (clear removes only these)", min_length=1)] = "kvdepot:"
    max_value_mib: Annotated[int, option("largest value one command carries; bigger objects go as parts", ge=1, le=512)] = 4
    pool_size: Annotated[int, option("pooled connections", ge=1, le=4096)] = 8
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 2
    socket_timeout_s: Annotated[float, option("a hung server fails an operation after this long", gt=0)] = 5.0
    ttl_s: Annotated[int, option("objects expire after this long; 0: they live until deleted or evicted by maxmemory", ge=0)] = 0

    def _check_together(self) -> None:
        if not self.url.startswith(URL_SCHEMES):
            raise ConfigError(f"url {self.url!r} must start with one of {', '.join(URL_SCHEMES)}")


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

    def __repr__(self) -> str:
        return f"ValkeyAdapter({self.name!r}, url={self._config.url!r}, prefix={self._config.prefix!r}, healthy={self._healthy})"

    def start(self) -> None:
        import valkey  # lazily: kvdepot imports without the client installed

        cfg = self._config
        pool = valkey.BlockingConnectionPool.from_url(
            cfg.url,
            max_connections=cfg.pool_size,
            timeout=cfg.socket_timeout_s,  # waiting for a free pooled connection
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.socket_timeout_s,
            socket_keepalive=True,
        )  # no retries: a dead server must fail the operation now, so the tier is marked down
        self._client = valkey.Valkey(connection_pool=pool)
        self._commit = self._client.register_script(_COMMIT)
        self._drop = self._client.register_script(_DROP)
        super().start()

    def _close_backend(self) -> None:
        if self._client is not None:
            self._client.connection_pool.disconnect()
            self._client = None

    # --- names ---------------------------------------------------------------------------------------

    def manifest_name(self, key: ObjectKey) -> bytes:
        return self._prefix + key.hex().encode()

    def part_names(self, key: ObjectKey, meta: bytes) -> list[bytes]:
        """The part keys a manifest's meta names (empty for an inline object)."""
        _, nparts, _, gen = _META.unpack(meta)
        base = self.manifest_name(key) + b":" + gen.hex().encode() + b":"
        return [base + str(i).encode() for i in range(nparts)]

    # --- primitives ----------------------------------------------------------------------------------

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
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
            pipe = self._client.pipeline(transaction=False)
            for i, name in enumerate(parts):
                pipe.set(name, data[i * self._part_bytes : (i + 1) * self._part_bytes], ex=ORPHAN_TTL_S)
            pipe.execute()
            value = meta + head
        old = self._commit(keys=[mkey, self._counter, *parts], args=[value, ttl, _META.size])
        if old and old != meta:
            self._delete_parts(key, old)

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        raw = self._client.get(self.manifest_name(key))
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
        names = self.part_names(key, meta)
        per_round = max(1, _MGET_BYTES // part_bytes)
        pos = 0
        for first in range(0, nparts, per_round):
            for value in self._client.mget(names[first : first + per_round]):
                if value is None:  # evicted or deleted behind our back: a miss; drop the broken manifest
                    self._drop_object(key, meta)
                    return False
                size = min(part_bytes, header.payload_len - pos)
                if len(value) != size:
                    raise CorruptObject(f"part has {len(value)} bytes, expected {size}")
                dst[pos : pos + size] = value
                pos += size
        envelope.verify(key, header, body[envelope.HEADER_BYTES :], dst)
        return True

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.manifest_name(key))
        return [bool(n) for n in pipe.execute()]

    def _delete(self, key: ObjectKey) -> None:
        self._drop_object(key, b"")

    def _clear(self) -> int:
        """Every key under our prefix (manifests, parts and the counter) goes; another prefix's keys,
        or the rest of the server's, are never touched."""
        count = int(self._client.get(self._counter) or 0)
        batch: list[bytes] = []
        for name in self._client.scan_iter(match=_glob_escape(self._prefix) + b"*", count=1000):
            batch.append(name)
            if len(batch) >= 512:
                self._client.unlink(*batch)
                batch.clear()
        if batch:
            self._client.unlink(*batch)
        return max(0, count)

    def _usage(self) -> tuple[int, int, int]:
        """(server used_memory, server maxmemory or 0, manifests under our prefix). Memory figures are
        the whole server's; the object count is a counter that misses TTL expiry and server-side
        eviction, so it is reported as 0 (unknown) when ``ttl_s`` is set."""
        if self._client is None or not self._healthy:
            return 0, 0, 0  # never block a status call on a tier that is down
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._counter)
        pipe.info("memory")
        count, info = pipe.execute()
        objects = max(0, int(count or 0)) if self._config.ttl_s == 0 else 0
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), objects

    # --- helpers -------------------------------------------------------------------------------------

    def _drop_object(self, key: ObjectKey, expected_meta: bytes) -> None:
        """Delete the manifest first (the object is gone from then on), then its parts."""
        old = self._drop(keys=[self.manifest_name(key), self._counter], args=[_META.size, expected_meta])
        if old:
            self._delete_parts(key, old)

    def _delete_parts(self, key: ObjectKey, meta: bytes) -> None:
        try:
            _parse_meta(meta)
        except CorruptObject:
            return  # unreadable meta: its parts cannot be named (if it had any, they are orphaned)
        names = self.part_names(key, meta)
        for first in range(0, len(names), 512):
            self._client.delete(*names[first : first + 512])

    def corrupt_for_test(self, key: ObjectKey, offset: int) -> None:
        """Flip one byte of the stored envelope (header + key + payload; ``offset`` counts from its
        start, as in the memory tier), wherever it lives: the manifest or a part."""
        mkey = self.manifest_name(key)
        raw = self._client.get(mkey)
        if raw is None:
            raise KeyError(key)
        meta, nparts, part_bytes = _parse_meta(raw)
        inline = len(raw) - _META.size
        if nparts == 0 or offset < inline:
            name, at = mkey, _META.size + offset
        else:
            payload_off = offset - inline
            name, at = self.part_names(key, meta)[payload_off // part_bytes], payload_off % part_bytes
        byte = self._client.getrange(name, at, at)
        if len(byte) != 1:
            raise IndexError(f"offset {offset} is past the object's end")
        self._client.setrange(name, at, bytes([byte[0] ^ 0xFF]))


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
