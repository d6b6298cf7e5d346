"""Fixtures for the L2 contract suite: ``make_adapter``/``adapter``, parametrized over every adapter.

memory, fs and peer (a one-node cluster on free ports) are built here (fs under ``tmp_path``). valkey (one server, and a 3-primary cluster) and s3
need real servers: their factories are the harness's ``valkey_adapter_factory``,
``valkey_cluster_adapter_factory`` and ``s3_adapter_factory`` (``support.plugin``), each a
callable ``(name: str) -> adapter`` returning an *unstarted* adapter against a real server. A missing
server binary fails those cases with the install step: a missing backend is an error, never a skip.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.peer.adapter import PeerAdapter
from kvdepot.peer.config import PeerConfig
from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig

KINDS = ["memory", "fs", "valkey", "valkey_cluster", "s3", "peer"]
SERVER_KINDS = ("valkey", "valkey_cluster", "s3")
DEFAULT_CAPACITY = 256 << 20


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_adapter(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., object]]:
    """``make(capacity_bytes=None)`` -> an unstarted adapter of this case's kind, closed at teardown.

    ``capacity_bytes`` sizes memory and fs tiers; a server-backed adapter has whatever bound its
    backend gives it (tests that need a bound check ``usage().capacity_bytes``)."""
    backend_factory = request.getfixturevalue(f"{kind}_adapter_factory") if kind in SERVER_KINDS else None
    counter = itertools.count()
    built: list = []

    def make(capacity_bytes: int | None = None):
        name = f"{kind}-t{next(counter)}"
        size_gb = (capacity_bytes or DEFAULT_CAPACITY) / (1 << 30)  # exact: a power-of-two divisor
        if kind == "memory":
            adapter = MemoryAdapter(name, MemoryConfig(size_gb=size_gb))
        elif kind == "fs":
            adapter = FsAdapter(name, FsConfig(path=str(tmp_path / name), size_gb=size_gb))
        elif kind == "peer":  # a one-node cluster: reads are local pool copies (tests/peer covers the network)
            adapter = PeerAdapter(name, PeerConfig(port=0, data_port=0, metrics_port=0, pool_size_mb=max(1, (capacity_bytes or DEFAULT_CAPACITY) >> 20)))
        else:
            assert backend_factory is not None
            adapter = backend_factory(name)
        built.append(adapter)
        return adapter

    yield make
    for adapter in built:
        if adapter.eventfd >= 0:
            adapter.close()
    left = [t.name for t in threading.enumerate() for a in built if t.name.startswith(f"kvdepot-l2-{a.name}")]
    assert not left, f"threads left behind after close(): {left}"


@pytest.fixture
def adapter(make_adapter: Callable[..., object]):
    """A started adapter of each kind (closed, and checked for leftover threads, at teardown)."""
    a = make_adapter()
    a.start()
    return a
