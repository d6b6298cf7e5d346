"""What only the fs tier promises: its file layout, atomic writes, restart, O_DIRECT and a full disk."""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvdepot.storage.l2 import envelope, fs_adapter, registry
from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig

from .helpers import adapter_threads, load, lookup, make_keys, make_payload, present, store, unlock, wait

MiB = 1 << 20


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(99)


@pytest.fixture
def open_tiers():
    """Builds fs tiers and closes whatever a test left open."""
    tiers: list[FsAdapter] = []

    def make(path: Path, start: bool = True, **options) -> FsAdapter:
        tier = FsAdapter(f"fs{len(tiers)}", FsConfig(path=str(path), **options))
        tiers.append(tier)
        if start:
            tier.start()
        return tier

    yield make
    for tier in tiers:
        if tier.eventfd >= 0:
            tier.close()
        assert adapter_threads(tier) == []


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")


# --- layout and configuration --------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "nofsync"])
def test_each_object_is_one_envelope_file_named_by_its_key(tmp_path, open_tiers, rng, o_direct, fsync) -> None:
    tier = open_tiers(tmp_path, o_direct=o_direct, fsync=fsync)
    keys = make_keys(3)
    payloads = [make_payload(rng, n) for n in (1, 4096, 12_345)]  # around and off the 4 KiB alignment
    assert store(tier, list(zip(keys, payloads))).value == [True] * 3
    for key, payload in zip(keys, payloads):
        path = Path(tier.path_of(key))
        assert path == tmp_path / key[16:17].hex() / key.hex()
        assert path.read_bytes() == envelope.encode(key, payload)  # exact length, even under O_DIRECT
    assert files_under(tmp_path) == sorted(Path(tier.path_of(k)) for k in keys)
    dests = [np.zeros_like(p) for p in payloads]
    assert load(tier, keys, dests) == [True] * 3
    assert all(np.array_equal(d, p) for d, p in zip(dests, payloads))


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_objects_are_readable_by_the_servers_user_alone(tmp_path, open_tiers, rng, o_direct) -> None:
    """An object is a tenant's KV cache (its prompt, to whoever can invert it): the L1 arena is mode 0600
    for that, and the disk tier's files were 0644 under the usual umask, every tenant's KV readable by
    every local user. Now they are the server's user's alone, whatever the umask."""
    old = os.umask(0o022)
    try:
        tier = open_tiers(tmp_path, o_direct=o_direct)
        keys = make_keys(2)
        assert store(tier, [(k, make_payload(rng, 5000)) for k in keys]).value == [True, True]
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files_under(tmp_path)}
    assert len(modes) == 2 and set(modes.values()) == {"0o600"}, modes


def test_the_directories_it_makes_are_the_servers_users_alone_under_any_umask(tmp_path, open_tiers) -> None:
    """Under a umask of 000 the tier's directories were world-writable: any local user could plant an
    object (a checksum is no signature) or remove one."""
    old = os.umask(0)
    try:
        open_tiers(tmp_path / "fs")
    finally:
        os.umask(old)
    modes = {oct((tmp_path / "fs").stat().st_mode & 0o777)} | {oct(d.stat().st_mode & 0o777) for d in (tmp_path / "fs").iterdir() if d.is_dir()}
    assert modes == {"0o700"}, modes


def test_constructor_touches_nothing(tmp_path) -> None:
    FsAdapter("fs", FsConfig(path=str(tmp_path / "later")))
    assert not (tmp_path / "later").exists()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="size_gb"):
        FsAdapter("fs", FsConfig(path="/x", size_gb=0))
    with pytest.raises(ValueError, match="workers"):
        FsAdapter("fs", FsConfig(path="/x", workers=0))
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": "/x", "sise_gb": 1}, FsConfig)


def test_registry_builds_an_fs_tier(tmp_path) -> None:
    spec = registry.parse_spec(f"fs:path={tmp_path},size_gb=0.5,o_direct=true,fsync=false,name=disk")
    assert (spec.type, spec.name) == ("fs", "disk")
    assert spec.config == FsConfig(path=str(tmp_path), size_gb=0.5, o_direct=True, fsync=False)
    tier = registry.build(spec)
    assert isinstance(tier, FsAdapter) and tier.name == "disk"
    with pytest.raises(ValueError, match="fsynk"):
        registry.parse_spec(f"fs:path={tmp_path},fsynk=false")
    with pytest.raises(ValueError, match="path"):
        registry.parse_spec("fs:size_gb=1")
    assert "fs:" in registry.describe()


def test_a_directory_serves_one_tier_at_a_time(tmp_path, open_tiers) -> None:
    open_tiers(tmp_path)
    second = open_tiers(tmp_path, start=False)
    with pytest.raises(ValueError, match="in use by another fs tier"):
        second.start()
    assert adapter_threads(second) == []


# --- restart ---------------------------------------------------------------------------------------


def test_restart_rebuilds_the_index_and_serves_the_objects(tmp_path, open_tiers, rng) -> None:
    first = open_tiers(tmp_path)
    keys = make_keys(20)
    payloads = [make_payload(rng, 1000 + 100 * i) for i in range(20)]
    store(first, list(zip(keys, payloads)))
    usage = first.usage()
    first.close()

    second = open_tiers(tmp_path, start=False)
    assert second.usage().objects == 0  # the scan is start()'s job, not the constructor's
    second.start()
    again = second.usage()
    assert (again.objects, again.used_bytes) == (usage.objects, usage.used_bytes) == (20, again.used_bytes)
    assert lookup(second, keys) == 20
    unlock(second, keys)
    dests = [np.zeros_like(p) for p in payloads]
    assert load(second, keys, dests) == [True] * 20
    assert all(np.array_equal(d, p) for d, p in zip(dests, payloads))


def _age(tier: FsAdapter, key: bytes, seconds: int) -> None:
    t = 1_700_000_000 + seconds
    os.utime(tier.path_of(key), (t, t))


def test_restart_orders_the_lru_by_modification_time(tmp_path, open_tiers, rng) -> None:
    size = 4000
    keys = make_keys(4)
    capacity = 3 * (envelope.HEADER_BYTES + len(keys[0]) + size)
    first = open_tiers(tmp_path, size_gb=capacity / (1 << 30))
    store(first, [(k, make_payload(rng, size)) for k in keys[:3]])
    for key, age in zip(keys[:3], (30, 10, 20)):  # oldest on disk: keys[1], then keys[2], then keys[0]
        _age(first, key, age)
    first.close()

    second = open_tiers(tmp_path, size_gb=capacity / (1 << 30))
    store(second, [(keys[3], make_payload(rng, size))])
    assert [present(second, k) for k in keys] == [True, False, True, True]
    store(second, [(make_keys(1)[0], make_payload(rng, size))])
    assert [present(second, k) for k in keys] == [True, False, False, True]


def test_restart_keeps_the_lru_order_of_the_loads(tmp_path, open_tiers, rng) -> None:
    """The tier is an LRU (README), and its order comes back from the files' modification times: a load
    must count there too. Otherwise a restart turned it into write order, and the first store after it
    evicted the object read most (a shared system prompt, written first and loaded ever since)."""
    size = 4000
    keys = make_keys(4)
    capacity = 3 * (envelope.HEADER_BYTES + len(keys[0]) + size)
    first = open_tiers(tmp_path, size_gb=capacity / (1 << 30))
    payloads = [make_payload(rng, size) for _ in keys]
    store(first, list(zip(keys[:3], payloads)))
    for i, key in enumerate(keys[:3]):  # written long ago, keys[0] first
        _age(first, key, i)
    assert load(first, [keys[0]], [np.zeros_like(payloads[0])]) == [True]  # now the most recently used
    store(first, [(keys[3], payloads[3])])
    before = [present(first, k) for k in keys]
    first.close()

    second = open_tiers(tmp_path, size_gb=capacity / (1 << 30))
    assert [present(second, k) for k in keys] == before == [True, False, True, True]
    store(second, [(make_keys(1)[0], make_payload(rng, size))])
    assert [present(second, k) for k in keys] == [True, False, False, True]  # keys[2] was the least recently used


def test_restart_with_a_smaller_size_evicts_the_oldest(tmp_path, open_tiers, rng) -> None:
    size = 4000
    keys = make_keys(4)
    envelope_bytes = envelope.HEADER_BYTES + len(keys[0]) + size
    first = open_tiers(tmp_path)
    store(first, [(k, make_payload(rng, size)) for k in keys])
    for i, key in enumerate(keys):
        _age(first, key, i)
    first.close()

    second = open_tiers(tmp_path, size_gb=2 * envelope_bytes / (1 << 30))
    assert second.usage().objects == 2
    assert [present(second, k) for k in keys] == [False, False, True, True]
    assert len(files_under(tmp_path)) == 2


def test_start_removes_unfinished_writes_and_leaves_strangers_alone(tmp_path, open_tiers, rng) -> None:
    first = open_tiers(tmp_path)
    key = make_keys(1)[0]
    payload = make_payload(rng, 5000)
    store(first, [(key, payload)])
    first.close()
    obj = Path(first.path_of(key))
    leftovers = [obj.parent / ".tmp-deadbeef", tmp_path / "7f" / ".tmp-0123", tmp_path / ".tmp-probe-x"]
    for p in leftovers:
        p.write_bytes(b"half an object")
    strangers = [tmp_path / "README", tmp_path / "7f" / "not-hex", tmp_path / "00" / "abcd"]  # abcd: wrong fan-out
    for p in strangers:
        p.write_bytes(b"not ours")

    second = open_tiers(tmp_path)
    assert not any(p.exists() for p in leftovers)
    assert all(p.exists() for p in strangers)
    assert second.usage().objects == 1
    dest = np.zeros_like(payload)
    assert load(second, [key], [dest]) == [True]
    assert np.array_equal(dest, payload)


def test_keys_too_long_for_a_file_name_are_stored_and_found_again_after_a_restart(tmp_path, open_tiers, rng) -> None:
    """Keys above 127 bytes (a peer tier's disk takes keys up to 1 KiB) were refused with a ValueError:
    their hex is no file name. Named by their digest, each is stored, indexed again at start-up from its
    envelope, and one torn before its key was whole is removed there."""
    first = open_tiers(tmp_path)
    keys = [bytes(16) + bytes([i]) + b"k" * 300 for i in range(3)]
    payloads = [make_payload(rng, 3000) for _ in keys]
    store(first, list(zip(keys, payloads)))
    assert [present(first, k) for k in keys] == [True] * 3
    first.close()
    torn = Path(first.path_of(keys[2]))
    os.truncate(torn, envelope.HEADER_BYTES + 100)  # cut inside the key

    second = open_tiers(tmp_path)
    assert second.usage().objects == 2 and not torn.exists()
    assert [present(second, k) for k in keys] == [True, True, False]
    dests = [np.zeros_like(p) for p in payloads[:2]]
    assert load(second, keys[:2], dests) == [True, True]
    assert all(np.array_equal(d, p) for d, p in zip(dests, payloads))


def test_a_newer_kvdepots_object_under_a_long_key_is_left_alone_at_start_up(tmp_path, open_tiers, rng) -> None:
    """Its key is read back from its envelope at start-up: one in a newer format version (a server of a
    later release sharing the disk before a downgrade) must neither stop the tier from starting nor be removed."""
    first = open_tiers(tmp_path)
    key = bytes(16) + b"k" * 300
    store(first, [(key, make_payload(rng, 3000))])
    first.close()
    path = Path(first.path_of(key))
    first.corrupt_for_test(key, 4, mask=envelope.VERSION ^ (envelope.VERSION + 1))
    second = open_tiers(tmp_path)
    assert second.usage().objects == 0 and path.exists()


# --- torn, damaged and vanished files ------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 10, envelope.HEADER_BYTES + 20, -1], ids=["empty", "in_header", "in_key", "last_byte"])
def test_a_torn_file_under_the_real_name_is_a_miss(tmp_path, open_tiers, rng, keep) -> None:
    tier = open_tiers(tmp_path)
    key = make_keys(1)[0]
    payload = make_payload(rng, 9000)
    store(tier, [(key, payload)])
    path = Path(tier.path_of(key))
    data = path.read_bytes()
    path.write_bytes(data[:keep])  # as if a write had been cut short in place

    dest = np.full(9000, 7, np.uint8)
    assert load(tier, [key], [dest]) == [False]
    usage = tier.usage()
    assert (usage.corrupt, usage.objects, usage.healthy) == (1, 0, True)
    assert not path.exists()


def test_a_file_too_short_to_be_an_object_is_removed_at_restart(tmp_path, open_tiers, rng) -> None:
    """A file under a real name shorter than a header and its key (a power loss with fsync off): the
    index took its size as it was, and the payload size it reported was negative (the peer disk built
    a buffer of it and failed every promote of that page, never removing the file)."""
    tier = open_tiers(tmp_path)
    key = make_keys(1)[0]
    store(tier, [(key, make_payload(rng, 9000))])
    tier.close()
    path = Path(tier.path_of(key))
    os.truncate(path, envelope.HEADER_BYTES // 2)
    again = open_tiers(tmp_path)
    assert again.payload_size(key) is None
    assert not path.exists() and again.usage().objects == 0


def test_storing_a_key_again_in_a_full_tier_evicts_nothing(tmp_path, open_tiers, rng) -> None:
    """The new copy replaces the old one at its rename: room was made for the whole new size, and the
    oldest object evicted for nothing (the memory tier, the reference, evicts nothing)."""
    payload, keys = 4000, make_keys(4)
    tier = open_tiers(tmp_path, size_gb=4 * (envelope.HEADER_BYTES + len(keys[0]) + payload) / (1 << 30))  # four objects
    store(tier, [(k, make_payload(rng, payload)) for k in keys])
    newer = make_payload(rng, payload)
    assert store(tier, [(keys[3], newer)]).value == [True]  # a page replaced under its key
    assert [present(tier, k) for k in keys] == [True] * 4
    dest = np.zeros_like(newer)
    assert load(tier, [keys[3]], [dest]) == [True] and np.array_equal(dest, newer)


def test_a_byte_flipped_on_disk_is_a_miss(tmp_path, open_tiers, rng) -> None:
    tier = open_tiers(tmp_path)
    key = make_keys(1)[0]
    store(tier, [(key, make_payload(rng, 9000))])
    path = Path(tier.path_of(key))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert load(tier, [key], [np.zeros(9000, np.uint8)]) == [False]
    assert tier.usage().corrupt == 1 and not path.exists()


def test_an_object_filed_under_another_name_is_a_miss(tmp_path, open_tiers, rng) -> None:
    tier = open_tiers(tmp_path)
    a, b = make_keys(2)
    store(tier, [(a, make_payload(rng, 100)), (b, make_payload(rng, 100))])
    os.replace(tier.path_of(a), tier.path_of(b))  # b's name, a's bytes
    assert load(tier, [b], [np.zeros(100, np.uint8)]) == [False]
    assert tier.usage().corrupt == 1


def test_a_file_removed_behind_its_back_is_a_plain_miss(tmp_path, open_tiers, rng) -> None:
    tier = open_tiers(tmp_path)
    keys = make_keys(2)
    store(tier, [(k, make_payload(rng, 100)) for k in keys])
    os.unlink(tier.path_of(keys[0]))
    assert load(tier, keys, [np.zeros(100, np.uint8) for _ in keys]) == [False, True]
    usage = tier.usage()
    assert (usage.objects, usage.corrupt, usage.healthy) == (1, 0, True)
    assert not present(tier, keys[0])


@pytest.mark.parametrize("wipe", ["contents", "directory"])
def test_a_directory_wiped_behind_its_back_is_misses_and_the_tier_takes_new_objects(tmp_path, open_tiers, rng, wipe) -> None:
    """What is under the tier's directory (or the directory itself) is deleted while the server runs: an
    operator freeing the disk, a tmp cleaner removing directories left empty. What was there is a miss,
    and the tier stores again. Every write into a vanished directory used to fail (ENOENT), so the tier
    went down and stayed down for good, and its index went on naming the lost objects."""
    root = tmp_path / "fs"
    tier = open_tiers(root)
    old = make_keys(4)
    assert store(tier, [(k, make_payload(rng, 100)) for k in old]).value == [True] * 4
    if wipe == "contents":
        for p in root.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    else:
        shutil.rmtree(root)

    new = make_keys(3)
    values = [make_payload(rng, 100) for _ in new]
    r = store(tier, list(zip(new, values)))
    assert r.ok and r.value == [True] * 3, r
    outs = [np.zeros_like(v) for v in values]
    assert lookup(tier, new) == 3 and load(tier, new, outs) == [True] * 3
    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    unlock(tier, new)
    assert [present(tier, k) for k in old] == [False] * 4  # lost with the directory: misses, not claimed
    usage = tier.usage()
    assert (usage.healthy, usage.objects, usage.failures, usage.corrupt) == (True, 3, 0, 0), usage


# --- a full disk -----------------------------------------------------------------------------------


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """Makes every write to a file under ``tmp_path`` fail with ENOSPC after ``allow`` bytes."""
    real_write = os.write
    state = {"allow": 0}

    def write(fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(str(tmp_path)):
            return real_write(fd, data)
        n = min(memoryview(data).nbytes, state["allow"])
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        state["allow"] -= n
        return real_write(fd, memoryview(data)[:n])

    monkeypatch.setattr(os, "write", write)
    return state


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("allow", [0, 100], ids=["at_once", "part_way"])
def test_a_full_disk_refuses_that_object_alone_and_the_tier_shrinks_to_fit(tmp_path, open_tiers, rng, full_disk, o_direct, allow) -> None:
    """A disk that fills before size_gb does: the write is refused and leaves nothing; the tier stays up
    (it used to open its breaker on every write, so the objects it held could not be read either),
    keeps at most what it holds, and makes room for later writes by evicting its own oldest."""
    full_disk["allow"] = 1 << 30  # room for the O_DIRECT probe and a first object
    tier = open_tiers(tmp_path, o_direct=o_direct)
    keep = make_keys(1)[0]
    kept = make_payload(rng, 5000)
    store(tier, [(keep, kept)])
    before = tier.usage()

    full_disk["allow"] = 4096 if o_direct and allow else allow  # O_DIRECT writes whole blocks
    key = make_keys(1)[0]
    r = store(tier, [(key, make_payload(rng, 20_000))])
    assert r.ok and r.value == [False], r
    after = tier.usage()
    assert (after.objects, after.used_bytes, after.stored) == (before.objects, before.used_bytes, before.stored)
    assert after.capacity_bytes == before.used_bytes < before.capacity_bytes
    assert not os.path.exists(tier.path_of(key))
    assert files_under(tmp_path) == [Path(tier.path_of(keep))]  # no temporary file left behind
    out = np.zeros_like(kept)
    assert lookup(tier, [keep]) == 1 and load(tier, [keep], [out]) == [True] and np.array_equal(out, kept)
    unlock(tier, [keep])

    full_disk["allow"] = 1 << 30  # room again: a new object takes the place of the oldest
    newer = make_keys(1)[0]
    assert store(tier, [(newer, make_payload(rng, 5000))]).value == [True]
    assert present(tier, newer) and not present(tier, keep)


def test_a_put_waits_while_another_looks_for_room_and_evicts_nothing_the_disk_holds(
    tmp_path, open_tiers, rng, full_disk, monkeypatch
) -> None:
    """The disk filled (the tier shrank to what it held), then got room again. The first put after that
    looks at the disk's free space; a put on the other worker meanwhile must wait for the answer. It
    used to go on with the old capacity and evict the tier's oldest objects to fit, one per put, for
    as long as the looking thread was off the CPU (here: while its statvfs sleeps)."""
    full_disk["allow"] = 1 << 30
    tier = open_tiers(tmp_path, workers=2)
    held = make_keys(4)
    store(tier, [(k, make_payload(rng, 5000)) for k in held])
    full_disk["allow"] = 0
    assert store(tier, [(make_keys(1)[0], make_payload(rng, 5000))]).value == [False]
    assert tier.usage().capacity_bytes == tier.usage().used_bytes  # shrunk to what it holds

    full_disk["allow"] = 1 << 30
    monkeypatch.setattr(fs_adapter, "ROOM_CHECK_S", 0.05)
    time.sleep(0.1)
    real_statvfs, looking = os.statvfs, threading.Event()

    def slow_statvfs(path):
        if str(path).startswith(str(tmp_path)):
            looking.set()
            time.sleep(0.5)  # the looking thread off the CPU
        return real_statvfs(path)

    monkeypatch.setattr(os, "statvfs", slow_statvfs)
    first, second = make_keys(2)
    t1 = tier.submit_store([(first, memoryview(make_payload(rng, 5000)))])
    assert looking.wait(5)
    t2 = tier.submit_store([(second, memoryview(make_payload(rng, 5000)))])
    assert wait(tier, t1).value == [True] and wait(tier, t2).value == [True]
    assert [present(tier, k) for k in held] == [True] * 4, "objects evicted although the disk had room"
    usage = tier.usage()
    assert usage.objects == 6 and usage.capacity_bytes > usage.used_bytes, usage


def test_a_failed_usage_query_does_not_take_the_tier_down(tmp_path, open_tiers, rng) -> None:
    """/status and /healthcheck ask every tier for its usage: a backend that refuses only that query (a
    Valkey account without INFO, an S3 key without ListBucket) used to open the breaker on each probe,
    so lookups, loads and stores failed while the backend served objects fine."""
    tier = open_tiers(tmp_path)
    key = make_keys(1)[0]
    value = make_payload(rng, 5000)
    store(tier, [(key, value)])
    before = tier.usage()

    def refused():
        raise PermissionError("NOPERM this user has no permissions to run the 'info' command")

    tier._usage = refused
    for _ in range(3):
        during = tier.usage()
        assert during.healthy and during.failures == 0
        assert (during.used_bytes, during.objects) == (before.used_bytes, before.objects)  # the last known
    out = np.zeros_like(value)
    assert lookup(tier, [key]) == 1 and load(tier, [key], [out]) == [True] and np.array_equal(out, value)
    unlock(tier, [key])


# --- O_DIRECT --------------------------------------------------------------------------------------


def test_o_direct_refused_by_the_filesystem_fails_start_clearly(tmp_path, open_tiers, monkeypatch) -> None:
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    tier = open_tiers(tmp_path, start=False, o_direct=True)
    with pytest.raises(ValueError, match="does not support O_DIRECT.*o_direct=false"):
        tier.start()
    assert adapter_threads(tier) == []
    monkeypatch.undo()
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []
    open_tiers(tmp_path, o_direct=False)  # the directory was released


_GROW_UNDER_A_LIMIT = """
import os, resource, sys
import numpy as np
from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
from kvdepot.types import ObjectKey

def mapped():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

tier = FsAdapter("fs", FsConfig(path=sys.argv[1], o_direct=True, fsync=False, workers=1))
tier.start()
small, big = np.full(10_000, 7, np.uint8), np.full(64 << 20, 9, np.uint8)
keys = [ObjectKey(bytes([i]) * 48) for i in range(3)]
tier.put_now(keys[0], memoryview(small))  # this thread's O_DIRECT buffer: a few KiB
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (mapped() + (16 << 20), hard))  # no room for a 64 MiB buffer
try:
    tier.put_now(keys[1], memoryview(big))
    print("big stored")
except OSError as exc:
    print("big refused:", exc)
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # memory is back
tier.put_now(keys[2], memoryview(small))
out = np.zeros_like(small)
assert tier.get_now(keys[2], memoryview(out)) and np.array_equal(out, small)
print("small stored again")
tier.close()
"""


def test_an_o_direct_buffer_that_cannot_grow_leaves_the_worker_able_to_write(tmp_path) -> None:
    """A worker's O_DIRECT buffer grows for a bigger object; when the new mapping failed (ENOMEM: a host
    or a container short of memory), the old one was already closed and still the worker's: every
    later write on that worker raised "mmap closed or invalid", even once memory was back, and the
    tier went down and stayed down. Run under a real address-space limit, in a process of its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GROW_UNDER_A_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "big refused: [Errno 12]" in done.stdout, done.stdout + done.stderr  # the limit did bite
    assert done.returncode == 0 and "small stored again" in done.stdout, done.stderr


def test_o_direct_on_tmpfs(open_tiers, rng, tmp_path_factory) -> None:
    """tmpfs refused O_DIRECT before Linux 6.6; either start fails clearly or the tier works."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = shm / f"kvdepot-fs-test-{os.getpid()}-{random.randrange(1 << 30)}"
    try:
        tier = open_tiers(path, start=False, o_direct=True)
        try:
            tier.start()
        except ValueError as exc:
            assert "does not support O_DIRECT" in str(exc)
            return
        key = make_keys(1)[0]
        payload = make_payload(rng, 10_000)
        store(tier, [(key, payload)])
        dest = np.zeros_like(payload)
        assert load(tier, [key], [dest]) == [True] and np.array_equal(dest, payload)
        tier.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- concurrency ---------------------------------------------------------------------------------


def test_concurrent_stores_and_evictions_keep_disk_and_index_in_step(tmp_path, open_tiers, rng) -> None:
    """Four workers storing overlapping keys into a tier that holds a fraction of them: afterwards
    every file is indexed, every indexed object is on disk and loads, and the byte count is exact."""
    size = 3000
    keys = make_keys(24)
    capacity = 10 * (envelope.HEADER_BYTES + len(keys[0]) + size)
    tier = open_tiers(tmp_path, size_gb=capacity / (1 << 30), workers=4, fsync=False)
    payloads = {k: make_payload(rng, size) for k in keys}
    order = random.Random(5)
    ids = []
    for _ in range(40):
        batch = order.sample(keys, 3)
        ids.append(tier.submit_store([(k, memoryview(payloads[k])) for k in batch]))
    for task_id in ids:
        assert wait(tier, task_id).ok

    on_disk = files_under(tmp_path)
    usage = tier.usage()
    assert usage.objects == len(on_disk) <= 10
    assert usage.used_bytes == sum(p.stat().st_size for p in on_disk)
    held = [k for k in keys if present(tier, k)]
    assert sorted(Path(tier.path_of(k)) for k in held) == on_disk
    dests = [np.zeros(size, np.uint8) for _ in held]
    assert load(tier, held, dests) == [True] * len(held)
    assert all(np.array_equal(d, payloads[k]) for d, k in zip(dests, held))
