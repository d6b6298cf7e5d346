"""End-to-end fixtures: a real ``kvdepot server`` sized for vLLM's 128-token blocks, and a work
directory for the engines' logs. The engines themselves, the tiny model and the prompts are the shared
harness's (``kvdepot.bench.engines.vllm_engines``, the ``tiny_model`` fixture in ``support.plugin``).

These tests need vLLM (``scripts/install-vllm.sh``): without it they fail, they do not skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.bench.engines.vllm_engines import BLOCK

from support import shm_janitor
from support.servers import start_server, stop_server

VLLM_SERVER = ("--chunk-size", str(BLOCK), "--l1-size-gb", "1", "--no-prefault")  # the default lease TTL


@pytest.fixture(scope="module", autouse=True)
def dev_shm_as_found():
    """Set up before, and so torn down after, every engine and server of the module: what the module's
    engines left in /dev/shm is removed, and anything else it left there fails it."""
    before = shm_janitor.entries()
    yield
    leaked = shm_janitor.sweep(before)
    assert not leaked, f"this module left files in /dev/shm: {leaked}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("kvdepot-server"), "server", ["--log-level", "info"], ipc=False, base=VLLM_SERVER)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")
