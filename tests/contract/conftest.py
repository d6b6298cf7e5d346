"""Fixtures for the L2 contract suite: ``make_adapter``/``adapter``, parametrized over every adapter.

memory and fs are built here (fs under ``tmp_path``). valkey and s3 need real servers; their factories
come from ``tests/contract/backends.py`` as fixtures ``valkey_adapter_factory`` and
``s3_adapter_factory``: each is a callable ``(name: str) -> adapter`` returning an *unstarted* adapter
(these fixtures start and close it). Where that module is missing or broken, the valkey and s3 cases
fail with the reason: a missing backend is an error, never a silent skip.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig

KINDS = ["memory", "fs", "valkey", "s3"]
SERVER_KINDS = ("valkey", "s3")
DEFAULT_CAPACITY = 256 << 20

# ``pytest_plugins`` is only honoured in the rootdir conftest, so the backends' fixtures are imported
# into this module's namespace instead (pytest collects fixtures from a conftest's attributes).
_BACKENDS = Path(__file__).with_name("backends.py")
BACKENDS_ERROR = ""
if not _BACKENDS.exists():
    BACKENDS_ERROR = "tests/contract/backends.py missing: it must define valkey_adapter_factory and s3_adapter_factory"
else:
    try:
        _module = importlib.import_module(".backends", __package__)
    except Exception as exc:  # reported by the valkey/s3 cases; memory and fs still run
        BACKENDS_ERROR = f"tests/contract/backends.py failed to import: {type(exc).__name__}: {exc}"
    else:
        _public = getattr(_module, "__all__", None) or [n for n in vars(_module) if not n.startswith("_")]
        globals().update({n: getattr(_module, n) for n in _public if n not in globals()})


def _missing_factory(kind: str) -> Callable[[], None]:
    why = BACKENDS_ERROR or f"tests/contract/backends.py defines no {kind}_adapter_factory fixture"

    @pytest.fixture(name=f"{kind}_adapter_factory")
    def factory() -> None:
        pytest.fail(why, pytrace=False)

    return factory


if "valkey_adapter_factory" not in globals():
    valkey_adapter_factory = _missing_factory("valkey")
if "s3_adapter_factory" not in globals():
    s3_adapter_factory = _missing_factory("s3")


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
