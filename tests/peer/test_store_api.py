"""``PeerStore`` used as README documents it, and misused as users do: closing it while other threads
still call it, calling it after close, and keys that are neither ``str`` nor ``bytes``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support.peer_cluster import SRC, TESTS, NodeProcess

from kvdepot.errors import KVDepotError
from kvdepot.peer import PeerStore

SECRET = "store-api-secret"
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0, "metrics_port": 0}

# A reader node in a process of its own (a ZeroMQ assertion aborts the whole process, not one thread):
# it joins HEAD, says "ready", and on "go" (its owner paused meanwhile) asks for pages in a thread whose
# directory calls then wait for the paused owner, closes the store while that call is in flight, and
# prints what the call returned, then what a call after close() raised.
READER = textwrap.dedent(
    """
    import json, sys, threading, time
    from kvdepot.peer import PeerStore

    store = PeerStore(discovery=sys.argv[1], secret=sys.argv[2], port=0, data_port=0, pool_size_mb=8, metrics_port=0,
                      heartbeat_interval_s=0.3, member_ttl_s=30.0, control_timeout_s=2.0, timeout_s=3.0)
    keys = [f"missing-{i}" for i in range(32)]
    store.batch_exists(keys)
    print("ready", flush=True)
    sys.stdin.readline()
    out = {}

    def call():
        try:
            out["in_flight"] = store.exists_many(keys)
        except BaseException as exc:
            out["in_flight"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)  # the call now waits for the paused owner
    store.close()
    out["call_running_after_close"] = t.is_alive()
    t.join(10)
    try:
        store.exists("missing-0")
        out["after_close"] = "no error"
    except BaseException as exc:
        out["after_close"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
    """
)


def test_close_waits_for_calls_in_flight_and_later_calls_say_closed():
    head = NodeProcess(secret=SECRET).start()
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}"}
    reader = subprocess.Popen([sys.executable, "-c", READER, head.node_id, SECRET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "ready", reader.stderr.read() if reader.stderr else ""
        head.pause()
        reader.stdin.write("go\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=60)
    finally:
        head.resume()
        head.stop()
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, f"the reader process died ({reader.returncode}): {err[-2000:]}"
    got = json.loads(out.strip().splitlines()[-1])
    # The call in flight ends as its deadline says (a miss: the owner does not answer), not with the
    # error of a socket closed under it; close() returned only after it.
    assert got["in_flight"] == [False] * 32, got
    assert got["call_running_after_close"] is False, got
    assert got["after_close"].startswith("KVDepotError") and "closed" in got["after_close"], got


def test_every_call_after_close_says_closed():
    store = PeerStore(secret=SECRET, port=0, data_port=0, pool_size_mb=8, **FAST)
    store.set("k", b"x" * 4096)
    store.close()
    store.close()  # twice: nothing more
    calls = {
        "set": lambda: store.set("k", b"y" * 4096),
        "get": lambda: store.get("k"),
        "get_into": lambda: store.get_into("k", bytearray(4096)),
        "exists": lambda: store.exists("k"),
        "batch_exists": lambda: store.batch_exists(["k"]),
        "delete": lambda: store.delete("k"),
        "clear": store.clear,
    }
    for name, call in calls.items():
        with pytest.raises(KVDepotError, match="closed"):
            call()
        print(name, "refused")


@pytest.mark.parametrize("key", [5, [1, 2], 3.5, None, object()], ids=["int", "list", "float", "None", "object"])
def test_a_key_that_is_neither_str_nor_bytes_is_refused_naming_it(key):
    # bytes(5) is five zero bytes and bytes([1, 2]) two bytes: such keys were stored silently under
    # names nobody meant (and bytes(10**12) tried to allocate a terabyte).
    with PeerStore(secret=SECRET, port=0, data_port=0, pool_size_mb=8, **FAST) as store:
        for call in (lambda: store.set(key, b"x" * 4096), lambda: store.get(key), lambda: store.exists(key), lambda: store.delete(key)):
            with pytest.raises(TypeError, match="key"):
                call()
        assert store.get(b"\0" * 5) is None and store.get(b"\1\2") is None  # nothing stored under a stand-in
        # What keys are: str, bytes and other bytes-like objects, the same page under each.
        assert store.set("k-1", b"p" * 4096)
        assert store.get(b"k-1") == store.get(bytearray(b"k-1")) == store.get(memoryview(b"k-1")) == b"p" * 4096
