"""A worker process for the liveness tests: it opens a zero-copy block on a real server, says READY on
stdout, and then waits to be killed (it never leaves the block).

    python _worker.py '{"url": ..., "mode": "store"|"retrieve", "tokens": [...], "pid0": false,
                        "layout": [L, H, D], "model": ...}'
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    import numpy as np

    import kvdepot.client.registration as client_mod
    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.protocol import messages

    if args.get("pid0"):
        # No pid: the server cannot watch this process through a pidfd and must rely on heartbeats.
        client_mod.local_client_info = lambda: messages.ClientInfo()

    layout = KVLayout(*args["layout"])
    c = KVClient(args["url"], model=args["model"], layout=layout, options=ClientOptions(timeout_s=10.0))
    tokens = np.asarray(args["tokens"], dtype=np.int64)
    if args["mode"] == "store":
        with c.prepare_store(tokens) as slots:
            for slot in slots:
                if slot is not None:
                    slot[...] = 0  # garbage that must never become visible
            print(json.dumps({"ready": True, "transport": c.transport, "slots": sum(s is not None for s in slots)}), flush=True)
            while True:
                time.sleep(60)
    elif args["mode"] == "retrieve":
        with c.prepare_retrieve(tokens) as views:
            print(json.dumps({"ready": True, "transport": c.transport, "views": len(views)}), flush=True)
            while True:
                time.sleep(60)
    else:
        raise SystemExit(f"unknown mode {args['mode']}")


if __name__ == "__main__":
    main()
