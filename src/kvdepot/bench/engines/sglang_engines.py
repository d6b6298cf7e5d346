"""Real SGLang servers (CPU) for the SGLang backend's tests and benchmark.

SGLang lives in its own venv, ``.venv-sglang`` (``scripts/install-sglang.sh``: SGLang's pins and a
CPU torch, with the import-time shims ``tests/e2e/sglang/README.md`` explains); the tests, in the main
venv, start ``python -m sglang.launch_server`` from there and talk HTTP to it. The model is the same
kind of random-weight Llama the vLLM tests use (``vllm_engines.make_tiny_model``), served in bfloat16.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvdepot.bench.engines.vllm_engines import ModelShape, interrupt_group
from kvdepot.bench.serverproc import free_port, wait_healthy

# The checkout (src/kvdepot/bench/engines/ -> its root; kvdepot is installed editable): .venv-sglang and
# tests/e2e/sglang/inproc_worker.py live there. KVDEPOT_SGLANG_VENV names another SGLang venv.
REPO = Path(__file__).resolve().parents[4]
SGLANG_VENV = Path(os.environ.get("KVDEPOT_SGLANG_VENV", REPO / ".venv-sglang"))
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
INPROC_WORKER = REPO / "tests" / "e2e" / "sglang" / "inproc_worker.py"
PAGE = 64  # SGLang's page size in these tests: one page is one kvdepot chunk
SGLANG_SHAPE = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2)  # bf16 KV: 1 KiB a token, 64 KiB a page


def require_sglang() -> None:
    """Fail the calling test (never skip it) where SGLang's venv is missing."""
    import pytest

    if not SGLANG_PYTHON.exists():
        pytest.fail(f"SGLang is not installed ({SGLANG_PYTHON} is missing); run scripts/install-sglang.sh", pytrace=False)


def backend_config(url: str, interface_v1: int = 1, **extra) -> dict:
    """``--hicache-storage-backend-extra-config`` for kvdepot, as a user writes it."""
    return {
        "backend_name": "kvdepot",
        "module_path": "kvdepot.connectors.sglang",
        "class_name": "KVDepotHiCacheStorage",
        "interface_v1": interface_v1,
        "url": url,
        **extra,
    }


def sglang_env(workdir: Path) -> dict[str, str]:
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    return {
        **env,
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TMPDIR": str(workdir / "tmp"),
        # SGLang JIT-compiles its page hasher once per venv; keep that build with the venv, not in $HOME.
        "TORCH_EXTENSIONS_DIR": str(SGLANG_VENV / "torch-extensions"),
        "SGLANG_DISABLE_REQUEST_LOGGING": "1",
    }


class SGLangDied(RuntimeError):
    pass


@dataclass
class SGLangServer:
    """One ``sglang.launch_server`` process with HiCache on; ``storage`` is ``"kvdepot"`` (with
    ``extra``), ``"file"`` (SGLang's own file backend in ``workdir``), or None (no L3)."""

    model_path: str
    workdir: Path
    name: str = "sglang"
    storage: str | None = "kvdepot"
    extra: dict = field(default_factory=dict)
    max_total_tokens: int = 8192
    dtype: str = "bfloat16"
    layout: str = "layer_first"
    page_size: int = PAGE
    prefetch_policy: str = "timeout"  # SGLang's default, and what README recommends
    io_backend: str = "direct"  # the one that works on a CPU
    admin_api_key: str = ""  # needed for runtime attach/detach
    probe: Path | None = None  # time SGLang's storage calls, H2D loads and forwards into this file (sglang_probe)
    port: int = 0
    host: str = "127.0.0.1"
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]: SGLang on another host
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [
            str(SGLANG_PYTHON), "-m", "sglang.launch_server",
            "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype,
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph",
            "--max-total-tokens", str(self.max_total_tokens),
            "--page-size", str(self.page_size), "--enable-cache-report", "--skip-server-warmup",
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", self.io_backend,
            "--hicache-mem-layout", self.layout,
        ]  # fmt: skip
        if self.admin_api_key:
            cmd += ["--admin-api-key", self.admin_api_key]
        if self.storage is not None:
            cmd += ["--hicache-storage-prefetch-policy", self.prefetch_policy, "--hicache-storage-backend"]
            if self.storage == "kvdepot":
                cmd += ["dynamic", "--hicache-storage-backend-extra-config", self.extra_json()]
            else:
                cmd += [self.storage]
        return cmd

    def extra_json(self) -> str:
        return json.dumps(self.extra)

    def start(self, timeout_s: float = 240.0) -> SGLangServer:
        require_sglang()
        self.port = self.port or free_port()
        env = sglang_env(self.workdir)
        if self.storage == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.workdir / f"{self.name}-file-l3")
        if self.probe is not None:
            from kvdepot.bench.engines.sglang_probe import probe_env

            env = probe_env(self.probe, env)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.prefix, *self.command()], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        why = wait_healthy(self.proc, f"{self.url}/health", timeout_s)
        if why:
            self.stop()
            raise SGLangDied(f"SGLang {self.name} {why} at start:\n{self.log_tail()}")
        return self

    def generate(self, input_ids: list[int], max_new_tokens: int = 8, timeout_s: float = 300.0) -> dict:
        """Greedy generation; returns SGLang's JSON (``output_ids``, ``meta_info`` with
        ``cached_tokens`` and ``cached_tokens_details``) plus ``seconds``, the request's latency."""
        self.check_alive()
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/generate", json=body, timeout=timeout_s)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        out = r.json()
        out["seconds"] = seconds
        return out

    def flush_cache(self) -> None:
        """Empty SGLang's device and host tiers (never L3)."""
        deadline = time.monotonic() + 60.0
        while True:
            self.check_alive()
            r = httpx.post(f"{self.url}/flush_cache", headers=self.admin_headers(), timeout=60.0)
            # SGLang refuses while work is pending (a request's backup to L3 still running): wait for it.
            if r.status_code != 400 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        r.raise_for_status()

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"} if self.admin_api_key else {}

    def admin(self, method: str, path: str, body: dict | None = None, timeout_s: float = 120.0) -> httpx.Response:
        """An admin call (the admin key is sent when the server has one)."""
        self.check_alive()
        return httpx.request(method, f"{self.url}{path}", json=body, headers=self.admin_headers(), timeout=timeout_s)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise SGLangDied(f"SGLang {self.name} is not running:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the launcher only (it stops its scheduler and detokenizer), then SIGKILL for
        whatever of its session is left."""
        proc, self.proc = self.proc, None
        interrupt_group(proc, grace_s, signal.SIGTERM)


def storage_tokens(reply: dict) -> int:
    """How many of a request's prompt tokens SGLang took from L3 (its cache report)."""
    details = reply["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0)


def run_inproc(url: str, scenario: str, args: dict | None = None, timeout_s: float = 300.0) -> dict:
    """Run ``inproc_worker.py SCENARIO`` in SGLang's venv against the kvdepot at ``url``."""
    require_sglang()
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(INPROC_WORKER), scenario, url, json.dumps(args or {})],
        capture_output=True, text=True, timeout=timeout_s, env=sglang_env(Path(os.environ.get("TMPDIR", "/tmp")) / "kvdepot-sglang-inproc"),
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"inproc_worker {scenario} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))
