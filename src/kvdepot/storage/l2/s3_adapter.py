"""``s3``: an L2 tier on an S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

Each object is one S3 object ``<prefix><key hex>`` holding the envelope (header, key, payload). A PUT
is atomic in S3, so a failed store is never visible. Objects above ``multipart_threshold_mib`` go up as a
multipart upload, completed only after every part succeeded and aborted on any failure, so a half
upload is never visible either. A load streams the body straight into ``dest`` (``readinto``) and then
checks the checksum; on a miss or a corrupt object the contents of ``dest`` are unspecified.

Credentials come from the config, else from wherever boto3 finds them (environment, shared files,
instance metadata). ``boto3`` is imported when the adapter starts, so kvdepot imports without it.
"""

from __future__ import annotations

import io
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
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

MIN_PART_MIB = 5  # S3's smallest multipart part (all but the last)
MAX_PARTS = 10_000  # S3's most parts in one upload
_MISSING = {"404", "NoSuchKey", "NotFound"}
_BUCKET_EXISTS = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}
_PROBE_ANSWERS = {"AccessDenied", "InvalidRange"}  # the store and the credentials work (see ``_probe``)
_READ_PIECE = 4 << 20
RECOUNT_S = 60.0  # a usage listing longer than one page is taken again at most this often ...
RECOUNT_S_PER_PAGE = 0.5  # ... and no more often than this per page of it
# The only names this tier writes after its prefix. A clear deletes, and the usage counts, only these: an
# empty prefix, or one without a trailing "/" ("kvdepot" also lists "kvdepot-backups/..."), must never
# make a clear delete another application's objects in a shared bucket.
_OUR_NAME = re.compile(r"(?:[0-9a-f]{2})+")
# Our names have no "/" after the prefix, so listings ask S3 to fold every deeper name into one common
# prefix: another tier's objects under a prefix that nests in ours (``kv/`` and ``kv/staging/``, servers
# sharing a bucket) neither make the usage and a clear page through them nor make a usage of one page of
# ours a count of many (taken again only every minute, stale meanwhile).
_HEX_DIGITS = frozenset("0123456789abcdef")
_BUCKET_NAME = re.compile(r"[a-zA-Z0-9.\-_]{1,255}\Z")  # what botocore lets through to the server


class S3Config(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    bucket: Annotated[str, option("the bucket", min_length=1)]
    prefix: Annotated[str, option("key prefix of this tier's objects (clear removes only these)")] = "kvdepot/"
    endpoint_url: Annotated[str, option("an S3-compatible endpoint (http:// or https://); empty: AWS")] = ""
    region: Annotated[str, option("the region")] = "us-east-1"
    access_key_id: Annotated[str, option("empty: boto3's usual places (environment, files, instance metadata)")] = ""
    secret_access_key: Annotated[str, option("given with access_key_id, or neither")] = ""
    multipart_threshold_mib: Annotated[int, option("objects above this go up as multipart uploads", ge=1)] = 64
    part_size_mib: Annotated[int, option("multipart part size (S3's smallest and largest part bound it)", ge=MIN_PART_MIB, le=5120)] = 16
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 4
    create_bucket: Annotated[bool, option("create the bucket if it does not exist")] = False
    connect_timeout_s: Annotated[float, option("connection timeout", gt=0)] = 5.0
    read_timeout_s: Annotated[float, option("read timeout", gt=0)] = 30.0
    max_attempts: Annotated[int, option("total tries per request (boto3's standard retries)", ge=1, le=20)] = 2

    def _check_together(self) -> None:
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ConfigError("give both access_key_id and secret_access_key, or neither")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise ConfigError(f"endpoint_url {self.endpoint_url!r} must start with http:// or https://")
        # botocore checks both only on each request: the tier started, then failed every one for good
        if self.endpoint_url and not _has_host_and_port(self.endpoint_url):
            raise ConfigError(f"endpoint_url {mask_url(self.endpoint_url)!r} is not http(s)://HOST[:PORT] (a port from 0 to 65535)")
        if not (_BUCKET_NAME.match(self.bucket) or self.bucket.startswith("arn:")):
            raise ConfigError(f"bucket {self.bucket!r} is not a bucket name (letters, digits, '.', '-' and '_'; or an access point ARN)")
        if self.prefix[-1:] in _HEX_DIGITS:
            # This tier's names are <prefix><key hex>: a prefix ending in a hex digit makes its names look
            # like those of a tier whose prefix is shorter by those digits, whose clear would delete them.
            raise ConfigError(f"prefix {self.prefix!r} ends with a hex digit; end it with another character, such as '/'")


def _has_host_and_port(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number from 0 to 65535)
    except ValueError:
        return False
    return bool(parts.hostname)


class S3Adapter(BackendAdapter):
    kind = "s3"
    LIST_PAGE = 1000  # objects per listing page (S3's most)

    def __init__(self, name: str, config: S3Config, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self._config = config
        self._client: Any = None
        self._fanout: ThreadPoolExecutor | None = None  # HEADs and multipart parts, in parallel
        self._bucket_ready = not config.create_bucket
        self._counted: tuple[int, int, int] | None = None  # the last count of a listing longer than a page
        self._recount_at = 0.0
        self._clears = (0, 0)  # clears begun, clears ended (under _lock): a usage listing that met one is not kept

    def __repr__(self) -> str:
        where = mask_url(self._config.endpoint_url) if self._config.endpoint_url else "aws"
        return f"S3Adapter({self.name!r}, s3://{self._config.bucket}/{self._config.prefix} at {where}, healthy={self._healthy})"

    def _withheld(self) -> tuple[str, ...]:
        cfg = self._config
        password = urlsplit(cfg.endpoint_url).password if cfg.endpoint_url else None
        return tuple(s for s in (password, cfg.secret_access_key) if s)

    def start(self) -> None:
        import boto3  # lazily: kvdepot imports without it
        from botocore.config import Config

        cfg = self._config
        fanout = max(4, cfg.workers)
        options: dict[str, Any] = {
            "region_name": cfg.region,
            "config": Config(
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},
                max_pool_connections=cfg.workers * fanout + 2,
                # the envelope carries our own checksum; skip botocore's extra CRC pass on every byte
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"addressing_style": "path"} if cfg.endpoint_url else {},
            ),
        }
        if cfg.endpoint_url:
            options["endpoint_url"] = cfg.endpoint_url
        if cfg.access_key_id:
            options["aws_access_key_id"] = cfg.access_key_id
            options["aws_secret_access_key"] = cfg.secret_access_key
        self._client = boto3.session.Session().client("s3", **options)
        self._fanout = ThreadPoolExecutor(fanout, thread_name_prefix=f"kvdepot-l2-{self.name}-fanout")
        super().start()

    def _probe(self) -> None:
        """A GET of one byte of a name under the prefix that is never an object of ours (not hex): S3
        answers it with an error body, so a missing bucket and bad credentials are told apart from the
        missing object (its usual answer) and from AccessDenied (an account without ListBucket gets that
        for any missing object): both prove the store and the credentials work. A bucket ``create_bucket``
        has not made yet is no fault: the first store makes it."""
        try:
            self._client.get_object(Bucket=self._config.bucket, Key=f"{self._config.prefix}kvdepot-probe", Range="bytes=0-0")["Body"].close()
        except Exception as exc:
            code = _error_code(exc)
            if code in _MISSING or code in _PROBE_ANSWERS:
                return
            if code == "NoSuchBucket" and self._config.create_bucket:
                self._bucket_ready = False
                return
            raise

    def _close_backend(self) -> None:
        if self._fanout is not None:
            self._fanout.shutdown(wait=True, cancel_futures=True)
            self._fanout = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def object_name(self, key: ObjectKey) -> str:
        return self._config.prefix + key.hex()

    # --- primitives ----------------------------------------------------------------------------------

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        self._ensure_bucket()
        data = memoryview(payload).cast("B")
        head = memoryview(envelope.encode_header(key, data))
        total = head.nbytes + data.nbytes
        name = self.object_name(key)
        if total <= self._config.multipart_threshold_mib << 20:
            body = _Concat([head, data], 0, total)
            self._client.put_object(Bucket=self._config.bucket, Key=name, Body=body, ContentLength=total)
            return
        part_bytes = max(self._config.part_size_mib << 20, math.ceil(total / MAX_PARTS))
        try:
            self._put_multipart(name, [head, data], total, part_bytes)
        except Exception as exc:
            if _error_code(exc) != "NoSuchUpload":
                raise
            # A clear (this server's, or another's on the same prefix) aborted the upload: this object
            # is not stored, and the store is fine (as Valkey's part that a clear removed).
            raise RejectedObject(f"its multipart upload was aborted meanwhile: {exc}") from None

    def _put_multipart(self, name: str, segments: list[memoryview], total: int, part_bytes: int) -> None:
        bucket = self._config.bucket
        upload_id = self._client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]

        def send(number: int) -> dict[str, Any]:
            start = (number - 1) * part_bytes
            end = min(start + part_bytes, total)
            resp = self._client.upload_part(
                Bucket=bucket,
                Key=name,
                UploadId=upload_id,
                PartNumber=number,
                Body=_Concat(segments, start, end),
                ContentLength=end - start,
            )
            return {"ETag": resp["ETag"], "PartNumber": number}

        try:
            assert self._fanout is not None
            parts = list(self._fanout.map(send, range(1, math.ceil(total / part_bytes) + 1)))
            self._client.complete_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            try:  # nothing becomes visible; the parts already sent are discarded
                self._client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id)
            except Exception as exc:
                log.warning("s3 tier %s: could not abort upload %s of %s: %s", self.name, upload_id, name, exc)
            raise

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        self._ensure_bucket()
        try:
            resp = self._client.get_object(Bucket=self._config.bucket, Key=self.object_name(key))
        except Exception as exc:
            if _error_code(exc) in _MISSING:
                return False
            raise
        body = resp["Body"]
        try:
            head = _read_exactly(body, envelope.HEADER_BYTES)
            header = envelope.decode_header(head)
            if resp.get("ContentLength", header.total) != header.total:
                raise CorruptObject(f"object has {resp['ContentLength']} bytes, header says {header.total}")
            stored_key = _read_exactly(body, header.key_len)
            dst = memoryview(dest).cast("B")
            if dst.nbytes != header.payload_len:
                raise DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
            _read_into(body, dst)
        finally:
            body.close()
        envelope.verify(key, header, stored_key, dst)
        return True

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        self._ensure_bucket()
        if len(keys) == 1 or self._fanout is None:
            return [self._head(k) for k in keys]
        return list(self._fanout.map(self._head, keys))

    def _delete(self, key: ObjectKey) -> None:
        self._ensure_bucket()
        self._client.delete_object(Bucket=self._config.bucket, Key=self.object_name(key))

    def _clear(self) -> int:
        """Every object of ours under our prefix (``_OUR_NAME``), listed and deleted a thousand at a time."""
        with self._lock:
            begun, ended = self._clears
            self._clears = (begun + 1, ended)
            self._counted = None  # counted afresh at the next usage: a big tier's count is not shown after its clear
        try:
            return self._clear_ours()
        finally:
            with self._lock:
                begun, ended = self._clears
                self._clears = (begun, ended + 1)

    def _clear_ours(self) -> int:
        self._ensure_bucket()
        bucket, removed, failed = self._config.bucket, 0, []
        skip = len(self._config.prefix)
        gone: list[ObjectKey] = []  # what went, told as removed if the clear as a whole fails (no TierCleared then)
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=self._config.prefix, Delimiter="/"):
                names = [{"Key": o["Key"]} for o in self._ours(page)]
                if names:
                    # Quiet: the answer lists only the objects that could not be deleted (and is a 200 all the same)
                    errors = self._client.delete_objects(Bucket=bucket, Delete={"Objects": names, "Quiet": True}).get("Errors") or []
                    removed += len(names) - len(errors)
                    failed += errors
                    stuck = {e.get("Key") for e in errors}
                    gone += [ObjectKey(bytes.fromhex(n["Key"][skip:])) for n in names if n["Key"] not in stuck]
        except BaseException:
            self._tell_removed(gone, "deleted")
            raise
        try:
            self._abort_uploads()
        except Exception as exc:  # housekeeping on top of the clear: credentials may not list or abort uploads
            log.warning("L2 %s (s3): the clear could not abort unfinished multipart uploads under %s: %s",
                        self.name, self._config.prefix, self._error_text(exc))  # fmt: skip
        if failed:
            self._tell_removed(gone, "deleted")  # announced blocks that did go must not stay announced
            first = failed[0]
            raise RuntimeError(f"s3 tier {self.name}: the clear could not delete {len(failed)} objects "
                               f"(first: {first.get('Key')}: {first.get('Code')} {first.get('Message', '')})")  # fmt: skip
        return removed

    def _abort_uploads(self) -> None:
        """Abort the multipart uploads of our names under the prefix: a server killed during one leaves
        its parts stored (and billed) for good otherwise, never listed as objects, never counted. One
        still running (a store from before this clear, here or on another server sharing the prefix)
        then fails as a refused object (``_put``), not as a backend failure."""
        bucket, skip = self._config.bucket, len(self._config.prefix)
        for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=self._config.prefix):
            for upload in page.get("Uploads", []) or []:
                if not _OUR_NAME.fullmatch(upload["Key"], skip):
                    continue
                try:
                    self._client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                except Exception as exc:
                    if _error_code(exc) != "NoSuchUpload":  # completed or aborted meanwhile
                        raise

    def _usage(self) -> tuple[int, int, int]:
        """A listing under the prefix (S3 has no cheap count): exact at every call while it is one page
        (up to 1000 objects); a longer one is taken again only ``RECOUNT_S`` later, or half a second per
        page (a million objects: every 8 minutes), its figures shown meanwhile. (Past one page the usage
        read 0: a dashboard saw the tier emptied as it grew.) Nothing is asked of a tier that is down. A
        bucket that ``create_bucket`` has not made yet is listed too: other servers sharing it (or this
        one before a restart) may have filled it, and skipping it showed such a tier empty until this
        server's first request."""
        if self._client is None or not self._healthy:
            return 0, 0, 0
        if self._counted is not None and time.monotonic() < self._recount_at:
            return self._counted
        with self._lock:
            clears = self._clears
        used = objects = pages = 0
        listing = self._client.get_paginator("list_objects_v2")
        try:
            for page in listing.paginate(Bucket=self._config.bucket, Prefix=self._config.prefix, Delimiter="/",
                                         PaginationConfig={"PageSize": self.LIST_PAGE}):  # fmt: skip
                pages += 1
                contents = self._ours(page)
                used += sum(int(o.get("Size", 0)) for o in contents)
                objects += len(contents)
        except Exception as exc:
            if not self._bucket_ready and _error_code(exc) == "NoSuchBucket":
                return 0, 0, 0  # not made yet: the first store makes it
            raise
        figures = (used, 0, objects)
        with self._lock:
            # Kept only when no clear ran during the listing: pages read before one would be shown as the
            # emptied tier's count until the next recount (minutes, for a big tier).
            if clears == self._clears and clears[0] == clears[1]:
                self._counted = figures
                self._recount_at = time.monotonic() + (0.0 if pages <= 1 else max(RECOUNT_S, RECOUNT_S_PER_PAGE * pages))
        return figures

    # --- helpers -------------------------------------------------------------------------------------

    def _ours(self, listing: dict) -> list[dict]:
        """The listed objects this tier wrote (a key's hex right after the prefix)."""
        skip = len(self._config.prefix)
        return [o for o in listing.get("Contents", []) if _OUR_NAME.fullmatch(o["Key"], skip)]

    def _head(self, key: ObjectKey) -> bool:
        try:
            self._client.head_object(Bucket=self._config.bucket, Key=self.object_name(key))
        except Exception as exc:
            if _error_code(exc) in _MISSING:
                return False
            raise
        return True

    def _mark_down(self, exc: Exception, counted: bool = True) -> None:
        # With create_bucket, the bucket may be what went (deleted while the tier ran: S3 answers
        # NoSuchBucket, or, as SeaweedFS does for a PUT, AccessDenied): the probe that follows makes sure
        # of it again (an existing bucket costs that probe one CreateBucket). Made only at the first use,
        # a bucket deleted later kept the tier down for good.
        if self._config.create_bucket:
            self._bucket_ready = False
        super()._mark_down(exc, counted)

    def _ensure_bucket(self) -> None:
        """With ``create_bucket``, create it on first use (not in ``start``: the store may be down then)."""
        if self._bucket_ready:
            return
        try:
            kwargs: dict[str, Any] = {"Bucket": self._config.bucket}
            if self._config.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self._config.region}
            self._client.create_bucket(**kwargs)
        except Exception as exc:
            if _error_code(exc) not in _BUCKET_EXISTS:
                raise
        self._bucket_ready = True

    def corrupt_for_test(self, key: ObjectKey, offset: int, mask: int = 0xFF) -> None:
        """Flip one byte of the stored object (its ``mask`` bits; ``offset`` from the start of the envelope)."""
        name = self.object_name(key)
        blob = bytearray(self._client.get_object(Bucket=self._config.bucket, Key=name)["Body"].read())
        blob[offset] ^= mask
        self._client.put_object(Bucket=self._config.bucket, Key=name, Body=bytes(blob))


class _Concat(io.RawIOBase):
    """A seekable, read-only file over ``[start, end)`` of several buffers laid end to end, so a body
    is sent without first being copied into one bytes object (botocore seeks back on a retry)."""

    def __init__(self, segments: list[memoryview], start: int, end: int) -> None:
        super().__init__()
        self._segments = segments
        self._start = start
        self._len = end - start
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = min(max(0, base + offset), self._len)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        want = min(out.nbytes, self._len - self._pos)
        done = 0
        at = self._start + self._pos  # absolute offset into the concatenation
        for seg in self._segments:
            if done == want:
                break
            if at >= seg.nbytes:
                at -= seg.nbytes
                continue
            n = min(seg.nbytes - at, want - done)
            out[done : done + n] = seg[at : at + n]
            done += n
            at = 0
        self._pos += done
        return done

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._len - self._pos
        buf = bytearray(min(size, self._len - self._pos))
        n = self.readinto(buf)
        return bytes(buf[:n])


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _read_exactly(body: Any, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(body, memoryview(buf))
    return bytes(buf)


def _read_into(body: Any, dst: memoryview) -> None:
    """Fill ``dst`` from the response body, a piece at a time (urllib3's readinto reads into a temporary
    of the piece's size first, so whole-object pieces would double the memory); an object shorter than
    it promised is corrupt."""
    pos = 0
    while pos < dst.nbytes:
        n = body.readinto(dst[pos : pos + _READ_PIECE])
        if not n:
            raise CorruptObject(f"object ended after {pos} of {dst.nbytes} expected bytes")
        pos += n


ADAPTER = AdapterType(
    "s3",
    S3Config,
    S3Adapter,
    help="S3-compatible object store (one object per chunk; multipart above the threshold)",
)
