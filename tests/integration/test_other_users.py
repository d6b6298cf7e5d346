"""A server and its clients running as different OS users (containers sharing ``/dev/shm`` and a socket
volume: kvdepot as root, the engine as uid 1000). A client of another user cannot map the arena (mode
0600) and ``auto`` falls back to inline, saying why; where it cannot connect at all, the error says
that the file system refuses it, naming the path and the permission, instead of "is it running?".

These tests start clients as another uid and so need root (they skip, saying so, elsewhere). The child
imports what it needs while it is still root (the interpreter may live under /root, mode 0700) and
only then drops to ``OTHER_UID``, which needs no account of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.servers import CHUNK, LAYOUT, MODEL

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")

OTHER_UID = 65534  # nobody: never the server's user

_AS_OTHER_USER = textwrap.dedent(
    """
    import importlib, json, os, pkgutil, sys, time
    import numpy as np
    import numpy.random  # noqa: F401 - numpy imports it at first use, by then from a tree this uid may not read
    import encodings.idna, zlib  # noqa: F401 - what zmq and numpy may import late
    import kvdepot
    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.errors import KVDepotError

    # Every module a client may import late, while this process can still read the checkout (a clone in
    # a directory of mode 0700, as mktemp makes them, is closed to the other uid).
    for mod in pkgutil.walk_packages(kvdepot.__path__, "kvdepot."):
        if not mod.name.startswith(("kvdepot.connectors", "kvdepot.gpu", "kvdepot.bench", "kvdepot.admin", "kvdepot.plugins", "kvdepot.peer")):
            try:
                importlib.import_module(mod.name)
            except Exception:
                pass

    uid, url, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    layout = KVLayout(**json.loads(sys.argv[4]))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    t0 = time.monotonic()
    out = {}
    try:
        options = ClientOptions(transport=transport, timeout_s=5, connect_timeout_s=1)
        with KVClient(url, sys.argv[5], layout, options=options) as c:
            tokens = np.arange(2 * int(sys.argv[6]), dtype=np.int64)
            kv = np.random.default_rng(1).integers(0, 255, size=layout.chunk_shape(len(tokens))).astype(layout.storage_dtype)
            out = {"transport": c.transport, "reason": c.transport_reason, "stored": c.store(tokens, kv),
                   "same": bool(np.array_equal(c.retrieve(tokens), kv))}
    except KVDepotError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out))
    """
)


def run_as_other_user(url: str, transport: str = "auto") -> dict:
    """A client of ``MODEL`` on ``url`` in a child process running as ``OTHER_UID``: what it saw."""
    layout = {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads, "head_dim": LAYOUT.head_dim}
    argv = [sys.executable, "-c", _AS_OTHER_USER, str(OTHER_UID), url, transport, json.dumps(layout), MODEL, str(CHUNK)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_client_of_another_user_falls_back_to_inline_over_tcp(make_server):
    """The arena is its server's user's alone: ``auto`` picks inline and names the refusal; ``shm``
    asked for is a clear TransportUnavailable, not a hang."""
    srv = make_server()
    got = run_as_other_user(srv.url)
    assert (got.get("transport"), got.get("stored"), got.get("same")) == ("inline", 2 * CHUNK, True), got
    assert "Permission denied" in got["reason"], got
    got = run_as_other_user(srv.url, transport="shm")
    assert got.get("error") == "TransportUnavailable" and "Permission denied" in got["message"], got


def test_an_ipc_socket_another_user_may_not_write_is_named_as_such(make_server):
    """The server binds its ipc:// socket under its own umask: 0755 under the usual 022, and connecting
    to a Unix socket needs write permission. ZeroMQ retries such a connect quietly, and the client said
    "no kvdepot server answered ... (is it running, and is this its address?)": both true, and no hint
    that the file system refused this user. Now the error names the socket, its mode and owner, and
    this process's uid."""
    srv = make_server()
    os.chmod(srv.ipc_dir, 0o755)  # the directory lets everyone in; the socket (0755) does not
    sock = srv.proc.ipc_path
    assert Path(sock).stat().st_mode & 0o002 == 0, "the test needs a socket others may not write"
    got = run_as_other_user(srv.ipc_url)
    assert got.get("error") == "ServerUnreachable", got
    assert sock in got["message"] and "permission" in got["message"].lower(), got["message"]
    assert f"uid {OTHER_UID}" in got["message"] and "srwxr-xr-x" in got["message"], got["message"]

    # Made writable for others, the same user connects, over inline (the arena stays the server's own).
    os.chmod(sock, 0o777)
    got = run_as_other_user(srv.ipc_url)
    assert (got.get("transport"), got.get("same")) == ("inline", True), got


def test_an_ipc_socket_in_a_directory_another_user_may_not_search_is_named_as_such(make_server):
    """A socket in a directory of mode 0700 (mkdtemp's) cannot even be seen by another user: the error
    says the path cannot be reached, not that nothing answers there."""
    srv = make_server()
    assert os.stat(srv.ipc_dir).st_mode & 0o001 == 0
    got = run_as_other_user(srv.ipc_url)
    assert got.get("error") == "ServerUnreachable", got
    assert srv.proc.ipc_path in got["message"] and "permission" in got["message"].lower(), got["message"]


_CREATE_ARENA_AS_OTHER_USER = textwrap.dedent(
    """
    import os, sys
    from kvdepot.shm import SharedArena
    from kvdepot.shm.segment import ArenaCapacityError

    uid, shm_dir, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        SharedArena.create(size, shm_dir=shm_dir).close()
        print("created")
    except ArenaCapacityError as exc:
        print(exc)
    """
)


def test_no_room_for_the_arena_names_a_dead_arena_of_another_user(small_tmpfs):
    """A server killed (SIGKILL, the OOM killer) leaves its arena behind; the next server's sweep removes
    it, but only a server of the same user can: another one cannot take its lock (mode 0600) nor unlink
    it (the sticky bit). Such a server was refused as "DIR has only 0.00 GiB free" with no word of the
    leftover that fills DIR. Now the refusal names it, its owner and its size."""
    leftover = small_tmpfs / "kvdepot-999999-0123456789ab"  # an arena's name: a root server, dead
    with open(leftover, "wb") as f:
        f.truncate(768 << 10)
        os.posix_fallocate(f.fileno(), 0, 768 << 10)
    os.chmod(leftover, 0o600)
    os.chmod(small_tmpfs, 0o1777)
    argv = [sys.executable, "-c", _CREATE_ARENA_AS_OTHER_USER, str(OTHER_UID), str(small_tmpfs), str(512 << 10)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.strip()
    assert "only" in message and "free" in message, message  # refused, as it must be
    assert leftover.name in message and "uid 0" in message, message
    assert leftover.exists()  # never another user's file removed
