"""A real headless Chromium (Debian's ``chromium``) for the tests that look at pages: load a URL, let the
page run for a budget of virtual time (timers fire, fetches to the server really happen; virtual time
waits for them), then dump the DOM or take a screenshot. One short-lived browser per call, its own
profile, no background networking."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest


def chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is not installed: bash scripts/install-test-servers.sh", pytrace=False)
    return browser


def _run(url: str, budget_ms: int, *extra: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="kvd-chromium-") as profile:
        cmd = [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *extra, url,
        ]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def dump_dom(url: str, budget_ms: int = 6000) -> str:
    return _run(url, budget_ms, "--dump-dom").stdout


def screenshot(url: str, path: Path, budget_ms: int = 6000, size: tuple[int, int] = (1400, 1000)) -> Path:
    r = _run(url, budget_ms, f"--window-size={size[0]},{size[1]}", f"--screenshot={path}")
    assert path.exists(), f"chromium wrote no screenshot: {r.stderr[-2000:]}"
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


class _Metrics(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if "data-metric" in a:
            name = a["data-metric"]
            assert name not in self.found, f"two elements show data-metric={name!r}"
            self.found[name] = a.get("data-value", "")


def shown_metrics(dom: str) -> tuple[dict[str, str], dict[str, str]]:
    """Every ``data-metric`` of a page with its ``data-value``, and the attributes of its ``<body>``."""
    p = _Metrics()
    p.feed(dom)
    return p.found, p.body
