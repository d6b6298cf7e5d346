"""What only the remote tiers have: Valkey's split values and commit point, S3's multipart uploads, and
both tiers going down with their server and coming back on their own. Real servers on loopback (``support.backends``,
fixtures in ``support.plugin``); the shared contract suite covers everything every adapter must do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvdepot.errors import ConfigError
from kvdepot.events import TierCleared, TierRemoved
from kvdepot.storage.l2 import registry
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import TaskResult, TierServices
from kvdepot.storage.l2.s3_adapter import S3Adapter, S3Config
from kvdepot.storage.l2.valkey_adapter import ORPHAN_TTL_S, ValkeyAdapter, ValkeyConfig

from support.adapter_tasks import EventRecorder, load, run, store
from support.backends import ValkeyServer, WeedServer, s3_config, valkey_config
from support.servers import never, pause, wait_until

MiB = 1 << 20
RETRY_WAIT_S = 10.0  # the adapters probe a down tier every 2 s; allow a few probes


def lookup(adapter: BackendAdapter, keys: list[bytes]) -> TaskResult:
    result = run(adapter, adapter.submit_lookup_and_lock(keys))
    if result.value:
        run(adapter, adapter.submit_unlock(keys[: result.value]))
    return result


def new_key() -> bytes:
    return os.urandom(48)


def wait_until_serving(adapter: BackendAdapter, key: bytes, value: bytes) -> float:
    """Store until one succeeds (the adapter probes again after its retry interval); seconds taken."""
    start = time.monotonic()
    while time.monotonic() - start < RETRY_WAIT_S:
        if store(adapter, key, value).ok:
            return time.monotonic() - start
        time.sleep(0.1)
    pytest.fail(f"{adapter!r} did not recover within {RETRY_WAIT_S}s: {adapter.usage().last_error}")


# --- configuration (no server) -------------------------------------------------------------------------


def test_tiers_are_registered_and_parse_from_the_command_line() -> None:
    spec = registry.parse_spec("valkey:url=redis://127.0.0.1:6380/2,max_value_mib=8,ttl_s=60")
    assert spec.type == "valkey" and spec.name == "valkey0"
    assert spec.config == ValkeyConfig(url="redis://127.0.0.1:6380/2", max_value_mib=8, ttl_s=60)
    spec = registry.parse_spec('{"type": "s3", "name": "cold", "bucket": "kv", "create_bucket": true}', 1)
    assert (spec.name, spec.config) == ("cold", S3Config(bucket="kv", create_bucket=True))
    with pytest.raises(ValueError, match="bucket"):
        registry.parse_spec("s3:prefix=x/")
    with pytest.raises(ValueError, match="nope"):
        registry.parse_spec("valkey:nope=1")


def test_bad_values_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="max_value_mib"):
        ValkeyAdapter("v", ValkeyConfig(max_value_mib=0))
    with pytest.raises(ValueError, match="part_size_mib"):
        S3Adapter("s", S3Config(bucket="kv", part_size_mib=4))
    with pytest.raises(ValueError, match="secret"):
        S3Adapter("s", S3Config(bucket="kv", access_key_id="only-half"))


def test_kvdepot_imports_without_the_backend_clients() -> None:
    code = (
        "import sys; from kvdepot.storage.l2 import registry; types = registry.adapter_types(); "
        "assert {'valkey', 's3'} <= set(types), types; "
        "loaded = {'valkey', 'boto3', 'botocore'} & set(sys.modules); assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- Valkey ----------------------------------------------------------------------------------------


@pytest.fixture
def raw_valkey(valkey_server: ValkeyServer):
    import valkey

    client = valkey.Valkey.from_url(valkey_server.url)
    yield client
    client.close()


def stored_names(client, adapter: ValkeyAdapter, key: bytes) -> list[bytes]:
    return sorted(client.keys(adapter.manifest_name(key) + b"*"))


def test_valkey_splits_a_large_value_behind_a_manifest(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("split", max_value_mib=1)
    adapter.start()
    key, value = new_key(), os.urandom(2 * MiB + 12345)
    assert store(adapter, key, value).value == [True]

    manifest = adapter.manifest_name(key)
    parts = [n for n in stored_names(raw_valkey, adapter, key) if n != manifest]
    assert len(parts) == 3
    assert raw_valkey.strlen(manifest) < 200  # meta + header + key: the payload is all in parts
    assert sorted(raw_valkey.strlen(p) for p in parts) == [12345, MiB, MiB]
    assert all(raw_valkey.ttl(p) == -1 for p in parts)  # made permanent by the commit
    result, got = load(adapter, key, len(value))
    assert result.value == [True] and got == value
    assert adapter.usage().objects == 1


def test_valkey_clear_leaves_keys_it_did_not_write_under_its_prefix(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("shared", max_value_mib=1)
    adapter.start()
    prefix = adapter._config.prefix
    foreign = [f"{prefix}notes", f"{prefix}session:42", f"{prefix}{{user}}", f"{prefix}x#objects"]
    for name in foreign:
        raw_valkey.set(name, b"not kvdepot's")
    keys = [new_key() for _ in range(3)]
    assert all(store(adapter, k, os.urandom(n)).ok for k, n in zip(keys, (100, 2 * MiB + 7, 5000)))  # one in parts
    assert run(adapter, adapter.submit_clear()).ok
    assert lookup(adapter, keys).value == 0
    assert sorted(n.decode() for n in raw_valkey.scan_iter(match=f"{prefix}*")) == sorted(foreign)


def test_valkey_keeps_a_small_value_in_its_manifest(valkey_adapter_factory, raw_valkey) -> None:
    from kvdepot.storage.l2.valkey_adapter import INLINE_VALUE_BYTES

    adapter = valkey_adapter_factory("inline", max_value_mib=1)
    adapter.start()
    key, value = new_key(), os.urandom(INLINE_VALUE_BYTES // 2)
    assert store(adapter, key, value).ok
    assert stored_names(raw_valkey, adapter, key) == [adapter.manifest_name(key)]
    big = new_key()  # above the inline size: one plain part behind the manifest
    assert store(adapter, big, os.urandom(2 * INLINE_VALUE_BYTES)).ok
    assert len(stored_names(raw_valkey, adapter, big)) == 2
    result, got = load(adapter, key, len(value))
    assert result.value == [True] and got == value


def test_valkey_missing_part_is_a_miss_not_bad_data(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("holes", max_value_mib=1)
    adapter.start()
    key, value = new_key(), os.urandom(3 * MiB)
    assert store(adapter, key, value).ok
    manifest = adapter.manifest_name(key)
    parts = [n for n in stored_names(raw_valkey, adapter, key) if n != manifest]
    raw_valkey.delete(parts[1])  # evicted, or deleted behind the adapter's back

    result, _ = load(adapter, key, len(value))
    assert result.ok and result.value == [False]
    usage = adapter.usage()
    assert (usage.corrupt, usage.loaded, usage.healthy) == (0, 0, True)
    assert lookup(adapter, [key]).value == 0  # the broken manifest was dropped ...
    assert stored_names(raw_valkey, adapter, key) == []  # ... and its remaining parts with it
    assert usage.objects == 0


def test_a_valkey_object_dropped_for_a_missing_part_is_told_removed(valkey_server, raw_valkey) -> None:
    """Under the allkeys-lru policy README recommends, Valkey may evict one part of an object and keep its
    manifest: the load that finds the hole drops the manifest, so the object left the tier through
    kvdepot, and KV events must say so (a router kept the block for good: no later event names it)."""
    sink = EventRecorder()
    adapter = ValkeyAdapter("holes-told", valkey_config(valkey_server.url, max_value_mib=1), TierServices(sink=sink))
    adapter.start()
    try:
        key, value = new_key(), os.urandom(3 * MiB)
        assert store(adapter, key, value).ok
        manifest = adapter.manifest_name(key)
        raw_valkey.delete([n for n in stored_names(raw_valkey, adapter, key) if n != manifest][1])
        result, _ = load(adapter, key, len(value))
        assert result.ok and result.value == [False]
        assert stored_names(raw_valkey, adapter, key) == []  # the manifest went
        assert [e.keys for e in sink.events if isinstance(e, TierRemoved)] == [(key,)]
    finally:
        adapter.close()


def test_valkey_store_that_fails_before_its_commit_is_invisible(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("torn", max_value_mib=1)
    adapter.start()
    assert lookup(adapter, [new_key()]).value == 0  # connected: its scripts are registered

    def crash(*args, **kwargs):
        raise ConnectionError("died between the parts and the manifest")

    adapter._commit = crash  # the parts are written; the commit point never comes
    key, value = new_key(), os.urandom(2 * MiB)
    assert store(adapter, key, value).ok is False
    names = stored_names(raw_valkey, adapter, key)
    assert len(names) == 2 and adapter.manifest_name(key) not in names
    assert all(0 < raw_valkey.ttl(n) <= ORPHAN_TTL_S for n in names)  # orphans expire on their own
    assert lookup(adapter, [key]).value == 0
    result, _ = load(adapter, key, len(value))
    assert result.value == [False]


def test_valkey_part_evicted_before_its_commit_fails_that_object_alone(valkey_adapter_factory, raw_valkey) -> None:
    """A part gone between its SET and the commit (Valkey's volatile-* eviction takes keys with a TTL
    first; a clear's SCAN): that one object is not stored. It used to count as a backend failure that
    took the whole tier down, and the rest of the batch with it."""
    adapter = valkey_adapter_factory("vanishing", max_value_mib=1)
    adapter.start()
    assert lookup(adapter, [new_key()]).value == 0  # connected: its scripts are registered
    real_commit = adapter._commit

    def commit_after_an_eviction(*, keys, args, client):
        raw_valkey.delete(keys[-1])  # a part
        return real_commit(keys=keys, args=args, client=client)

    adapter._commit = commit_after_an_eviction
    key, value = new_key(), os.urandom(2 * MiB)
    result = store(adapter, key, value)
    assert result.ok and result.value == [False], result
    usage = adapter.usage()
    assert (usage.healthy, usage.failures, usage.objects) == (True, 0, 0)
    assert lookup(adapter, [key]).value == 0
    adapter._commit = real_commit
    other, again = new_key(), os.urandom(2 * MiB)
    assert store(adapter, other, again).value == [True]
    result, got = load(adapter, other, len(again))
    assert result.value == [True] and got == again


def test_valkey_overwrite_swaps_generations_and_drops_the_old_parts(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("overwrite", max_value_mib=1)
    adapter.start()
    key, first, second = new_key(), os.urandom(3 * MiB), os.urandom(3 * MiB)
    assert store(adapter, key, first).ok
    old = set(stored_names(raw_valkey, adapter, key))
    assert store(adapter, key, second).ok
    now = set(stored_names(raw_valkey, adapter, key))
    assert len(now) == 4 and old & now == {adapter.manifest_name(key)}
    result, got = load(adapter, key, len(second))
    assert result.value == [True] and got == second
    assert adapter.usage().objects == 1


def test_valkey_corrupt_part_is_a_counted_miss_and_is_deleted(valkey_adapter_factory, raw_valkey) -> None:
    adapter = valkey_adapter_factory("corrupt", max_value_mib=1)
    adapter.start()
    key, value = new_key(), os.urandom(2 * MiB)
    assert store(adapter, key, value).ok
    adapter.corrupt_for_test(key, 100 + MiB + 7)  # inside the second part
    result, _ = load(adapter, key, len(value))
    assert result.ok and result.value == [False]
    assert adapter.usage().corrupt == 1
    assert stored_names(raw_valkey, adapter, key) == []


def test_valkey_tier_goes_down_with_its_server_and_comes_back(own_valkey: ValkeyServer) -> None:
    adapter = ValkeyAdapter("flaky", valkey_config(own_valkey.url, max_value_mib=1, socket_timeout_s=1.0))
    adapter.start()
    try:
        key, value = new_key(), os.urandom(2 * MiB)
        assert store(adapter, key, value).ok

        own_valkey.kill()
        started = time.monotonic()
        failed = store(adapter, new_key(), value)
        assert failed.ok is False and failed.value == [False]
        result, _ = load(adapter, key, len(value))  # fails fast without touching the dead server
        assert result.ok is False and result.value == [False]
        assert lookup(adapter, [key]).ok is False
        assert time.monotonic() - started < 1.5
        usage = adapter.usage()
        assert usage.healthy is False and usage.failures >= 1 and usage.last_error

        own_valkey.start()  # same port, empty (no persistence): the adapter reconnects by itself
        again = new_key()
        assert wait_until_serving(adapter, again, value) < RETRY_WAIT_S
        assert adapter.usage().healthy is True
        result, got = load(adapter, again, len(value))
        assert result.value == [True] and got == value
    finally:
        adapter.close()


def test_a_valkey_account_without_info_serves_objects_with_cluster_auto(valkey_server: ValkeyServer, raw_valkey) -> None:
    """A least-privilege account (``+@all -@dangerous``, a usual ACL recipe: INFO is @dangerous) may run
    every command the tier stores and loads with. ``cluster=auto`` (the default) asked ``INFO cluster``
    at the first connection and, refused, never connected: the tier was down for good while the server
    was fine. It asks ``CLUSTER INFO`` instead, and failing that takes the server for a single one."""
    user = f"kvt-acl-{os.getpid()}"
    raw_valkey.execute_command("ACL", "SETUSER", user, "on", ">acl-secret", "~*", "+@all", "-@dangerous")
    adapter = ValkeyAdapter("acl", valkey_config(f"redis://{user}:acl-secret@127.0.0.1:{valkey_server.port}/0", max_value_mib=1))
    adapter.start()
    try:
        for size in (1000, 2 * MiB + 1):  # inline, and in parts
            key, value = new_key(), os.urandom(size)
            stored = store(adapter, key, value)
            assert stored.ok and stored.value == [True], stored
            result, got = load(adapter, key, size)
            assert result.value == [True] and got == value
        assert adapter.in_cluster is False
        usage = adapter.usage()
        assert (usage.healthy, usage.failures) == (True, 0), usage
    finally:
        adapter.close()
        raw_valkey.execute_command("ACL", "DELUSER", user)


def test_a_valkey_tier_with_a_wrong_password_is_down_from_start_without_a_request(valkey_server: ValkeyServer, raw_valkey) -> None:
    """Its probe (at start, then every retry interval) is what tells: it was healthy until a request came."""
    user = f"kvt-pw-{os.getpid()}"
    raw_valkey.execute_command("ACL", "SETUSER", user, "on", ">right-secret", "~*", "+@all")
    adapter = ValkeyAdapter("pw", valkey_config(f"redis://{user}:wrong-secret@127.0.0.1:{valkey_server.port}/0"))
    adapter.start()
    try:
        wait_until(lambda: not adapter.health()[0], timeout_s=RETRY_WAIT_S, what="the tier down without a request")
        error = adapter.health()[1]
        assert "Authentication" in error and "wrong-secret" not in error, error
        assert adapter.usage().failures == 0  # a probe is not a failed task
    finally:
        adapter.close()
        raw_valkey.execute_command("ACL", "DELUSER", user)


def test_a_least_privileged_valkey_account_refused_the_probe_stays_healthy(valkey_server: ValkeyServer, raw_valkey) -> None:
    """An account confined to the tier's prefix, without INFO (and here even without EXISTS): the probe's
    NOPERM is the server answering, never a tier marked down (which would drop every store)."""
    user = f"kvt-lp-{os.getpid()}"
    config = valkey_config(f"redis://{user}:lp-secret@127.0.0.1:{valkey_server.port}/0", cluster="off")
    raw_valkey.execute_command("ACL", "SETUSER", user, "on", ">lp-secret", f"~{config.prefix}*", "+@all", "-@dangerous", "-exists")
    wrong = ValkeyAdapter("lp-wrong", valkey_config(f"redis://{user}:nope@127.0.0.1:{valkey_server.port}/0", cluster="off"))
    adapter = ValkeyAdapter("lp", config)
    wrong.start()
    adapter.start()
    try:
        # Both probed at start: the one with the wrong password is down once the other has had as long.
        wait_until(lambda: not wrong.health()[0], timeout_s=RETRY_WAIT_S, what="the wrong password's tier down")
        never(lambda: not adapter.health()[0], within_s=3.0, what="the least-privileged tier marked down")
        assert adapter.health() == (True, "")
    finally:
        wrong.close()
        adapter.close()
        raw_valkey.execute_command("ACL", "DELUSER", user)


def test_valkey_hung_server_times_out_instead_of_blocking(own_valkey: ValkeyServer) -> None:
    adapter = ValkeyAdapter("hung", valkey_config(own_valkey.url, socket_timeout_s=0.5))
    adapter.start()
    assert own_valkey.proc is not None
    try:
        assert store(adapter, new_key(), b"x" * 1000).ok
        pause(own_valkey.proc.pid)
        started = time.monotonic()
        assert store(adapter, new_key(), b"y" * 1000).ok is False
        assert time.monotonic() - started < 3.0
        assert adapter.usage().healthy is False
    finally:
        own_valkey.proc.send_signal(signal.SIGCONT)
        adapter.close()


# --- S3 --------------------------------------------------------------------------------------------


def test_s3_multipart_upload_round_trips(s3_adapter_factory) -> None:
    adapter = s3_adapter_factory("multipart", multipart_threshold_mib=6, part_size_mib=5)
    adapter.start()
    key, value = new_key(), os.urandom(12 * MiB + 321)
    assert store(adapter, key, value).value == [True]
    head = adapter._client.head_object(Bucket=adapter._config.bucket, Key=adapter.object_name(key))
    assert head["ContentLength"] > len(value)
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 2 MiB and change
    result, got = load(adapter, key, len(value))
    assert result.value == [True] and got == value
    assert lookup(adapter, [key]).value == 1


def test_s3_failed_multipart_upload_is_aborted_and_invisible(s3_adapter_factory) -> None:
    adapter = s3_adapter_factory("abort", multipart_threshold_mib=6, part_size_mib=5)
    adapter.start()
    client, bucket = adapter._client, adapter._config.bucket

    def fail(**kwargs):
        raise ConnectionError("died before completing the upload")

    client.complete_multipart_upload = fail
    key, value = new_key(), os.urandom(11 * MiB)
    assert store(adapter, key, value).ok is False
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=adapter.object_name(key)).get("Uploads", [])
    assert uploads == []  # aborted: the parts sent are gone
    del client.complete_multipart_upload
    assert wait_until_serving(adapter, new_key(), b"z" * 100) >= 0
    assert lookup(adapter, [key]).value == 0
    result, _ = load(adapter, key, len(value))
    assert result.ok and result.value == [False]


def test_s3_creates_its_bucket_on_first_use_and_counts_objects(s3_server, caplog) -> None:
    adapter = S3Adapter("fresh", s3_config(s3_server.endpoint, bucket=f"kvd-fresh-{os.getpid()}"))
    adapter.start()
    try:
        # Before the bucket exists its usage is asked too (another server may have filled it): empty, quietly.
        usage = adapter.usage()
        assert (usage.healthy, usage.objects, usage.used_bytes) == (True, 0, 0)
        assert "cannot report its usage" not in caplog.text
        keys = [new_key() for _ in range(3)]
        for k in keys:
            assert store(adapter, k, os.urandom(1000)).ok
        usage = adapter.usage()
        assert usage.objects == 3 and usage.used_bytes > 3000 and usage.healthy
        assert lookup(adapter, keys + [new_key()] + keys).value == 3
    finally:
        adapter.close()


def test_an_s3_bucket_deleted_under_a_running_tier_is_made_again(s3_server) -> None:
    """With ``create_bucket``, a bucket deleted while the tier runs (an operator, a lifecycle script) is
    misses, and the tier makes it again and stores on. It made the bucket only at its first use, so
    every later store failed and the tier stayed down for good."""
    bucket = f"kvd-gone-{os.getpid()}"
    adapter = S3Adapter("gone", s3_config(s3_server.endpoint, bucket=bucket))
    adapter.start()
    try:
        old, value = new_key(), os.urandom(1000)
        assert store(adapter, old, value).value == [True]
        client = adapter._client
        for o in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])
        client.delete_bucket(Bucket=bucket)

        assert lookup(adapter, [old]).value == 0  # a miss
        store(adapter, new_key(), value)  # fails: no bucket (the tier goes down)
        again = new_key()
        wait_until_serving(adapter, again, value)
        result, got = load(adapter, again, len(value))
        assert result.value == [True] and got == value
        assert lookup(adapter, [old]).value == 0 and adapter.usage().healthy
    finally:
        adapter.close()


def test_an_s3_tier_whose_bucket_is_missing_is_down_from_start_unless_it_makes_it(s3_server) -> None:
    """Without ``create_bucket`` a missing bucket is a tier that cannot work: down, saying why, with no
    request to find out. With it, the bucket is made by the first store: no fault."""
    missing = f"kvt-missing-{os.getpid():x}"
    down = S3Adapter("nobucket", s3_config(s3_server.endpoint, bucket=missing, create_bucket=False))
    makes = S3Adapter("makes", s3_config(s3_server.endpoint, bucket=missing, create_bucket=True))
    down.start()
    makes.start()
    try:
        wait_until(lambda: not down.health()[0], timeout_s=RETRY_WAIT_S, what="the tier without its bucket down")
        assert "NoSuchBucket" in down.health()[1], down.health()
        assert makes.health() == (True, "")  # probed as long as the other
    finally:
        down.close()
        makes.close()


@pytest.mark.parametrize("prefix", ["", "kvd-{pid}-"])
def test_s3_clear_and_usage_leave_objects_it_did_not_write(s3_server, prefix) -> None:
    """An empty prefix, or one without a trailing "/", lists other applications' objects too: a clear
    deletes, and the usage counts, only the key-named objects this tier writes."""
    prefix = prefix.format(pid=os.getpid())
    adapter = S3Adapter("shared", s3_config(s3_server.endpoint, bucket=f"kvd-shared-{os.getpid()}-{len(prefix)}", prefix=prefix))
    adapter.start()
    try:
        keys = [new_key() for _ in range(2)]
        for k in keys:
            assert store(adapter, k, os.urandom(1000)).ok
        client, bucket = adapter._client, adapter._config.bucket
        foreign = [f"{prefix}-backups/day1", f"{prefix}notes.txt", f"{prefix}ab/cd", f"{prefix}abc"]
        for name in foreign:
            client.put_object(Bucket=bucket, Key=name, Body=b"not kvdepot's")
        assert adapter.usage().objects == 2
        assert run(adapter, adapter.submit_clear()).ok
        assert lookup(adapter, keys).value == 0
        left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert sorted(left) == sorted(foreign)
    finally:
        adapter.close()


def test_s3_usage_is_exact_beside_a_larger_tier_whose_prefix_nests_under_its_own(s3_server) -> None:
    """Servers sharing a bucket may run tiers whose prefixes nest (``kv/`` and ``kv/staging/``). The
    usage is exact at every call while the tier's own objects fit one listing page: the other tier's
    objects were listed too, so a tier of two objects paged through a thousand of theirs and showed its
    count a minute stale (before the usage paged, it read 0)."""
    from concurrent.futures import ThreadPoolExecutor

    bucket, prefix = f"kvd-nest-{os.getpid()}", f"kv-{os.getpid()}/"
    outer = S3Adapter("outer", s3_config(s3_server.endpoint, bucket=bucket, prefix=prefix))
    inner = S3Adapter("inner", s3_config(s3_server.endpoint, bucket=bucket, prefix=prefix + "staging/"))
    outer.start()
    inner.start()
    try:
        for k in [new_key() for _ in range(2)]:
            assert store(outer, k, os.urandom(1000)).ok
        assert store(inner, new_key(), os.urandom(1000)).ok  # makes the inner tier's client ready
        client = inner._client
        with ThreadPoolExecutor(16) as pool:  # the inner tier's objects, put directly: quicker than stores
            list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=inner.object_name(new_key()), Body=b"x"), range(1000)))
        assert outer.usage().objects == 2
        assert store(outer, new_key(), os.urandom(1000)).ok
        usage = outer.usage()
        assert (usage.objects, usage.used_bytes > 3000) == (3, True), usage
    finally:
        outer.close()
        inner.close()


def _fail_the_next_delete(adapter: ValkeyAdapter) -> None:
    """The client's next DEL raises as a reset link would (its process dying right there alike)."""
    from valkey.exceptions import ConnectionError as LinkDown

    client = adapter._valkey
    real = client.delete

    def delete(*names):
        client.delete = real  # once
        raise LinkDown("connection reset by peer")

    client.delete = delete


def _parts_under(raw, prefix: bytes) -> list[bytes]:
    return [n for n in raw.scan_iter(match=prefix + b"{*") if n.count(b":") >= 2]


@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_valkey_parts_no_manifest_names_expire_when_their_delete_never_came(valkey_adapter_factory, raw_valkey, how) -> None:
    """The old parts of an overwritten or deleted object are deleted by the client after the script that
    swaps or drops the manifest; a link that drops (a process that dies) right there left them without a
    TTL (the commit had taken it off), named by no manifest, never counted: on the server for good."""
    from valkey.exceptions import ConnectionError as LinkDown

    a = valkey_adapter_factory(f"orphans-{how}", max_value_mib=1)
    key = new_key()
    a._put(key, memoryview(os.urandom(3 << 20)))  # three parts
    assert len(_parts_under(raw_valkey, a._prefix)) == 3
    _fail_the_next_delete(a)
    with pytest.raises(LinkDown):
        if how == "overwrite":
            a._put(key, memoryview(os.urandom(3 << 20)))
        else:
            a._delete(key)
    manifest = raw_valkey.get(a.manifest_name(key))
    live = set(a.part_names(key, manifest[:20])) if manifest else set()
    orphans = [p for p in _parts_under(raw_valkey, a._prefix) if p not in live]
    assert len(orphans) == 3
    assert all(raw_valkey.ttl(p) > 0 for p in orphans), {p: raw_valkey.ttl(p) for p in orphans}


def test_a_valkey_clear_racing_a_store_leaves_the_object_count_right(valkey_adapter_factory, raw_valkey) -> None:
    """A store committed while a clear unlinked what its scan found: the clear then deleted the counter,
    and the store's count with it; the voided store's delete took it to -1, and usage under-counted for
    good. The clear now takes off exactly the manifests it removed."""
    a = valkey_adapter_factory("count")
    b = valkey_adapter_factory("count-b", prefix=a._config.prefix)  # another worker of the same tier
    a._put(new_key(), memoryview(b"x" * 100))
    racing = new_key()
    client, real = a._valkey, a._valkey.unlink

    def unlink(*names):
        client.unlink = real
        b._put(racing, memoryview(b"y" * 100))  # commits after the clear's scan, before its unlinks end
        return real(*names)

    client.unlink = unlink
    a._clear()
    client.unlink = real
    a._delete(racing)  # what the backend does with a store a clear voided
    a._put(new_key(), memoryview(b"z" * 100))
    manifests = [n for n in raw_valkey.scan_iter(match=a._prefix + b"{*") if b":" not in n[len(a._prefix) :]]
    assert a._usage()[2] == len(manifests) == 1, f"usage says {a._usage()[2]} objects, the tier holds {len(manifests)}"


@pytest.mark.parametrize("prefix", ["kv-ab", "kvdepot-01", "cache7"])
def test_an_s3_prefix_ending_in_a_hex_digit_is_refused(prefix) -> None:
    """Names are <prefix><key hex>: "kv-ab" + <key hex> also reads as "kv-" + <hex>, so a clear of a
    tier at "kv-" in the same bucket deleted that tier's objects. A prefix that ends in something else
    ("kvdepot/", "kv-ab-", "") splits every name one way only."""
    with pytest.raises(ConfigError, match="ends with a hex digit"):
        s3_config("http://127.0.0.1:1", prefix=prefix)
    for fine in ("", "kvdepot/", f"{prefix}-", f"{prefix}/"):
        s3_config("http://127.0.0.1:1", prefix=fine)


def test_an_s3_clear_that_could_not_delete_every_object_is_not_a_cleared_tier(s3_server) -> None:
    """DeleteObjects answers 200 and lists what it could not delete (SlowDown, InternalError): the
    clear used to count every object removed and announce the tier cleared while one was still served."""
    sink = EventRecorder()
    adapter = S3Adapter("stuck", s3_config(s3_server.endpoint, bucket=f"kvd-stuck-{os.getpid()}"), TierServices(sink=sink))
    adapter.start()
    try:
        keys, value = [new_key() for _ in range(3)], os.urandom(1000)
        for k in keys:
            assert store(adapter, k, value).value == [True]
        real, stuck = adapter._client.delete_objects, adapter.object_name(keys[0])

        def delete_objects(**kwargs):  # the store refuses one object
            kwargs["Delete"]["Objects"] = [o for o in kwargs["Delete"]["Objects"] if o["Key"] != stuck]
            resp = real(**kwargs)
            resp.setdefault("Errors", []).append({"Key": stuck, "Code": "InternalError", "Message": "try again"})
            return resp

        adapter._client.delete_objects = delete_objects
        result = run(adapter, adapter.submit_clear())
        assert not result.ok, f"the clear reported {result.value} removed while {stuck} is still there"
        adapter._client.delete_objects = real
        left = [o["Key"] for o in adapter._client.list_objects_v2(Bucket=adapter._config.bucket).get("Contents", [])]
        assert left == [stuck]
        # No TierCleared, so the objects it did delete are told one by one: announced, they would stay
        # in a router's index (KV events) as phantom blocks.
        told = {bytes(k) for e in sink.events if isinstance(e, TierRemoved) for k in e.keys}
        assert not any(isinstance(e, TierCleared) for e in sink.events)
        assert told == {bytes(k) for k in keys[1:]}
    finally:
        adapter.close()


def test_s3_tier_goes_down_with_its_server_and_comes_back(own_weed: WeedServer) -> None:
    adapter = S3Adapter("flaky", s3_config(own_weed.endpoint))
    adapter.start()
    try:
        key, value = new_key(), os.urandom(MiB)
        assert store(adapter, key, value).ok

        own_weed.kill()  # a crash: what it acknowledged must still be there after the restart
        started = time.monotonic()
        failed = store(adapter, new_key(), value)
        assert failed.ok is False and failed.value == [False]
        result, _ = load(adapter, key, len(value))
        assert result.ok is False
        assert time.monotonic() - started < 3.0
        assert adapter.usage().healthy is False

        own_weed.start()  # same ports, same data directory
        assert wait_until_serving(adapter, new_key(), value) < RETRY_WAIT_S
        result, got = load(adapter, key, len(value))  # stored before the restart, still there
        assert result.value == [True] and got == value
        assert adapter.usage().healthy is True
    finally:
        adapter.close()


def test_s3_clear_aborts_the_uploads_a_killed_server_left_unfinished(s3_adapter_factory) -> None:
    """A server SIGKILLed during a multipart upload leaves the upload open: its parts stay stored (and
    billed) though no object names them. A clear of the tier removes them too; another application's
    upload under the same prefix (not a key-named object) is left alone."""
    adapter = s3_adapter_factory("orphans", multipart_threshold_mib=6, part_size_mib=5)
    adapter.start()
    client, bucket, prefix = adapter._client, adapter._config.bucket, adapter._config.prefix
    assert store(adapter, new_key(), b"x" * 100).value == [True]  # the bucket exists
    ours, foreign = adapter.object_name(new_key()), f"{prefix}backups/day1"
    for name in (ours, foreign):
        upload = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
        client.upload_part(Bucket=bucket, Key=name, UploadId=upload, PartNumber=1, Body=os.urandom(5 * MiB))
    assert run(adapter, adapter.submit_clear()).ok
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])]
    assert left == [foreign]
    client.abort_multipart_upload(Bucket=bucket, Key=foreign, UploadId=client.list_multipart_uploads(Bucket=bucket, Prefix=foreign)["Uploads"][0]["UploadId"])


def test_an_s3_upload_a_clear_aborted_is_a_refused_object_not_a_dead_tier(s3_adapter_factory) -> None:
    """A store whose multipart upload a clear (another server's, on the same prefix) aborted while it
    ran is that object's failure alone: the tier stays up and goes on storing."""
    adapter = s3_adapter_factory("aborted", multipart_threshold_mib=6, part_size_mib=5)
    other = s3_adapter_factory("other", prefix=adapter._config.prefix)
    adapter.start()
    other.start()
    assert store(other, new_key(), b"x" * 100).value == [True]  # the bucket exists
    real_upload_part = adapter._client.upload_part
    cleared: list[TaskResult] = []
    once = threading.Lock()

    def upload_part(**kwargs):
        with once:  # the parts go up in parallel: the first one clears, the others wait for it
            if not cleared:
                cleared.append(run(other, other.submit_clear()))  # between the upload's start and its parts
        return real_upload_part(**kwargs)

    adapter._client.upload_part = upload_part
    key, value = new_key(), os.urandom(11 * MiB)
    result = store(adapter, key, value)
    assert cleared and cleared[0].ok
    assert result.value == [False]
    assert result.ok and adapter.usage().healthy, f"the tier was taken down: {result.error}"
    assert store(adapter, new_key(), b"y" * 100).value == [True]


def test_a_password_in_an_s3_endpoint_url_stays_out_of_errors_status_and_the_log(caplog) -> None:
    """botocore names the URL it could not reach, password and all: a tier whose endpoint_url carried
    one showed it in its task errors, in ``last_error`` (/status, readable by anyone who reaches the
    admin port), in the log and in its repr."""
    import logging

    adapter = S3Adapter("leak", s3_config("http://user:hunter2pw@127.0.0.1:1", connect_timeout_s=1, max_attempts=1))
    adapter.start()
    try:
        with caplog.at_level(logging.INFO, logger="kvdepot"):
            result = store(adapter, new_key(), b"x" * 100)
            usage = adapter.usage()
        assert not result.ok and "127.0.0.1:1" in result.error  # the error still says where
        shown = {"task error": result.error, "last_error": usage.last_error, "repr": repr(adapter), "log": caplog.text}
        assert not [where for where, text in shown.items() if "hunter2pw" in text], shown
    finally:
        adapter.close()


def test_s3_usage_counts_a_tier_longer_than_one_listing_page(s3_server, monkeypatch) -> None:
    """The usage read one listing page and said 0 objects, 0 bytes past it (past 1000 objects): a dashboard
    saw the tier emptied as it grew. A count of several pages is taken again only a while later (each
    page is a request), its figures shown meanwhile; a clear counts afresh."""
    from kvdepot.storage.l2 import s3_adapter

    monkeypatch.setattr(S3Adapter, "LIST_PAGE", 2)  # 5 objects: three pages, as 5,000 would be
    adapter = S3Adapter("paged", s3_config(s3_server.endpoint, bucket=f"kvd-paged-{os.getpid()}"))
    adapter.start()
    try:
        for k in [new_key() for _ in range(5)]:
            assert store(adapter, k, os.urandom(1000)).ok
        usage = adapter.usage()
        assert (usage.objects, usage.healthy) == (5, True) and usage.used_bytes > 5000
        assert store(adapter, new_key(), os.urandom(1000)).ok
        assert adapter.usage().objects == 5, "a count of several pages was taken again at once"
        monkeypatch.setattr(s3_adapter, "RECOUNT_S", 0.0)
        monkeypatch.setattr(s3_adapter, "RECOUNT_S_PER_PAGE", 0.0)
        adapter._recount_at = 0.0
        assert adapter.usage().objects == 6
        monkeypatch.setattr(s3_adapter, "RECOUNT_S", 3600.0)
        assert adapter.usage().objects == 6
        assert run(adapter, adapter.submit_clear()).ok
        assert adapter.usage().objects == 0
    finally:
        adapter.close()


def test_an_s3_clear_during_a_usage_listing_does_not_leave_the_old_count_shown(s3_server, monkeypatch) -> None:
    """A count of several pages is kept a minute or more (half a second a page), and a clear drops it so
    the emptied tier is not shown full. A listing already under way when the clear ran (a big tier's takes
    seconds, and /status and every scrape ask for one) kept its pre-clear figures as that count: the
    cleared tier showed every object it had for minutes."""
    monkeypatch.setattr(S3Adapter, "LIST_PAGE", 2)  # 5 objects: three pages, as 5,000 would be
    adapter = S3Adapter("paged-clear", s3_config(s3_server.endpoint, bucket=f"kvd-paged-clear-{os.getpid()}"))
    adapter.start()
    try:
        for k in [new_key() for _ in range(5)]:
            assert store(adapter, k, os.urandom(1000)).ok
        listing, go = threading.Event(), threading.Event()
        ours = adapter._ours
        usage_thread: list[threading.Thread] = []

        def slow_ours(page):
            if threading.current_thread() in usage_thread and not listing.is_set():
                listing.set()  # the usage listing has read its first page: hold it there
                assert go.wait(10)
            return ours(page)

        monkeypatch.setattr(adapter, "_ours", slow_ours)
        figures: list[tuple[int, int, int]] = []
        usage_thread.append(threading.Thread(target=lambda: figures.append(adapter._usage())))
        usage_thread[0].start()
        assert listing.wait(10)
        assert run(adapter, adapter.submit_clear()).ok  # meanwhile: every object goes
        go.set()
        usage_thread[0].join(10)
        assert figures, "the usage listing did not end"
        assert adapter.usage().objects == 0, "a clear's emptied tier showed the count a listing begun before it took"
    finally:
        adapter.close()
