"""Real L2 backends for the tests: configs pointing at a Valkey (or Redis) and an S3 server (SeaweedFS),
and a tmpfs that can fill up. The servers themselves are ``kvdepot.bench.backends``' (the same ones
``kvdepot bench tiers`` runs); the fixtures that start them are in ``plugin.py``. Nothing is skipped for
want of a server binary: a missing one fails with the install step that provides it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from kvdepot.bench.backends import (  # noqa: F401  (for the tests)
    INSTALL_HINT,
    MotoServer,
    ValkeyCluster,
    ValkeyServer,
    WeedServer,
    _unique,
    find_valkey_binary,
    find_weed_binary,
    start_s3,
    start_valkey,
    start_valkey_cluster,
)
from kvdepot.storage.l2.s3_adapter import S3Config
from kvdepot.storage.l2.valkey_adapter import ValkeyConfig


def short_tmpdir(label: str) -> Path:
    """Under /tmp, not pytest's deep tmp_path: weed puts unix sockets here (108-byte path limit)."""
    return Path(tempfile.mkdtemp(prefix=f"kvd-{label}-"))


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


def resize_tmpfs(mount_point: Path, size: str) -> None:
    r = subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
