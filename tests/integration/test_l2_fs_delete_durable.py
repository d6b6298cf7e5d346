"""The fs tier's deletes are as durable as its writes: the directory an object was unlinked from is
fsync'd before the delete (or clear) is reported done, so a power loss cannot bring it back. Counted
through a wrapped ``os.fsync`` that records which directories were synced, and whether the object's
file was already gone at that moment."""

from __future__ import annotations

import os
import stat

import pytest

from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig

from support.adapter_tasks import run, store


@pytest.fixture
def tier(tmp_path):
    adapter = FsAdapter("f", FsConfig(path=str(tmp_path / "fs"), size_gb=0.01, workers=1))
    adapter.start()
    yield adapter
    adapter.close()


@pytest.fixture
def dir_syncs(monkeypatch) -> list[tuple[str, set[str]]]:
    """Every directory fsync from now on: (the directory, the names it held when synced)."""
    synced: list[tuple[str, set[str]]] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            path = os.readlink(f"/proc/self/fd/{fd}")
            synced.append((path, set(os.listdir(path))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    return synced


def _synced_after_unlink(synced: list[tuple[str, set[str]]], path: str) -> int:
    """How many fsyncs of ``path``'s directory saw it already unlinked."""
    directory, name = os.path.split(path)
    return sum(1 for d, names in synced if d == directory and name not in names)


@pytest.mark.parametrize("how", ["delete", "clear", "delete_now"])
def test_an_fs_delete_fsyncs_the_directory_it_unlinked_from(tier, dir_syncs, how) -> None:
    keys = [os.urandom(48) for _ in range(3)]
    for key in keys:
        assert store(tier, key, os.urandom(1000)).value == [True]
    paths = [tier.path_of(k) for k in keys]
    assert all(os.path.exists(p) for p in paths)
    dir_syncs.clear()  # only what the delete syncs counts
    if how == "delete":
        assert run(tier, tier.submit_delete(keys)).value == 3
    elif how == "clear":
        assert run(tier, tier.submit_clear()).value == 3
    else:
        for key in keys:
            tier.delete_now(key)
    assert not any(os.path.exists(p) for p in paths)
    for path in paths:
        assert _synced_after_unlink(dir_syncs, path) >= 1, f"{path}'s directory was not fsync'd after its unlink"


def test_a_delete_of_nothing_syncs_nothing(tier, dir_syncs) -> None:
    """Only directories a delete changed are synced: deleting absent keys costs no fsync."""
    assert run(tier, tier.submit_delete([os.urandom(48) for _ in range(3)])).value == 0
    assert dir_syncs == []
