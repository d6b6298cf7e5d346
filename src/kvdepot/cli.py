"""The ``kvdepot`` command: ``server``, ``status``, ``demo``, ``bench``, ``keygen``, ``peer``, ``make-model``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kvdepot import __version__
from kvdepot.config import HttpConfig, add_server_args, host_port, server_from_args
from kvdepot.errors import ConfigError


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_server(args: argparse.Namespace) -> int:
    try:
        config = server_from_args(args)
    except ValueError as exc:
        print(f"kvdepot server: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    from kvdepot.malloc import keep_large_buffers_in_heap

    keep_large_buffers_in_heap()
    from kvdepot.server.main import KVDepotServer

    try:
        KVDepotServer(config).serve_forever()
    except ConfigError as exc:  # a configuration that cannot work: a tier spec, L1 larger than /dev/shm
        logging.getLogger("kvdepot").debug("start-up failed", exc_info=True)
        print(f"kvdepot server: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as exc:  # e.g. a port or an ipc path in use
        logging.getLogger("kvdepot").debug("start-up failed", exc_info=True)
        print(f"kvdepot server: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from kvdepot.admin.summary import probe, summary

    base = args.url.rstrip("/") if args.url else f"http://{host_port(args.http_host, args.http_port)}"  # [::1]:8080
    parts = urlsplit(base)
    try:
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number: a message, not a traceback
        print(f"kvdepot status: {base}: {exc}", file=sys.stderr)
        return 1
    if parts.scheme == "http" and parts.hostname:
        why = probe(parts.hostname, port or 80, min(args.timeout_s, 1.0))
        if why:
            print(f"kvdepot status: {why}", file=sys.stderr)
            return 1
    url = f"{base}/status"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout_s) as resp:
            doc = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kvdepot status: cannot read {url}: {exc} (is the server's HTTP API on --http-port?)", file=sys.stderr)
        return 1
    if not isinstance(doc, dict) or "l1" not in doc:
        print(f"kvdepot status: {url} is not a kvdepot server's /status", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else summary(doc, base))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _setup_logging("warning")
    if args.synthetic:
        from kvdepot.bench import synthetic_demo

        return synthetic_demo.run(args)
    from kvdepot.bench import engine_demo

    return engine_demo.run(args)


def cmd_make_model(args: argparse.Namespace) -> int:
    try:
        from kvdepot.bench.engines.vllm_engines import TINY, make_tiny_model

        model = make_tiny_model(Path(args.dir), TINY)
    except ImportError as exc:
        print(f"kvdepot make-model: needs torch and transformers ({exc}); scripts/install-vllm.sh installs them with vLLM", file=sys.stderr)
        return 1
    print(f"a random-weight Llama ({model.num_layers} layers, {model.num_kv_heads} KV heads of {model.head_dim}, float32) in {model.path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    _setup_logging("warning")
    from kvdepot.bench import tiers, transfer

    if args.workload == "transfer":
        return transfer.main(args)
    if args.workload == "tiers":
        return tiers.main(args)
    if args.workload == "load":
        from kvdepot.bench import load

        return load.main(args)
    if args.workload == "hit-ratio":
        from kvdepot.bench import hit_ratio

        return hit_ratio.main(args)
    if args.workload == "soak":
        from kvdepot.bench import soak

        return soak.main(args)
    if args.workload == "peer":
        from kvdepot.bench import peer

        return peer.main(args)
    if args.workload == "gpu":
        from kvdepot.bench import gpu

        return gpu.main(args)
    print(f"unknown workload {args.workload}", file=sys.stderr)
    return 2


def cmd_keygen(args: argparse.Namespace) -> int:
    from kvdepot.rpc.security import write_key_files

    try:
        files = write_key_files(args.dir)
    except (OSError, FileExistsError) as exc:
        print(f"kvdepot keygen: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a CurveZMQ server and client key pair in {args.dir}")
    print(f"  server:  kvdepot server --curve-server-key {files['server_secret']} --curve-clients {files['clients']} ...")
    print(f"  clients: KVClient(..., curve=CurveClientKeys.from_files({str(files['server_public'])!r}, {str(files['client_secret'])!r}))")
    print(f"           or the connectors' extra config: \"curve_server_key\": \"{files['server_public']}\", \"curve_client_key\": \"{files['client_secret']}\"")
    print("  keep the .key_secret files private; admit more clients by adding their .key files to clients/")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvdepot.trace import plan

    return plan.main(args)


def cmd_replay(args: argparse.Namespace) -> int:
    _setup_logging("warning")
    from kvdepot.trace import replay

    return replay.main(args)


def cmd_peer(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from kvdepot.peer import cli as peer_cli

    return peer_cli.main(args)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdepot", description="A KV-cache server for LLM inference engines.")
    p.add_argument("--version", action="version", version=f"kvdepot {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run the KV-cache server")  # each option's help states its default
    from kvdepot.storage.l2.registry import describe

    add_server_args(s, tier_help=describe())
    s.set_defaults(func=cmd_server)

    st = sub.add_parser(
        "status", help="a running server's hit rate, L1, tiers and clients (from its HTTP API, not the ZeroMQ port)"
    )
    http = HttpConfig()  # the server's own defaults: one source
    st.add_argument("--http-host", default=http.host, help="the server's --http-host (default: %(default)s)")
    st.add_argument("--http-port", type=int, default=http.port, help="the server's --http-port (default: %(default)s)")
    st.add_argument("--url", default="", help="the HTTP API's base URL instead, e.g. http://10.0.0.5:8080 (default: from the two above)")
    st.add_argument("--timeout-s", type=_positive_seconds, default=5.0, help="how long to wait for /status (default: %(default)s)")
    st.add_argument("--json", action="store_true", help="print the whole /status document as JSON instead of a summary")
    st.set_defaults(func=cmd_status)

    d = sub.add_parser(
        "demo", help="a real vLLM engine (CPU) serving long prompts cold, then a fresh one loading their KV from kvdepot"
    )
    d.add_argument("--synthetic", action="store_true", help="instead, an engine-like workload without an engine (no vLLM needed)")
    d.add_argument("--l1-size-gb", type=float, default=1.0, help="L1 size of the demo server (default: %(default)s)")
    d.add_argument("--port", type=int, default=0, help="TCP port of the demo server; 0 picks a free one")
    from kvdepot.bench.engine_demo import add_args as add_engine_demo_args

    add_engine_demo_args(d)
    d.set_defaults(func=cmd_demo)

    pp = sub.add_parser("peer", help="run a peer-cluster node (the peer tier, standalone), or show a node's view of its cluster")
    from kvdepot.peer.cli import add_args as add_peer_args

    add_peer_args(pp)
    pp.set_defaults(func=cmd_peer)

    kg = sub.add_parser("keygen", help="write a CurveZMQ server and client key pair to DIR (for --curve-server-key / --curve-clients)")
    kg.add_argument("dir", help="directory to write server.key(_secret), client.key(_secret) and clients/ to (never overwrites)")
    kg.set_defaults(func=cmd_keygen)

    mm = sub.add_parser("make-model", help="write a small random-weight Llama (the one the demo and tests use) to DIR")
    mm.add_argument("dir", help="directory to write it to (a Hugging Face model directory vLLM and SGLang load)")
    mm.set_defaults(func=cmd_make_model)

    pl = sub.add_parser("plan", help="hit ratio vs L1 size for a trace, from an LRU simulation (no server): size L1 before buying memory")  # fmt: skip
    from kvdepot.trace.plan import add_args as add_plan_args

    add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)

    rp = sub.add_parser("replay", help="replay a Mooncake-format trace or a kvdepot recording against a running server")
    from kvdepot.trace.replay import add_args as add_replay_args

    add_replay_args(rp)
    rp.set_defaults(func=cmd_replay)

    b = sub.add_parser("bench", help="run a benchmark workload")
    bsub = b.add_subparsers(dest="workload", required=True)
    from kvdepot.bench.transfer import add_args as add_transfer_args

    bt = bsub.add_parser("transfer", help="store/retrieve GB/s (shm, inline), lookup latency, ping, vs memcpy")
    add_transfer_args(bt)
    from kvdepot.bench.tiers import add_args as add_tiers_args

    btt = bsub.add_parser("tiers", help="L2 adapters' store/load GB/s vs the raw backend, and LOOKUP from L2")
    add_tiers_args(btt)
    from kvdepot.bench.peer import add_args as add_peer_bench_args

    btp = bsub.add_parser("peer", help="the peer tier: remote get/set GB/s and batch_exists vs raw loopback sockets")
    add_peer_bench_args(btp)
    from kvdepot.bench.load import add_args as add_load_args

    btl = bsub.add_parser("load", help="many client processes on one server: aggregate GB/s, LOOKUP/PREPARE/PING p50 and p99 as clients are added")
    add_load_args(btl)
    from kvdepot.bench.soak import add_args as add_soak_args

    bts = bsub.add_parser("soak", help="many clients, a mixed workload, clients killed and stopped, a tier restarted, L1 and disk full: checks nothing leaks or goes wrong")
    add_soak_args(bts)
    from kvdepot.bench.hit_ratio import add_args as add_hit_ratio_args

    bth = bsub.add_parser("hit-ratio", help="a chat trace and a synthesized agentic workload through a real server: hit ratio vs an LRU oracle of the same capacity")
    add_hit_ratio_args(bth)
    from kvdepot.bench.gpu import add_args as add_gpu_args

    btg = bsub.add_parser("gpu", help="the GPU paths (cuda_ipc, pinned shm) and the paged gather/scatter: GB/s vs pinned D2H/H2D and D2D copies")
    add_gpu_args(btg)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # Its reader stopped early (`kvdepot status --json | head`): end quietly, not with a traceback, and
        # point stdout at /dev/null so that the interpreter's last flush does not raise it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
