"""Configuration: one dataclass per part, each with its ``add_*_args`` / ``from_args`` pair.

Defaults live here and nowhere else; ``kvdepot server --help`` shows every one of them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from kvdepot.hashing import HashAlgorithm
from kvdepot.protocol.codec import MAX_FRAME_BYTES
from kvdepot.storage.eviction import POLICIES

GiB = 1 << 30
MIN_L1_GB = 1 / 1024  # 1 MiB: below that no real chunk fits
MAX_L1_GB = 1 << 20
MAX_CHUNK_TOKENS = 1 << 16  # the server refuses larger chunk sizes at registration too


@dataclass(frozen=True)
class RpcConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    ipc_path: str | None = None
    workers: int = 4
    max_frame_bytes: int = MAX_FRAME_BYTES
    heartbeat_interval_s: float = 1.0
    client_timeout_s: float = 10.0

    @property
    def endpoints(self) -> list[str]:
        eps = [f"tcp://{self.host}:{self.port}"] if self.port else []
        if self.ipc_path:
            eps.append(f"ipc://{self.ipc_path}")
        return eps


@dataclass(frozen=True)
class StorageConfig:
    l1_size_gb: float = 2.0
    chunk_size: int = 256
    hash_algorithm: str = HashAlgorithm.SHA256.value
    eviction_policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    lease_ttl_s: float = 60.0
    prefault: bool = True
    shm_dir: str = "/dev/shm"
    l2: tuple[str, ...] = ()  # tier specs, in lookup order (see storage/l2/registry.py)
    l2_placement: str = "write_through"
    l2_queue_limit: int = 65536
    l1_over_memory: bool = False  # start even when L1 exceeds the machine's available memory

    @property
    def l1_size_bytes(self) -> int:
        return int(self.l1_size_gb * GiB)


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0 turns the HTTP API off
    allowed_hosts: tuple[str, ...] = ()  # extra Host names the admin API answers to


@dataclass(frozen=True)
class ServerConfig:
    rpc: RpcConfig = field(default_factory=RpcConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    log_level: str = "info"


def add_rpc_args(p: argparse.ArgumentParser) -> None:
    d = RpcConfig()
    g = p.add_argument_group("RPC (ZeroMQ)")
    g.add_argument("--host", default=d.host, help="address to bind; the endpoint is tcp://HOST:PORT (default: %(default)s)")
    g.add_argument("--port", type=int, default=d.port, help="TCP port; 0 turns TCP off (default: %(default)s)")
    g.add_argument("--ipc-path", default=d.ipc_path, help="also listen on ipc://IPC_PATH (default: off)")
    g.add_argument("--workers", type=int, default=d.workers, help="threads for BLOCKING handlers (default: %(default)s)")
    g.add_argument("--max-frame-mib", type=int, default=d.max_frame_bytes >> 20, help="largest payload frame in MiB (default: %(default)s)")
    g.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s, help="how often idle clients ping (default: %(default)s)")
    g.add_argument("--client-timeout-s", type=float, default=d.client_timeout_s, help="a client silent this long is gone and its leases end (default: %(default)s)")


def rpc_from_args(a: argparse.Namespace) -> RpcConfig:
    _finite(heartbeat_interval_s=a.heartbeat_interval_s, client_timeout_s=a.client_timeout_s)
    if a.port == 0 and not a.ipc_path:
        raise ValueError("no endpoint: give --port or --ipc-path")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port} is not a TCP port")
    if a.heartbeat_interval_s <= 0 or a.client_timeout_s <= 0:
        raise ValueError("--heartbeat-interval-s and --client-timeout-s must be positive")
    if a.client_timeout_s <= a.heartbeat_interval_s:
        raise ValueError("--client-timeout-s must be longer than --heartbeat-interval-s")
    if a.workers < 1:
        raise ValueError("--workers must be at least 1")
    if not 1 <= a.max_frame_mib <= 256:
        raise ValueError("--max-frame-mib must be in [1, 256]")
    return RpcConfig(
        host=a.host,
        port=a.port,
        ipc_path=a.ipc_path,
        workers=a.workers,
        max_frame_bytes=a.max_frame_mib << 20,
        heartbeat_interval_s=a.heartbeat_interval_s,
        client_timeout_s=a.client_timeout_s,
    )


def add_storage_args(p: argparse.ArgumentParser) -> None:
    d = StorageConfig()
    g = p.add_argument_group("storage (L1)")
    g.add_argument("--l1-size-gb", type=float, default=d.l1_size_gb, help="shared-memory L1 size in GiB (default: %(default)s)")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size, help="tokens per chunk object (default: %(default)s)")
    g.add_argument("--hash-algorithm", choices=[h.value for h in HashAlgorithm], default=d.hash_algorithm, help="chunk hash; xxh3_128 only for trusted deployments (default: %(default)s)")
    g.add_argument("--eviction-policy", choices=sorted(POLICIES), default=d.eviction_policy, help="L1 eviction policy (default: %(default)s)")
    g.add_argument("--high-watermark", type=float, default=d.high_watermark, help="evict when L1 usage exceeds this fraction (default: %(default)s)")
    g.add_argument("--low-watermark", type=float, default=d.low_watermark, help="...down to this fraction (default: %(default)s)")
    g.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s, help="a lock not finished within this time ends (default: %(default)s)")
    g.add_argument("--no-prefault", dest="prefault", action="store_false", help="do not populate the arena in the background at start-up")
    g.add_argument("--l1-over-memory", action="store_true", help="start even when --l1-size-gb exceeds the machine's available memory (the OS may then swap or kill processes)")
    g.add_argument("--shm-dir", default=d.shm_dir, help="directory of the shared-memory arena (default: %(default)s)")
    g2 = p.add_argument_group("storage (L2 tiers)")
    g2.add_argument(
        "--l2",
        action="append",
        default=[],
        metavar="SPEC",
        help="add an L2 tier, looked up in the order given: 'TYPE:key=value,...' or JSON "
        "'{\"type\": TYPE, ...}'. Types: " + _tier_help(),
    )
    g2.add_argument("--l2-placement", choices=["write_through", "skip_l1"], default=d.l2_placement, help="write_through keeps objects in L1 and every tier; skip_l1 drops them from L1 once every tier has them (default: %(default)s)")
    g2.add_argument("--l2-queue-limit", type=int, default=d.l2_queue_limit, help="objects waiting for L2; beyond it new ones are not pushed (counted) (default: %(default)s)")


def _finite(**values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def storage_from_args(a: argparse.Namespace) -> StorageConfig:
    _finite(l1_size_gb=a.l1_size_gb, high_watermark=a.high_watermark, low_watermark=a.low_watermark, lease_ttl_s=a.lease_ttl_s)
    if not MIN_L1_GB <= a.l1_size_gb <= MAX_L1_GB:
        raise ValueError(f"--l1-size-gb {a.l1_size_gb:g} is outside [{MIN_L1_GB:g}, {MAX_L1_GB:g}] (GiB; 1 MiB at least)")
    if not 0 < a.chunk_size <= MAX_CHUNK_TOKENS:
        raise ValueError(f"--chunk-size {a.chunk_size} is outside [1, {MAX_CHUNK_TOKENS}] tokens")
    if not 0 < a.low_watermark <= a.high_watermark <= 1:
        raise ValueError("need 0 < --low-watermark <= --high-watermark <= 1")
    if a.lease_ttl_s <= 0:
        raise ValueError("--lease-ttl-s must be positive")
    from kvdepot.storage.l2.registry import parse_spec

    for i, spec in enumerate(a.l2):
        parse_spec(spec, i)  # raises ValueError naming the bad key or value
    if a.l2_queue_limit < 1:
        raise ValueError("--l2-queue-limit must be positive")
    return StorageConfig(
        l2=tuple(a.l2),
        l2_placement=a.l2_placement,
        l2_queue_limit=a.l2_queue_limit,
        l1_size_gb=a.l1_size_gb,
        chunk_size=a.chunk_size,
        hash_algorithm=a.hash_algorithm,
        eviction_policy=a.eviction_policy,
        high_watermark=a.high_watermark,
        low_watermark=a.low_watermark,
        lease_ttl_s=a.lease_ttl_s,
        prefault=a.prefault,
        shm_dir=a.shm_dir,
        l1_over_memory=a.l1_over_memory,
    )


def _tier_help() -> str:
    from kvdepot.storage.l2.registry import describe

    return describe().replace("%", "%%")


def add_http_args(p: argparse.ArgumentParser) -> None:
    d = HttpConfig()
    g = p.add_argument_group("HTTP API")
    g.add_argument("--http-host", default=None, help="address of the HTTP API (default: same as --host)")
    g.add_argument("--http-port", type=int, default=d.port, help="HTTP port; 0 turns HTTP off (default: %(default)s)")
    g.add_argument(
        "--http-allowed-hosts",
        default="",
        help="comma-separated extra host names the HTTP API answers to (loopback names, the bound address and "
        "this machine's names always work; others are refused against DNS rebinding) (default: none)",
    )


def http_from_args(a: argparse.Namespace) -> HttpConfig:
    if not 0 <= a.http_port <= 65535:
        raise ValueError(f"--http-port {a.http_port} is not a TCP port")
    allowed = tuple(h.strip() for h in a.http_allowed_hosts.split(",") if h.strip())
    return HttpConfig(host=a.http_host or a.host, port=a.http_port, allowed_hosts=allowed)


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_rpc_args(p)
    add_storage_args(p)
    add_http_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default: %(default)s)")


def server_from_args(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(rpc=rpc_from_args(a), storage=storage_from_args(a), http=http_from_args(a), log_level=a.log_level)
