"""The admin port cannot be driven by a web page.

Any page open in a browser on the machine can send a CORS "simple request" (a POST with
``Content-Type: text/plain`` needs no preflight) to 127.0.0.1, and a DNS-rebinding page reaches it under
its own host name. Mutating endpoints therefore accept only ``application/json`` and no foreign
``Origin``; every endpoint checks ``Host``; no page pulls scripts from a CDN. The last test drives a real
headless Chromium through a hostile page served from another origin.
"""

from __future__ import annotations

import http.server
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens


@pytest.fixture
def stored(server, seed):
    """A few objects in the shared server, so a clear that got through would show."""
    with server.client() as c:
        tokens = make_tokens(3 * CHUNK, seed)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 3 * CHUNK
        yield c, tokens


def test_a_simple_cross_origin_post_cannot_clear_the_cache(server, stored):
    c, tokens = stored
    r = httpx.post(
        f"{server.http}/cache/clear",
        content=b"x",
        headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
        timeout=10,
    )
    assert r.status_code == 415, r.text
    r = httpx.post(f"{server.http}/cache/clear", json={}, headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 403, r.text
    r = httpx.post(f"{server.http}/cache/clear", json={}, headers={"Origin": "http://127.0.0.1:1"}, timeout=10)
    assert r.status_code == 403, "another local port is another origin"
    assert c.lookup(tokens) == 3 * CHUNK, "the cache was cleared"
    # The server's own origin, or no Origin at all (curl, the kvdepot CLI), with JSON: allowed.
    own = f"http://127.0.0.1:{server.http_port}"
    assert httpx.post(f"{server.http}/cache/clear", json={}, headers={"Origin": own}, timeout=10).status_code == 200
    assert c.lookup(tokens) == 0


@pytest.mark.parametrize("method, path", [("GET", "/status"), ("GET", "/healthcheck"), ("POST", "/cache/clear"), ("PUT", "/quota/x")])
def test_a_foreign_host_header_is_refused_everywhere(server, stored, method, path):
    """DNS rebinding: the page's own domain resolves to 127.0.0.1, so its requests carry that Host."""
    c, tokens = stored
    r = httpx.request(method, f"{server.http}{path}", json={}, headers={"Host": f"rebind.example:{server.http_port}"}, timeout=10)
    assert r.status_code == 421, r.text
    assert c.lookup(tokens) == 3 * CHUNK
    for host in (f"127.0.0.1:{server.http_port}", f"localhost:{server.http_port}"):
        assert httpx.get(f"{server.http}/healthcheck", headers={"Host": host}, timeout=10).status_code == 200


def test_no_page_loads_scripts_from_elsewhere(server):
    for path in ("/docs", "/redoc"):
        assert httpx.get(f"{server.http}{path}", timeout=10).status_code == 404
    spec = httpx.get(f"{server.http}/openapi.json", timeout=10)
    assert spec.status_code == 200 and "cdn" not in spec.text.lower()


HOSTILE_PAGE = """<!doctype html><html><body><script>
(async () => {
  const out = [];
  try {
    await fetch("ADMIN/cache/clear", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: "x"});
    out.push("simple-sent");
  } catch (e) { out.push("simple-error"); }
  try {
    const r = await fetch("ADMIN/cache/clear", {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"});
    out.push("json-" + r.status);
  } catch (e) { out.push("json-blocked"); }
  document.body.setAttribute("data-result", out.join(","));
})();
</script></body></html>"""


def test_a_hostile_page_in_a_real_browser_cannot_clear_the_cache(server, stored, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is not installed: bash scripts/install-test-servers.sh", pytrace=False)
    c, tokens = stored
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(HOSTILE_PAGE.replace("ADMIN", server.http))
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(site), **kw)  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvd-chromium-") as profile:
            dom = subprocess.run(
                [
                    browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom",
                    f"http://127.0.0.1:{web.server_address[1]}/index.html",
                ],
                capture_output=True, text=True, timeout=120,
            ).stdout
    finally:
        web.shutdown()
    assert c.lookup(tokens) == 3 * CHUNK, "a web page cleared the cache"
    # The page did run: the simple request went out (opaque to the page), the JSON one was blocked by
    # CORS (no preflight is ever granted) ...
    assert 'data-result="simple-sent,json-blocked"' in dom, dom[-2000:]
    # ... and the simple one reached the server, which refused it.
    assert "admin API refused POST /cache/clear" in Path(server.log_path).read_text(errors="replace")
