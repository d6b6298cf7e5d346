"""A worker process that opens a zero-copy block, says READY, and then does what stdin tells it, so a
test can pause it (SIGSTOP) at the worst moment: holding writable (or readable) arena slots.

    python _paused_worker.py '{"url": ..., "mode": "store"|"retrieve", "tokens": [...], "value": 9,
                               "pid0": false, "layout": [L, H, D], "model": ..., "timeout_client": 1}'

stdout, one JSON line each: {"ready": ..., "transport": ..., "n": ...} at once; after "go" on stdin,
store: fills its slots with ``value``, leaves the block (commit) and prints {"result": "ok"} or
{"error": NAME, "code": CODE, "message": ...}; retrieve: checks every view still holds ``value``, leaves
the block and prints {"intact": bool, ...} with the same result/error keys. It then waits for stdin to
close and exits.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    import numpy as np

    import kvdepot.client.registration as client_mod
    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.errors import KVDepotError
    from kvdepot.protocol import messages

    if args.get("pid0"):
        # No pid: the server cannot open a pidfd for us (as for a client in another PID namespace);
        # only our liveness lock in the arena tells it we still run.
        client_mod.local_client_info = lambda: messages.ClientInfo()

    layout = KVLayout(*args["layout"])
    c = KVClient(args["url"], model=args["model"], layout=layout, options=ClientOptions(timeout_s=10.0))
    tokens = np.asarray(args["tokens"], dtype=np.int64)
    value = args["value"]
    out: dict = {}
    try:
        if args["mode"] == "store":
            with c.prepare_store(tokens) as slots:
                print(json.dumps({"ready": True, "transport": c.transport, "n": sum(s is not None for s in slots)}), flush=True)
                assert sys.stdin.readline().strip() == "go"
                for slot in slots:
                    if slot is not None:
                        slot[...] = value  # into slots the server may have taken back meanwhile
        else:
            with c.prepare_retrieve(tokens) as views:
                print(json.dumps({"ready": True, "transport": c.transport, "n": len(views)}), flush=True)
                assert sys.stdin.readline().strip() == "go"
                out["intact"] = all(bool((v == value).all()) for v in views)
        out["result"] = "ok"
    except KVDepotError as exc:
        out.update(error=type(exc).__name__, code=int(exc.code), message=exc.message)
    print(json.dumps(out), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    c.close()


if __name__ == "__main__":
    main()
