"""Fixtures of the SGLang end-to-end tests: one kvdepot server with an fs tier (so a restart keeps the
pages), the tiny bf16 model, and one SGLang server shared by the module's tests (starting one takes
20-40 s on two cores). SGLang runs from .venv-sglang: without it these tests fail, they do not skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.bench.engines.sglang_engines import SGLANG_SHAPE, require_sglang
from kvdepot.bench.engines.vllm_engines import make_tiny_model

from support.servers import start_server, stop_server

KVDEPOT_FOR_SGLANG = ("--l1-size-gb", "0.25", "--no-prefault", "--log-level", "info")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tier = tmp_path_factory.mktemp("fs-tier")
    s = start_server(tmp_path_factory.mktemp("kvdepot-server"), "server", ["--l2", f"fs:path={tier}"], ipc=False, base=KVDEPOT_FOR_SGLANG)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def sglang_model(tmp_path_factory):
    require_sglang()
    return make_tiny_model(tmp_path_factory.mktemp("sglang-model") / "model", SGLANG_SHAPE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang")
