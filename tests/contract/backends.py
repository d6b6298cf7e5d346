"""Real backend servers for the L2 tests: a Valkey (or Redis) server and an S3 server (SeaweedFS).

Each server is a child process on free loopback ports, in its own temporary directory, started by a
fixture and stopped at its end. Nothing is skipped: a missing server binary fails the test with the
install step that provides it (``scripts/install-test-servers.sh`` and the ``test`` extras).

Fixtures: ``valkey_server`` and ``s3_server`` (session-scoped, shared), and the factories
``valkey_adapter_factory`` and ``s3_adapter_factory``: ``make(name, **config_overrides)`` returns an
unstarted adapter against the shared server, under a prefix no other call uses; every adapter a
factory made is closed when the test ends (closing twice is harmless).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.bench.backends import (  # noqa: F401  (re-exported for the tests)
    INSTALL_HINT,
    MotoServer,
    ValkeyServer,
    WeedServer,
    find_valkey_binary,
    find_weed_binary,
    free_port,
    start_s3,
    start_valkey,
    _unique,
)
from kvdepot.storage.l2.s3_adapter import S3Adapter, S3Config
from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter, ValkeyConfig


# --- fixtures ----------------------------------------------------------------------------------------


def short_tmpdir(label: str) -> Path:
    """Under /tmp, not pytest's deep tmp_path: weed puts unix sockets here (108-byte path limit)."""
    return Path(tempfile.mkdtemp(prefix=f"kvd-{label}-"))


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyServer]:
    workdir = short_tmpdir("valkey")
    server = start_valkey(workdir)
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[WeedServer | MotoServer]:
    workdir = short_tmpdir("s3")
    server = start_s3(workdir)
    yield server
    server.kill()  # its data is thrown away; a graceful weed shutdown takes seconds
    shutil.rmtree(workdir, ignore_errors=True)


def _token() -> str:
    return f"{os.getpid():x}-{next(_unique)}"


def valkey_config(url: str, **overrides: object) -> ValkeyConfig:
    options: dict[str, object] = {"url": url, "prefix": f"kvt-{_token()}:", "socket_timeout_s": 2.0}
    options.update(overrides)
    return ValkeyConfig(**options)  # type: ignore[arg-type]


def s3_config(endpoint: str, **overrides: object) -> S3Config:
    options: dict[str, object] = {
        "bucket": "kvdepot-test",
        "prefix": f"t-{_token()}/",
        "endpoint_url": endpoint,
        "access_key_id": "kvdepot",
        "secret_access_key": "kvdepot-secret",
        "create_bucket": True,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 10.0,
        "max_attempts": 1,
    }
    options.update(overrides)
    return S3Config(**options)  # type: ignore[arg-type]


@pytest.fixture
def valkey_adapter_factory(valkey_server: ValkeyServer) -> Iterator[Callable[..., ValkeyAdapter]]:
    made: list[ValkeyAdapter] = []

    def make(name: str, **overrides: object) -> ValkeyAdapter:
        adapter = ValkeyAdapter(name, valkey_config(valkey_server.url, **overrides))
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


@pytest.fixture
def s3_adapter_factory(s3_server: WeedServer | MotoServer) -> Iterator[Callable[..., S3Adapter]]:
    made: list[S3Adapter] = []

    def make(name: str, **overrides: object) -> S3Adapter:
        adapter = S3Adapter(name, s3_config(s3_server.endpoint, **overrides))
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()
