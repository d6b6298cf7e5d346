"""``kvdepot peer``: run a standalone peer node; ``kvdepot peer status``: a node's view of the cluster."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from kvdepot.config import add_config_args, config_values
from kvdepot.daemon import raise_fd_limit, stop_on_signals
from kvdepot.errors import ConfigError, KVDepotError
from kvdepot.peer.addresses import address_id, node_id
from kvdepot.peer.config import PeerConfig, PeerFlags


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["run", "status"], default="run",
                   help="run: a node until SIGINT/SIGTERM (default); status: ring, members and masters as a node sees them")  # fmt: skip
    p.add_argument("--node", default="", help="status: the node's HOST:PORT (control port; IPv6 bracketed: [::1]:31995; default: --host:--port)")
    p.add_argument("--json", action="store_true", help="status: the whole answer as JSON")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default: %(default)s)")
    add_config_args(p, PeerFlags, "peer node")


def main(args: argparse.Namespace) -> int:
    try:
        config = PeerFlags(**config_values(PeerFlags, args))
    except (ConfigError, TypeError) as exc:
        print(f"kvdepot peer: {exc}", file=sys.stderr)
        return 2
    if args.action == "status":
        try:
            target = address_id(args.node) if args.node else node_id(config.host, config.port)
        except ValueError as exc:
            print(f"kvdepot peer status: --node {exc}", file=sys.stderr)
            return 2
        return status(config, target, args.json)
    return run(config)


def run(config: PeerConfig) -> int:
    from kvdepot.peer.node import PeerNode

    try:
        node = PeerNode(config)
    except ConfigError as exc:  # a pool this host cannot reserve
        print(f"kvdepot peer: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    stop_on_signals(stop)  # before the join (up to join_timeout_s): a signal meanwhile closes it after
    raise_fd_limit()
    try:
        node.start()
    except OSError as exc:
        print(f"kvdepot peer: {exc}", file=sys.stderr)
        return 2
    assert node.info is not None
    print(f"kvdepot peer node {node.info.id} (data port {node.info.data_port}), head {node.head}", flush=True)
    stop.wait()
    node.close()
    return 0


def status(config: PeerConfig, target: str, as_json: bool) -> int:
    from kvdepot.peer.ring import HashRing
    from kvdepot.protocol import messages as m
    from kvdepot.rpc.channel import RpcChannel
    from kvdepot.rpc.security import CurveSecurity

    secret = config.cluster_secret
    security = CurveSecurity(secret) if secret else None
    channel = RpcChannel(f"tcp://{target}", security=security).open()
    try:
        reply = channel.call(m.PeerStatusRequest(), timeout_s=config.timeout_s)
    except KVDepotError as exc:
        print(f"kvdepot peer status: no answer from {target} ({exc}); is it up, and is the secret right?", file=sys.stderr)
        return 1
    finally:
        channel.close()
        if security is not None:
            security.close()
    ring = HashRing([n.id for n in reply.members], config.vnodes).shares()
    doc = {
        "node": reply.node.id,
        "masters": reply.masters,
        "members": [{"id": n.id, "data_port": n.data_port, "master": n.id in reply.masters, "ring_share": round(ring.get(n.id, 0.0), 4)}
                    for n in reply.members],  # fmt: skip
        "pool": {"used_bytes": reply.pool_used_bytes, "capacity_bytes": reply.pool_capacity_bytes, "keys": reply.pool_keys},
        "directory_records": reply.directory_records,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"node {doc['node']}: {len(reply.members)} members, masters {', '.join(reply.masters)}")
    print(f"  pool {reply.pool_used_bytes / 2**20:.1f} / {reply.pool_capacity_bytes / 2**20:.1f} MiB, {reply.pool_keys} pages; "
          f"directory shard {reply.directory_records} records")  # fmt: skip
    print(f"  {'member':<24} {'data port':>9} {'ring share':>10}  role")
    for mem in doc["members"]:
        print(f"  {mem['id']:<24} {mem['data_port']:>9} {mem['ring_share']:>10.1%}  {'master' if mem['master'] else ''}")
    return 0
