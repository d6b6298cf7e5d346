"""Take the README's dashboard screenshot: a real server under a small, varying workload, watched by a
real headless Chromium for ~30 s of real time (the charts fill as the page polls), then one PNG.

    PYTHONPATH=src:tests python scripts/dashboard_screenshot.py docs/images/dashboard.png

Drives Chromium through its DevTools protocol (``websockets``, which uvicorn already brings), so the page
runs in real time rather than under a virtual-time budget.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx
from support.servers import CHUNK, LAYOUT, make_kv, make_tokens, start_server, stop_server
from websockets.sync.client import connect

WATCH_S = 30


def workload(srv, stop: threading.Event) -> None:
    """Two tenants storing and looking up; the share of repeated prompts grows, so the hit rate climbs."""
    with srv.client(model="llama-demo") as c:
        i = 0
        while not stop.is_set():
            salt = "team-a" if i % 3 else "team-b"
            repeat = i % 10 < min(9, i // 20)
            seed = (i % 7) if repeat else 1000 + i
            t = make_tokens(8 * CHUNK, seed)
            if c.lookup(t, cache_salt=salt) == 0:
                c.store(t, make_kv(LAYOUT, len(t), seed), cache_salt=salt)
            else:
                c.retrieve(t, cache_salt=salt)
            i += 1
            time.sleep(0.02)


def cdp_screenshot(url: str, out: Path, watch_s: float) -> None:
    profile = tempfile.mkdtemp(prefix="kvd-chromium-")
    browser = subprocess.Popen(
        [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,820",
         f"--user-data-dir={profile}", "--remote-debugging-port=0", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        for _ in range(100):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        time.sleep(watch_s)
        with connect(ws_url, max_size=None) as ws:
            ws.send(json.dumps({"id": 1, "method": "Page.captureScreenshot", "params": {"format": "png"}}))
            while True:
                reply = json.loads(ws.recv())
                if reply.get("id") == 1:
                    break
        out.write_bytes(base64.b64decode(reply["result"]["data"]))
    finally:
        browser.terminate()
        browser.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dashboard.png")
    log_dir = Path(tempfile.mkdtemp(prefix="kvd-shot-"))
    srv = start_server(log_dir, "shot", ["--eviction-policy", "isolated_lru", "--l2", "memory:name=ram,size_gb=0.02", "--l1-size-gb", "0.03"])
    try:
        httpx.put(f"{srv.http}/quota/team-b", json={"quota_bytes": 4 << 20}, timeout=10)
        stop = threading.Event()
        worker = threading.Thread(target=workload, args=(srv, stop))
        worker.start()
        try:
            cdp_screenshot(f"{srv.http}/dashboard", out, WATCH_S)
        finally:
            stop.set()
            worker.join()
    finally:
        stop_server(srv)
    print(out)


if __name__ == "__main__":
    main()
