"""A runtime plugin that keeps a history of the server's use: one JSON line every N seconds.

    kvdepot server --plugin 'kvdepot.plugins.usage_log:/var/log/kvdepot/usage.jsonl --every-s 60'

Each line is read from the server's ``/status`` (``KVDEPOT_HTTP_URL``): the time, L1 use (bytes,
capacity, objects), lookups (requests, requested and hit tokens, hit rate), clients, contexts and leases.
Lines are appended whole (one write each), so a reader, ``tail -f`` or a log shipper, never sees half a
line, even if the plugin is killed. It ends on SIGTERM, and when its server is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

from kvdepot.plugins import PluginEnvironment


def sample(status: dict, now: float) -> dict:
    """One line: the figures of ``/status`` an operator charts over days."""
    l1, lookups = status["l1"], status["lookups"]
    return {
        "time": round(now, 3),
        "l1_used_bytes": l1["used_bytes"],
        "l1_capacity_bytes": l1["capacity_bytes"],
        "l1_objects": l1["objects"],
        "lookups": lookups["requests"],
        "requested_tokens": lookups["requested_tokens"],
        "hit_tokens": lookups["hit_tokens"],
        "hit_rate": lookups["hit_rate"],
        "clients": status["clients"],
        "contexts": status["contexts"],
        "leases": status["leases"],
    }


def read_status(http_url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(f"{http_url.rstrip('/')}/status", timeout=timeout_s) as r:
        return json.load(r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvdepot.plugins.usage_log", description="append the server's use to PATH as JSON lines")
    p.add_argument("path", help="file to append to (created if missing, with its directory)")
    p.add_argument("--every-s", type=float, default=60.0, help="seconds between lines (default: %(default)s)")
    args = p.parse_args(argv)
    env = PluginEnvironment.from_environ()
    if not env.http_url:
        print("usage_log needs the server's HTTP API (--http-port is 0)", file=sys.stderr)
        return 2
    if not args.every_s > 0:
        print(f"--every-s must be > 0, not {args.every_s}", file=sys.stderr)
        return 2
    try:
        # A log directory a fresh machine lacks (/var/log/kvdepot/, README's example) is made, as a
        # logger would: else the plugin exits at every start and backs off for ever, writing nothing.
        os.makedirs(os.path.dirname(os.path.abspath(args.path)), exist_ok=True)
        fd = os.open(args.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        print(f"usage_log cannot open {args.path}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"appending the server's use to {args.path} every {args.every_s:g} s", flush=True)
    try:
        while not stop.is_set() and env.server_alive():
            try:
                line = json.dumps(sample(read_status(env.http_url), time.time()), separators=(",", ":")) + "\n"
            except (OSError, ValueError, KeyError) as exc:  # the server starting or stopping: try again next time
                print(f"cannot read {env.http_url}/status: {exc}", file=sys.stderr, flush=True)
            else:
                os.write(fd, line.encode())
            stop.wait(args.every_s)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
