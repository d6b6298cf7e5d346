"""Every command and snippet of README's vLLM and SGLang sections, run as printed, in order.

The README marks each runnable block with ``<!-- readme-test: NAME -->`` (``(background)`` for a server a
reader starts in its own terminal; a name ending in ``.py`` is a file the reader saves). This test takes
the blocks from README.md itself, so an example cannot drift from what is tested. They run from a
directory laid out like the checkout (``.venv`` and ``.venv-sglang`` linked in), on the ports README
uses, and the test checks the lines README says they print: the hit.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from kvdepot.bench.engines.vllm_engines import require_vllm
from kvdepot.bench.serverproc import wait_healthy

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- readme-test: (?P<name>\S+)(?P<bg> \(background\))? -->\n```(?P<lang>\w+)\n(?P<code>.*?)```", re.S)
PORTS = {"kvdepot": 5555, "kvdepot HTTP": 8080, "vLLM": 8000, "SGLang": 30000}
CLUSTER_PORTS = {"peer head": 31995, "peer head data": 31996, "server A": 5601, "server B": 5602, "server A HTTP": 8601,
                 "server B HTTP": 8602, "head metrics": 31997, "server A metrics": 31991, "server B metrics": 31992,
                 **{f"peer node {p}": p for p in range(31981, 31989)}}  # fmt: skip


def readme_blocks() -> dict[str, tuple[str, bool]]:
    return {m["name"]: (m["code"], bool(m["bg"])) for m in BLOCK.finditer((REPO / "README.md").read_text())}


class Shell:
    """Runs README blocks with bash in ``cwd``; background ones in their own process group, all stopped
    (with their children) at the end."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.background: list[tuple[str, subprocess.Popen]] = []

    def run(self, name: str, code: str, timeout_s: float = 600) -> str:
        r = subprocess.run(["bash", "-c", code], cwd=self.cwd, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            (self.cwd / f"{name}.out").write_text(r.stdout + r.stderr)  # whole, for the tmp dir pytest keeps
            first = r.stdout.find("Traceback")  # an engine's root cause comes first; its tail says only "failed"
            cause = f"first traceback:\n{r.stdout[first : first + 4000]}\n...\n" if 0 <= first < len(r.stdout) - 2000 else ""
            pytest.fail(f"README block {name!r} failed ({r.returncode}):\n{cause}{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return r.stdout

    def start(self, name: str, code: str) -> None:
        log = open(self.cwd / f"{name}.log", "wb")
        proc = subprocess.Popen(["bash", "-c", code], cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.background.append((name, proc))

    def wait_healthy(self, name: str, url: str, timeout_s: float = 300) -> None:
        why = wait_healthy(dict(self.background)[name], url, timeout_s)
        if why:
            pytest.fail(f"{name} {why}:\n{self.log(name)[-4000:]}")

    def log(self, name: str) -> str:
        return (self.cwd / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for _, proc in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the reader's terminal does
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of it
            except ProcessLookupError:
                pass
            proc.wait()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def shell(tmp_path):
    for what, port in {**PORTS, **CLUSTER_PORTS}.items():
        if not port_free(port):
            pytest.fail(f"port {port} ({what}), which README's examples use, is taken on this machine", pytrace=False)
    work = tmp_path / "checkout"
    work.mkdir()
    for venv in (".venv", ".venv-sglang"):
        (work / venv).symlink_to(REPO / venv)
    sh = Shell(work)
    yield sh
    sh.stop()


def test_readme_marks_every_engine_example():
    names = set(readme_blocks())
    assert names == {
        "model", "kvdepot-server", "vllm_offline.py", "vllm-offline-run", "vllm-server", "vllm-requests", "status",
        "sglang-server", "sglang-requests",
        "peer-head", "peer-server-a", "peer-server-b", "peer_servers.py", "peer-servers-run", "peer_store.py", "peer-store-run",
    }, names  # fmt: skip


def test_the_cluster_examples_run_as_printed(shell):
    """README's "Running a cluster": a head, two servers with peer tiers, KV stored on one served by the
    other; then PeerStore in Python."""
    blocks = readme_blocks()
    for name, (code, _) in blocks.items():
        if name.endswith(".py"):
            (shell.cwd / name).write_text(code)
    shell.start("peer-head", blocks["peer-head"][0])
    shell.start("peer-server-a", blocks["peer-server-a"][0])
    shell.start("peer-server-b", blocks["peer-server-b"][0])
    shell.wait_healthy("peer-server-a", "http://127.0.0.1:8601/healthcheck", timeout_s=60)
    shell.wait_healthy("peer-server-b", "http://127.0.0.1:8602/healthcheck", timeout_s=60)
    out = shell.run("peer-servers-run", blocks["peer-servers-run"][0], timeout_s=120)
    lines = out.splitlines()
    assert lines[:2] == ["stored on A: 1024 tokens", "served by B: 1024 tokens, identical: True"], out
    assert "3 members" in out and "master" in out, out
    import httpx

    assert "kvdepot_peer_writes_total" in httpx.get("http://127.0.0.1:31991/metrics", timeout=5).text  # server A's node
    out = shell.run("peer-store-run", blocks["peer-store-run"][0], timeout_s=120)
    assert out.splitlines() == ["b finds it: 1", "b reads it: True"], out


def test_the_vllm_and_sglang_examples_run_as_printed_and_hit(shell):
    require_vllm()
    blocks = readme_blocks()
    for name, (code, background) in blocks.items():
        if name.endswith(".py"):
            (shell.cwd / name).write_text(code)

    shell.run("model", blocks["model"][0])
    shell.start("kvdepot-server", blocks["kvdepot-server"][0])
    shell.wait_healthy("kvdepot-server", f"http://127.0.0.1:{PORTS['kvdepot HTTP']}/healthcheck", timeout_s=60)

    # vLLM offline: the second request of the run comes from kvdepot, with the same output
    out = shell.run("vllm-offline-run", blocks["vllm-offline-run"][0])
    cold, again = [line for line in out.splitlines() if line.startswith(("cold:", "again:"))]
    assert cold.startswith("cold: 0 of 2000 prompt tokens from cache"), out
    assert again.startswith("again: 1792 of 2000 prompt tokens from cache"), out
    assert cold.split("output ", 1)[1] == again.split("output ", 1)[1], out

    # vLLM's OpenAI server: the same request twice, the second from kvdepot
    shell.start("vllm-server", blocks["vllm-server"][0])
    shell.wait_healthy("vllm-server", f"http://127.0.0.1:{PORTS['vLLM']}/health")
    out = shell.run("vllm-requests", blocks["vllm-requests"][0])
    assert out.splitlines() == ["0 of 2000 prompt tokens from cache", "1792 of 2000 prompt tokens from cache"], out
    assert "1792 of its 1792 cacheable tokens found (1792 in L1, 0 from L2), 1792 loaded" in shell.log("vllm-server")
    assert re.search(r"saved 7 chunks \([\d.]+ MiB\) in [\d.]+ ms: slots [\d.]+ ms, copy out of blocks [\d.]+ ms", shell.log("vllm-server"))

    out = shell.run("status", blocks["status"][0])
    assert "hit rate" in out and "kvdepot" in out, out

    # SGLang: a prompt, SGLang's own caches emptied, the prompt again from kvdepot
    shell.start("sglang-server", blocks["sglang-server"][0])
    shell.wait_healthy("sglang-server", f"http://127.0.0.1:{PORTS['SGLang']}/health")
    out = shell.run("sglang-requests", blocks["sglang-requests"][0])
    assert out.splitlines() == ["960 of 1000 prompt tokens from kvdepot"], out
