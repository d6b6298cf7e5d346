"""An arena that shared memory cannot hold is refused at start, with the free space and the flag named;
one that started is reserved page for page, so a full /dev/shm never turns into a SIGBUS in the server
or in a worker. Runs on a real tmpfs (mounting needs root; elsewhere these tests are skipped, visibly).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.backends import resize_tmpfs
from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens


def run_server(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvdepot.cli", "server", "--port", "0", "--http-port", "0", *args]
    with tempfile.TemporaryDirectory(prefix="kvd-") as d:
        return subprocess.run(cmd + ["--ipc-path", os.path.join(d, "s")], capture_output=True, text=True, timeout=timeout)


def test_l1_larger_than_the_shm_filesystem_refuses_to_start(small_tmpfs):
    resize_tmpfs(small_tmpfs, "256m")
    r = run_server("--shm-dir", str(small_tmpfs), "--l1-size-gb", "1")
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "--l1-size-gb" in err and "0.25 GiB free" in err and str(small_tmpfs) in err, err
    assert "Traceback" not in r.stderr
    assert os.listdir(small_tmpfs) == [], "a refused start left an arena behind"


def test_l1_larger_than_memory_refuses_to_start_unless_allowed(small_tmpfs):
    from kvdepot.shm import available_memory_bytes

    resize_tmpfs(small_tmpfs, "4096g")  # a tmpfs may be sized past RAM: only memory can stop it then
    mem = available_memory_bytes()
    assert mem is not None
    too_big = f"{(mem >> 30) + 2}"
    r = run_server("--shm-dir", str(small_tmpfs), "--l1-size-gb", too_big)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "memory available" in err and "--l1-over-memory" in err and "--l1-size-gb" in err, err
    assert os.listdir(small_tmpfs) == []


STORE_AND_CHECK = """
import sys, numpy as np
from kvdepot import ClientOptions, KVClient, KVLayout
url, transport, n_prompts = sys.argv[1], sys.argv[2], int(sys.argv[3])
layout = KVLayout(2, 2, 32)
with KVClient(url, model="m", layout=layout, options=ClientOptions(transport=transport)) as c:
    assert c.transport == transport, c.transport
    for p in range(n_prompts):
        tokens = np.arange(p * 10**6, p * 10**6 + 64 * 16)
        kv = np.full(layout.chunk_shape(len(tokens)), p % 1000, np.float16)
        c.store(tokens, kv)
        got = c.retrieve(tokens)
        assert (got == p % 1000).all(), f"prompt {p} came back wrong"
print("ok", flush=True)
"""


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_full_shm_filesystem_never_kills_server_or_worker(make_server, small_tmpfs, transport):
    """The arena's pages are reserved at start: once the server runs, filling /dev/shm with something
    else cannot take them away (before, the first store into an unbacked page was a SIGBUS)."""
    resize_tmpfs(small_tmpfs, "64m")
    # No prefault: nothing touches the arena's pages before the filler takes the free space.
    srv = make_server("--shm-dir", str(small_tmpfs), "--l1-size-gb", str(32 / 1024), "--no-prefault")
    fd = os.open(Path(small_tmpfs) / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:  # take every free page of the tmpfs
        while os.write(fd, b"\xff" * (64 << 10)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    assert os.statvfs(small_tmpfs).f_bavail == 0
    # Stores and loads over the whole arena (several times its size: eviction reuses every page), in
    # a child process, since a SIGBUS would kill whoever touches an unbacked page.
    r = subprocess.run(
        [sys.executable, "-c", STORE_AND_CHECK, srv.url, transport, "80"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
    assert srv.alive(), "the server died"
    with srv.client() as c:
        tokens = make_tokens(4 * CHUNK, 11)
        kv = make_kv(LAYOUT, len(tokens), 11)
        assert c.store(tokens, kv) == 4 * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv)
    assert srv.status()["l1"]["prefault"]["state"] == "off"
