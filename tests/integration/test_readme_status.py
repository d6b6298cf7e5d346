"""What README.md says ``GET /status`` holds is what a live server's ``/status`` holds: every field its
HTTP API table names in backticks, and every field the rest of README points an operator at."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _status_row() -> str:
    [row] = [line for line in README.splitlines() if line.startswith("| `GET /status` |")]
    return row


# README's words for a field (the /status row's prose, Safety, Configuration, Plugins) -> where it is.
NAMED = {
    "version": "version",
    "chunk size": "chunk_size",
    "l1 capacity": "l1.capacity_bytes",
    "l1 used": "l1.used_bytes",
    "l1 objects": "l1.objects",
    "l1 fragmentation": "l1.fragmentation",
    "prefault state": "l1.prefault.state",
    "prefault progress": "l1.prefault.progress",
    "quota_refused": "l1.quota_refused",
    "leases": "leases",
    "quarantine leases": "quarantine.leases",
    "quarantine bytes": "quarantine.bytes",
    "quarantine per client": "quarantine.clients",
    "contexts": "contexts",
    "sessions": "sessions",
    "clients (active)": "clients",
    "clients_gone exited": "clients_gone.exited",
    "clients_gone revoked": "clients_gone.revoked",
    "request counts": "requests",
    "error counts": "errors",
    "request_failures.lost_before_l2": "request_failures.lost_before_l2",
    "l2_controllers store queue": "l2_controllers.store.queued",
    "l2_controllers dropped": "l2_controllers.store.dropped",
    "l2_controllers prefetch jobs": "l2_controllers.prefetch.jobs",
    "plugins": "plugins",
}
TIER_FIELDS = ("name", "healthy", "last_error", "used_bytes", "objects", "stored", "loaded", "corrupt", "failures", "details")
PLUGIN_FIELDS = ("state", "pid", "restarts")  # "`/status` lists each plugin's state, pid and restarts"


def _at(doc: dict, path: str):
    for part in path.split("."):
        assert isinstance(doc, dict) and part in doc, f"/status has no {path} (README names it)"
        doc = doc[part]
    return doc


def _keys(doc):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield k
            yield from _keys(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _keys(v)


def test_every_status_field_readme_names_is_there(make_server):
    srv = make_server("--l2", "memory:name=mem,size_gb=0.01", "--plugin", "kvdepot.plugins.usage_log:/dev/null --every-s 60")
    status = srv.status()
    for words, path in NAMED.items():
        _at(status, path)
    row = _status_row()
    keys = set(_keys(status))
    missing = [name for name in re.findall(r"`([a-z_0-9]+)`", row) if name not in keys]  # `l1`, `quota_refused`, ...
    assert not missing, f"README's /status row names fields /status does not have: {missing}"
    [tier] = status["tiers"]
    assert all(f in tier for f in TIER_FIELDS), f"a tier's /status lacks {[f for f in TIER_FIELDS if f not in tier]}"
    [plugin] = status["plugins"]
    assert all(f in plugin for f in PLUGIN_FIELDS), plugin
