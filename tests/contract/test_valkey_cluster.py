"""What only a Valkey Cluster adds to the valkey tier (the contract suite runs over the cluster too):
one object's keys in one hash slot, objects spread over every primary, and a primary's failover that
loses no replicated object and leaves the tier serving again. Real clusters of valkey-server processes
(3 primaries, a replica each) on loopback, formed with the cluster's own commands."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter

from support.backends import ValkeyCluster, short_tmpdir, start_valkey_cluster, valkey_config
from support.servers import wait_until

from .test_remote_adapters import RETRY_WAIT_S, load, lookup, new_key, store, wait_until_serving

MiB = 1 << 20


def raw_cluster(cluster: ValkeyCluster):
    from valkey.cluster import ValkeyCluster as Client

    return Client.from_url(cluster.url)


def payloads(n: int, big_every: int = 2) -> dict[bytes, bytes]:
    """``n`` objects; every ``big_every``-th is 2.5 MiB (three parts of 1 MiB), the rest fit in a manifest."""
    return {new_key(): os.urandom(int(2.5 * MiB) if i % big_every == 0 else 20_000) for i in range(n)}


def test_an_objects_keys_share_one_slot_and_objects_spread_over_every_primary(valkey_cluster) -> None:
    adapter = ValkeyAdapter("cl", valkey_config(valkey_cluster.url, max_value_mib=1))
    adapter.start()
    raw = raw_cluster(valkey_cluster)
    try:
        objects = payloads(24)
        for key, value in objects.items():
            assert store(adapter, key, value).value == [True]
        assert adapter.in_cluster  # cluster=auto asked the server
        owners = set()
        for key, value in objects.items():
            manifest = adapter.manifest_name(key)
            names = [n for n in raw.scan_iter(match=manifest + b"*") if n.startswith(manifest)]
            assert manifest in names and len(names) == (4 if len(value) > MiB else 1), names  # manifest + 3 parts
            slots = {raw.keyslot(n) for n in names}
            assert len(slots) == 1, f"an object's keys in {len(slots)} slots"
            owners.add(raw.get_node_from_key(manifest).name)
            result, got = load(adapter, key, len(value))
            assert result.value == [True] and got == value
        assert len(owners) == valkey_cluster.primaries, f"objects on {len(owners)} of {valkey_cluster.primaries} primaries"
        assert lookup(adapter, list(objects)).value == len(objects)
        usage = adapter.usage()
        assert usage.objects == len(objects) and usage.used_bytes > 0
    finally:
        adapter.close()
        raw.close()


def test_cluster_off_on_a_cluster_is_a_failing_tier_never_wrong_bytes(valkey_cluster) -> None:
    """Told it is one server, the adapter's multi-key script meets keys of other nodes: each such store
    fails (the tier marked down, saying MOVED), and nothing it reads is wrong."""
    adapter = ValkeyAdapter("off", valkey_config(valkey_cluster.url, cluster="off", max_value_mib=1))
    adapter.start()
    try:
        outcomes = [store(adapter, key, value).ok for key, value in payloads(6).items()]
        assert not all(outcomes)
        usage = adapter.usage()  # its probe at start may have met the MOVED first: the stores then failed fast
        assert not usage.healthy and "MOVED" in usage.last_error and not adapter.in_cluster, usage
        # Its probe (one key's EXISTS) gets answers while its stores fail: a probe does not bring back a
        # tier a task took down (it flapped up and down, failing the stores let through each time).
        time.sleep(2.5 * 2.0)  # two and a half retry intervals: the probe would have run twice
        assert not adapter.usage().healthy
    finally:
        adapter.close()


def load_once_serving(adapter: ValkeyAdapter, key: bytes, size: int):
    """A load that the tier answered (found or not): a load that failed on the way (the client's slot
    map still naming the dead primary, the tier down for its retry interval) is tried again."""
    deadline = time.monotonic() + RETRY_WAIT_S
    while True:
        result, got = load(adapter, key, size)
        if result.ok or time.monotonic() > deadline:
            return result, got
        time.sleep(0.2)


@pytest.fixture
def own_cluster():
    workdir = short_tmpdir("vkfail")
    cluster = start_valkey_cluster(workdir)
    yield cluster
    cluster.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_a_failover_loses_no_replicated_object_and_the_tier_serves_again(own_cluster) -> None:
    adapter = ValkeyAdapter("fo", valkey_config(own_cluster.url, max_value_mib=1, socket_timeout_s=1.0))
    adapter.start()
    raw = raw_cluster(own_cluster)
    try:
        objects = payloads(18, big_every=3)
        for key, value in objects.items():
            assert store(adapter, key, value).value == [True]
        own_cluster.wait_replicated()
        # SIGKILL the primary that holds the most of them: its replica has to take over
        by_port: dict[int, int] = {}
        for key in objects:
            port = raw.get_node_from_key(adapter.manifest_name(key)).port
            by_port[port] = by_port.get(port, 0) + 1
        victim = next(n for n in own_cluster.nodes if n.port == max(by_port, key=by_port.get))
        victim.kill()
        own_cluster.wait_failed_over(victim)

        took = wait_until_serving(adapter, new_key(), os.urandom(3 * MiB))
        assert took < RETRY_WAIT_S
        for key, value in objects.items():
            result, got = load_once_serving(adapter, key, len(value))
            assert result.value == [True], f"an object on the failed primary (port {victim.port}) was lost"
            assert got == value
        for key, value in payloads(6).items():  # new objects land, on the promoted replica too
            assert store(adapter, key, value).value == [True]
            assert load(adapter, key, len(value))[1] == value
    finally:
        adapter.close()
        raw.close()


def test_cluster_parts_no_manifest_names_expire_when_their_delete_never_came(valkey_cluster_adapter_factory) -> None:
    """As on one server: the commit script gives the replaced parts the orphan TTL in their own slot."""
    from valkey.exceptions import ConnectionError as LinkDown

    from .test_remote_adapters import _fail_the_next_delete

    a = valkey_cluster_adapter_factory("orphans", max_value_mib=1)
    key = new_key()
    a._put(key, memoryview(os.urandom(3 << 20)))
    assert a.in_cluster
    old_meta = a._valkey.get(a.manifest_name(key))[:20]
    _fail_the_next_delete(a)
    with pytest.raises(LinkDown):
        a._put(key, memoryview(os.urandom(3 << 20)))
    assert all(a._valkey.ttl(n) > 0 for n in a.part_names(key, old_meta))
    a._put(new_key(), memoryview(b"q" * 10))
    assert a._clear() == 2 and a._valkey.get(a._counter) is None



def test_a_commit_retried_after_its_reply_was_lost_counts_the_object_once(valkey_cluster) -> None:
    """The cluster client sends a script again when the connection drops before its reply (its retry on
    connection errors). The first run stored the manifest; the second saw its own manifest and answered
    with its meta, which the adapter took for an overwrite: the object count never went up."""
    adapter = ValkeyAdapter("retry", valkey_config(valkey_cluster.url, max_value_mib=1))
    adapter.start()
    try:
        assert store(adapter, new_key(), b"x" * 20_000).value == [True]
        assert adapter.in_cluster
        real = adapter._commit

        def sent_twice(**kwargs):
            real(**kwargs)  # ran on the server; its reply lost on the way back
            return real(**kwargs)

        adapter._commit = sent_twice
        for value in (b"y" * 20_000, os.urandom(int(2.5 * MiB))):
            key = new_key()
            assert store(adapter, key, value).value == [True]
            result, got = load(adapter, key, len(value))
            assert result.value == [True] and got == value
        assert adapter.usage().objects == 3
    finally:
        adapter.close()


def test_a_cluster_with_a_primary_down_is_a_down_tier_without_a_request_and_comes_back() -> None:
    """No replica to take over: once the cluster sees the primary gone its slots are uncovered, every
    node answers CLUSTERDOWN, and the tier is down (its probe, not a request, finds out); the primary
    back, the tier is up again by itself."""
    workdir = short_tmpdir("vkdown")
    cluster = start_valkey_cluster(workdir, primaries=3, replicas=0)
    adapter = ValkeyAdapter("cd", valkey_config(cluster.url, socket_timeout_s=1.0))
    adapter.start()
    raw = raw_cluster(cluster)
    try:
        assert store(adapter, new_key(), b"x" * 1000).value == [True]
        assert adapter.in_cluster and adapter.health() == (True, "")
        holder = raw.get_node_from_key(adapter._counter).port  # the probe's own node stays up
        victim = next(n for n in cluster.nodes if n.port != holder)
        victim.kill()
        wait_until(lambda: not adapter.health()[0], timeout_s=RETRY_WAIT_S, what="the tier down without a request")
        assert adapter.health()[1], adapter.health()
        victim.start()
        wait_until(lambda: adapter.health()[0], timeout_s=3 * RETRY_WAIT_S, what="the tier up again by itself")
    finally:
        adapter.close()
        raw.close()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
