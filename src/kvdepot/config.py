"""Configuration: one msgspec struct per part, the single source of every option.

Each field carries its type, default, constraints (``Meta(ge=..., le=...)``) and help text. From them
``add_config_args`` generates the ``kvdepot server`` flags and ``from_args`` builds the struct back, and
every struct checks its constraints and cross-field rules when it is constructed, from the command line
or in code alike: a bad value is a ``ConfigError`` naming the flag, never a server that starts and then
refuses every client. A field whose values are a closed set is typed by its enum (``HashAlgorithm``,
``EvictionPolicyName``, ``Placement``): the enum is the one source of the values, and the CLI's choices,
the check and the help are derived from it; a plain string naming a member is accepted in code and
stored as the member. This module reads no other part of kvdepot's but the bottom layer (storage, the
server, the tiers, the connectors and the CLI read it). Tier specs (``--l2``) are strings here; storage's
registry parses them into the tiers' own ``ConfigStruct``s.
"""

from __future__ import annotations

import argparse
import enum
import functools
import ipaddress
import math
import os
import re
import shlex
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

import msgspec

from kvdepot.errors import ConfigError
from kvdepot.hashing import HashAlgorithm
from kvdepot.limits import MAX_CHUNK_TOKENS, MAX_FRAME_BYTES
from kvdepot.redact import mask_url

GiB = 1 << 30
MIN_L1_GB = 1 / 1024  # 1 MiB: below that no real chunk fits
MAX_L1_GB = float(1 << 20)


class EvictionPolicyName(str, enum.Enum):
    """The L1 eviction policies (``kvdepot.storage.eviction`` has one class per member)."""

    LRU = "lru"
    ISOLATED_LRU = "isolated_lru"  # LRU with a byte quota per cache_salt (set through /quota)
    NOOP = "noop"  # never evicts: a full L1 refuses new stores


class Placement(str, enum.Enum):
    """Where objects live once L2 tiers exist."""

    WRITE_THROUGH = "write_through"  # in L1 and every tier
    SKIP_L1 = "skip_l1"  # in every tier; dropped from L1 once they all have it


class BlockTransfer(str, enum.Enum):
    """The server-driven path (REGISTER_KV_CACHE, STORE_BLOCKS, RETRIEVE_BLOCKS): the server moves a worker's
    paged cache blocks itself, through CUDA IPC (or host cache files in --shm-dir)."""

    AUTO = "auto"  # offer it for every GPU torch sees here, and host cache files when torch is installed
    ON = "on"  # the same, but refuse to start without torch and a CUDA GPU
    OFF = "off"  # never: REGISTER_KV_CACHE is refused (workers use the shm or inline path)


def option(description: str, **constraints: Any) -> msgspec.Meta:
    """Field metadata: constraints, help text, and ``cli`` overrides (``flag``, ``action``)."""
    cli = constraints.pop("cli", None)
    return msgspec.Meta(description=description, extra={"cli": cli or {}}, **constraints)


class ConfigStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Checks its own constraints on construction (msgspec alone checks them only when converting).
    Errors name the field as a flag (``--chunk-size``), or by its own name when ``_flag_prefix`` is
    None (settings that arrive as a JSON object, like a connector's extra config)."""

    _flag_prefix: ClassVar[str | None] = ""

    def __post_init__(self) -> None:
        for name, members in _enum_fields(type(self)):
            value = getattr(self, name)
            if not isinstance(value, members) and value in members._value2member_map_:
                msgspec.structs.force_setattr(self, name, members(value))  # "lru" given in code
        for name, check in _checks(type(self)):
            problem = check(getattr(self, name))
            if problem:
                raise ConfigError(f"{flag_of(type(self), name)} {problem}")
        self._check_together()

    def _check_together(self) -> None:
        """Rules between fields (overridden)."""


class RpcConfig(ConfigStruct, frozen=True, kw_only=True):
    host: Annotated[str, option("address to bind; the endpoint is tcp://HOST:PORT", min_length=1)] = "127.0.0.1"
    port: Annotated[int, option("TCP port; 0 turns TCP off", ge=0, le=65535)] = 5555
    ipc_path: Annotated[str, option("also listen on ipc://IPC_PATH (empty: off)")] = ""
    workers: Annotated[int, option("threads for BLOCKING handlers", ge=1, le=256)] = 4
    io_threads: Annotated[int, option("ZeroMQ I/O threads (each client connection is served by one; inline payloads to several clients move in parallel)",
                                      ge=1, le=64)] = 2  # fmt: skip
    max_frame_mib: Annotated[int, option("largest payload frame in MiB", ge=1, le=256)] = MAX_FRAME_BYTES >> 20
    heartbeat_interval_s: Annotated[float, option("how often idle clients ping", gt=0)] = 1.0
    client_timeout_s: Annotated[float, option("a client silent this long is revoked and its leases end", gt=0)] = 10.0
    # --- security (CurveZMQ; key files from `kvdepot keygen DIR`) ---
    curve_server_key: Annotated[
        str, option("CurveZMQ: the server's secret key file (server.key_secret); clients must then present an admitted key", cli={"metavar": "PATH"})
    ] = ""
    curve_clients: Annotated[
        str,
        option("CurveZMQ: the client keys admitted: a directory of public key files (*.key), or one shared client key file", cli={"metavar": "PATH"}),
    ] = ""

    def _check_together(self) -> None:
        _unbracket_host(self)
        if self.port == 0 and not self.ipc_path:
            raise ConfigError("no endpoint: give --port or --ipc-path")
        if bool(self.curve_server_key) != bool(self.curve_clients):
            raise ConfigError("CurveZMQ needs both --curve-server-key and --curve-clients (make them with `kvdepot keygen DIR`)")
        if self.client_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("--client-timeout-s must be longer than --heartbeat-interval-s")

    @property
    def max_frame_bytes(self) -> int:
        return self.max_frame_mib << 20

    @property
    def curve(self) -> bool:
        return bool(self.curve_server_key)

    @property
    def endpoints(self) -> list[str]:
        eps = [tcp_endpoint(self.host, self.port)] if self.port else []
        if self.ipc_path:
            eps.append(f"ipc://{self.ipc_path}")
        return eps


class StorageConfig(ConfigStruct, frozen=True, kw_only=True):
    l1_size_gb: Annotated[
        float, option("shared-memory L1 size in GiB (reserved at start)", ge=MIN_L1_GB, le=MAX_L1_GB)
    ] = 2.0
    chunk_size: Annotated[int, option("tokens per chunk object", ge=1, le=MAX_CHUNK_TOKENS)] = 256
    hash_algorithm: Annotated[HashAlgorithm, option("chunk hash; xxh3_128 only for trusted deployments")] = HashAlgorithm.SHA256
    eviction_policy: Annotated[
        EvictionPolicyName, option("L1 eviction policy (isolated_lru: LRU with a byte quota per cache_salt, set through /quota)")
    ] = EvictionPolicyName.LRU
    high_watermark: Annotated[float, option("evict when L1 usage exceeds this fraction", gt=0, le=1)] = 0.95
    low_watermark: Annotated[float, option("...down to this fraction", gt=0, le=1)] = 0.85
    lease_ttl_s: Annotated[float, option("a lock nobody renews ends after this long", gt=0)] = 60.0
    prefault: Annotated[bool, option("populate the arena in the background at start-up")] = True
    shm_dir: Annotated[str, option("directory of the shared-memory arena", min_length=1)] = "/dev/shm"
    l1_over_memory: Annotated[
        bool, option("start even when --l1-size-gb exceeds the machine's available memory (the OS may then swap or kill processes)")
    ] = False
    l2: Annotated[
        tuple[str, ...],
        option("add an L2 tier, looked up in the order given: 'TYPE:key=value,...' or JSON '{\"type\": TYPE, ...}'", cli={"action": "append", "metavar": "SPEC"}),
    ] = ()
    l2_placement: Annotated[
        Placement,
        option("write_through keeps objects in L1 and every tier; skip_l1 drops them from L1 once every tier has them"),
    ] = Placement.WRITE_THROUGH
    l2_queue_limit: Annotated[int, option("objects waiting for L2; beyond it new ones are not pushed (counted)", ge=1)] = 65536
    # lifecycle controls (storage/pins.py)
    agent_session_ttl_s: Annotated[
        float, option("an agent session (a conversation's prefix kept across tool-call gaps) ends this long after its last turn", gt=0)
    ] = 300.0

    def _check_together(self) -> None:
        if self.low_watermark > self.high_watermark:
            raise ConfigError("need --low-watermark <= --high-watermark")
        if self.l2_placement is Placement.SKIP_L1 and not self.l2:
            raise ConfigError("--l2-placement skip_l1 drops objects from L1 once every L2 tier has them: it needs an --l2 tier")

    @property
    def l1_size_bytes(self) -> int:
        return int(self.l1_size_gb * GiB)


ADMIN_TOKEN_ENV = "KVDEPOT_ADMIN_TOKEN"


def _unbracket_host(config: msgspec.Struct) -> None:
    """``--host [::1]`` (an IPv6 address as a URL writes it) is ``::1``: the socket APIs want it bare,
    and the endpoints bracket it again where a port follows."""
    host = unbracket(config.host)  # type: ignore[attr-defined]
    if host != config.host:  # type: ignore[attr-defined]
        msgspec.structs.force_setattr(config, "host", host)


def is_loopback(host: str) -> bool:
    """Does binding ``host`` keep a port to this machine? (a host name other than localhost counts as
    not: it may resolve to anything)"""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HttpConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = "http-"

    host: Annotated[str, option("address of the HTTP API", cli={"default": None, "shown": "same as --host"})] = "127.0.0.1"
    port: Annotated[int, option("HTTP port; 0 turns HTTP off", ge=0, le=65535)] = 8080
    allowed_hosts: Annotated[
        tuple[str, ...],
        option(
            "comma-separated extra host names the HTTP API answers to (loopback names, the bound address and this "
            "machine's names always work; others are refused against DNS rebinding)",
            cli={"action": "comma"},
        ),
    ] = ()
    admin_token: Annotated[
        str,
        option(
            f"bearer token that POST/PUT/DELETE requests must send (Authorization: Bearer TOKEN); needed when the HTTP port "
            f"is bound off loopback; GETs stay open. Also from ${ADMIN_TOKEN_ENV}",
            cli={"metavar": "TOKEN", "shown": "none"},
        ),
    ] = ""

    prometheus_port: Annotated[
        int, option("also serve /metrics alone on this port (on the HTTP API's address); 0 turns it off", ge=0, le=65535)
    ] = 0
    # Flags that are not --http-*: they are named for what they guard, not for the port they sit on.
    _flags: ClassVar[dict[str, str]] = {"prometheus_port": "--prometheus-port", "admin_token": "--admin-token"}

    def __repr__(self) -> str:  # the token never reaches a log line
        token = "<set>" if self.admin_token else "''"
        return (f"HttpConfig(host={self.host!r}, port={self.port}, allowed_hosts={self.allowed_hosts!r}, "
                f"prometheus_port={self.prometheus_port}, admin_token={token})")

    def _check_together(self) -> None:
        _unbracket_host(self)
        # A token read from a file (a Kubernetes secret, `--from-file`) often ends in a newline that no
        # Authorization header can carry: every mutating request was refused as a wrong token. The guard
        # strips what a client sends, so the token is stripped too (a blank one is then no token at all).
        if self.admin_token != self.admin_token.strip():
            msgspec.structs.force_setattr(self, "admin_token", self.admin_token.strip())
        if not all(" " <= c <= "~" for c in self.admin_token):  # what else a header carries is not what was typed
            raise ConfigError(f"--admin-token (or ${ADMIN_TOKEN_ENV}) must be printable ASCII: an Authorization header cannot carry it otherwise")
        if self.prometheus_port and self.prometheus_port == self.port:
            raise ConfigError("--prometheus-port must differ from --http-port")


class GpuConfig(ConfigStruct, frozen=True, kw_only=True):
    """The server-driven path: copies of a worker's GPU blocks made by this server (``server/modules/blocks.py``)."""

    _flag_prefix: ClassVar[str | None] = "gpu-"

    transfer: Annotated[
        BlockTransfer,
        option("the server-driven path (CUDA IPC): auto offers it where torch sees a GPU; on requires one at start; off refuses it"),
    ] = BlockTransfer.AUTO
    staging_mb: Annotated[
        int, option("device staging buffer per registered worker cache, in MiB, half for stores and half for retrieves (at least one chunk each)", ge=1, le=1 << 20)
    ] = 256
    pin_arena: Annotated[
        bool, option("pin the L1 arena with cudaHostRegister at the first GPU registration (copies are DMA, beside the host)")
    ] = True


class ObservabilityConfig(ConfigStruct, frozen=True, kw_only=True):
    """The event bus and what it feeds: metrics, KV events for routers, the trace recorder, the alarm."""

    event_queue_size: Annotated[
        int, option("events waiting for the bus's drain thread; beyond it new events are dropped (counted); 0 turns the bus off", ge=0, le=1 << 24)
    ] = 65536
    kv_events_endpoint: Annotated[
        str, option("publish KV events for routers here, in vLLM's format (ZeroMQ PUB, e.g. tcp://*:5557)")
    ] = ""
    kv_events_connect: Annotated[
        bool,
        option("connect the KV-event PUB socket to --kv-events-endpoint, where a router's subscriber binds (llm-d's indexer; "
               "vLLM does this for an endpoint with a host), instead of binding it"),
    ] = False
    kv_events_replay_endpoint: Annotated[
        str, option("answer replay requests here (ZeroMQ ROUTER): a subscriber sends a sequence number and gets the batches from it")
    ] = ""
    kv_events_buffer: Annotated[int, option("KV-event batches kept for replay", ge=1, le=1 << 22)] = 10000
    kv_events_topic: Annotated[
        str,
        option("each model's KV-event topic: a template of {model} and {node} (this server's HOST:PORT); llm-d's indexer "
               "reads kv@{node}@{model}, or kv@POD_IP@{model}", cli={"metavar": "TEMPLATE"}),
    ] = "{model}"
    trace_record: Annotated[str, option("record every LOOKUP/STORE/RETRIEVE to this file (replay it with `kvdepot replay`)")] = ""
    lookup_log: Annotated[str, option("write one JSON line per engine lookup to this file (rotated)")] = ""
    lookup_log_max_mb: Annotated[int, option("rotate the lookup log at this size in MiB", ge=1, le=1 << 20)] = 100
    # (at least one: with none, the standard rotation reopens the same file and it grows past the cap)
    lookup_log_backups: Annotated[int, option("rotated lookup logs kept", ge=1, le=1000)] = 5
    silent_miss_window_s: Annotated[
        float, option("warn (log, metric, /healthcheck) when a model with stored objects had lookups but no hit for this long", gt=0)
    ] = 600.0
    # --- OpenTelemetry traces (the optional extra kvdepot[otel]) ---
    otlp_endpoint: Annotated[
        str,
        option("export a span per request to this OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces (needs kvdepot[otel])", cli={"metavar": "URL"}),
    ] = ""
    otlp_service_name: Annotated[str, option("the service.name the spans carry", min_length=1, cli={"metavar": "NAME"})] = "kvdepot"
    otlp_sample_ratio: Annotated[
        float, option("the fraction of requests traced (each decided on its own)", ge=0, le=1, cli={"metavar": "RATIO"})
    ] = 1.0

    def _check_together(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"--otlp-endpoint {mask_url(self.otlp_endpoint)}: give an OTLP/HTTP URL, e.g. http://collector:4318/v1/traces")
        for flag, endpoint in (("--kv-events-endpoint", self.kv_events_endpoint), ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            port = endpoint.rpartition(":")[2]
            # ZeroMQ takes a port above 65535 modulo 65536: the socket was bound (or connected) elsewhere, silently
            if zmq_endpoint_host(endpoint) is not None and port != "*" and not (port.isdigit() and int(port) <= 65535):
                raise ConfigError(f"{flag} {endpoint}: the port must be a number up to 65535 (or * for any)")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint replays what --kv-events-endpoint publishes: give that too")
        if self.kv_events_connect:
            if not self.kv_events_endpoint:
                raise ConfigError("--kv-events-connect connects to --kv-events-endpoint: give the router's address there")
            if zmq_endpoint_host(self.kv_events_endpoint) in ("*", "0.0.0.0", "[::]", "::"):
                raise ConfigError(f"--kv-events-connect: {self.kv_events_endpoint} is every interface, not an address to connect to: "
                                  f"give the host where the router's subscriber binds")  # fmt: skip


_ANY_IPV4 = ("*", "0.0.0.0", "")


def hosts_overlap(a: str, b: str) -> bool:
    """Could listeners on hosts ``a`` and ``b`` clash on one port? Two different addresses do not (nor
    IPv4 and IPv6 ones); a wildcard clashes with its family, ``::`` (dual-stack) with all; a host name
    might be any address, so it counts as clashing."""
    a, b = unbracket(a), unbracket(b)
    if "::" in (a, b):
        return True
    ip_a, ip_b = _ip_or_none(a), _ip_or_none(b)
    if a in _ANY_IPV4 or b in _ANY_IPV4:
        other = ip_b if a in _ANY_IPV4 else ip_a
        return other is None or other.version == 4
    if ip_a is None or ip_b is None:
        return True  # a name resolves to some address: maybe the other one
    return ip_a == ip_b


def _ip_or_none(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(unbracket(host))
    except ValueError:
        return None


def unbracket(host: str) -> str:
    """``[::1]`` -> ``::1`` (an IPv6 literal as a URL writes it); anything else as it is."""
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return inner if _is_ipv6(inner) else host


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def host_port(host: str, port: int | str) -> str:
    """``HOST:PORT``, an IPv6 literal bracketed (``[::1]:8080``): ``::1:8080`` is no address a client reads."""
    host = unbracket(host)
    return f"[{host}]:{port}" if _is_ipv6(host) else f"{host}:{port}"


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://HOST:PORT`` as ZeroMQ binds or connects it (an IPv6 literal bracketed)."""
    return f"tcp://{host_port(host, port)}"


def is_ipv6_endpoint(endpoint: str) -> bool:
    """Does this ``tcp://`` endpoint name an IPv6 address (its socket then needs ``ZMQ_IPV6``)? The
    same test as ``kvdepot.rpc.endpoints.is_ipv6_endpoint``, for the layers that may not import rpc."""
    host = zmq_endpoint_host(endpoint)
    return host is not None and _is_ipv6(unbracket(host.split(";", 1)[-1]))


def zmq_endpoint_host(endpoint: str) -> str | None:
    """The host a tcp:// ZeroMQ endpoint binds (``*`` for every interface); None for ipc:// and the like,
    which stay on this machine."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]


# --- runtime plugins (kvdepot.server.plugins runs them; kvdepot.plugins is what a plugin reads) -----

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


def split_plugin_spec(spec: str) -> tuple[str, tuple[str, ...]]:
    """``MODULE[:ARGS]`` -> (module, ARGS split as a shell would); ValueError saying what is wrong."""
    module, _, args = spec.partition(":")
    module = module.strip()
    if not _MODULE_NAME.match(module):
        raise ValueError(f"{module!r} is not a Python module name (MODULE[:ARGS], e.g. kvdepot.plugins.usage_log:/var/log/kvdepot-usage.jsonl)")
    try:
        return module, tuple(shlex.split(args))
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"the arguments {args!r} do not parse: {exc}") from None


class PluginConfig(ConfigStruct, frozen=True, kw_only=True):
    """Programs the server runs beside itself (``python -m MODULE ARGS``), restarted when they exit."""

    specs: Annotated[
        tuple[str, ...],
        option(
            "run a plugin process: 'MODULE[:ARGS]' (python -m MODULE ARGS, ARGS split like a shell), with the server's config in its "
            "environment; restarted with backoff when it exits, stopped at shutdown (repeatable)",
            cli={"action": "append", "metavar": "MODULE[:ARGS]"},
        ),
    ] = ()
    grace_s: Annotated[float, option("at shutdown a plugin gets SIGTERM, then SIGKILL after this long", gt=0, le=600)] = 5.0
    _flags: ClassVar[dict[str, str]] = {"specs": "--plugin", "grace_s": "--plugin-grace-s"}

    def _check_together(self) -> None:
        for spec in self.specs:
            try:
                split_plugin_spec(spec)
            except ValueError as exc:
                raise ConfigError(f"--plugin {spec!r}: {exc}") from None


class ServerConfig(ConfigStruct, frozen=True, kw_only=True):
    rpc: RpcConfig = msgspec.field(default_factory=RpcConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    observability: ObservabilityConfig = msgspec.field(default_factory=ObservabilityConfig)
    plugins: PluginConfig = msgspec.field(default_factory=PluginConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    log_level: Annotated[Literal["debug", "info", "warning", "error"], option("log level")] = "info"
    insecure: Annotated[
        bool,
        option("serve off loopback without authentication (no CurveZMQ on --host, no --admin-token on --http-host): trusted networks only"),
    ] = False

    def _check_together(self) -> None:
        self._check_own_ports()
        self._check_authentication()

    def _listeners(self) -> list[tuple[str, str, int]]:
        """(flag, host, port) of every TCP port this server listens on (a port 0 is off)."""
        rpc, http, obs = self.rpc, self.http, self.observability
        out = [("--port", rpc.host, rpc.port), ("--http-port", http.host, http.port), ("--prometheus-port", http.host, http.prometheus_port)]
        # A connected PUB socket (--kv-events-connect) listens on nothing.
        kv_events = [] if obs.kv_events_connect else [("--kv-events-endpoint", obs.kv_events_endpoint)]
        kv_events.append(("--kv-events-replay-endpoint", obs.kv_events_replay_endpoint))
        for flag, endpoint in kv_events:
            host, port = zmq_endpoint_host(endpoint), endpoint.rpartition(":")[2]
            if host is not None and port.isdigit():
                out.append((flag, unbracket(host), int(port)))
        return [(flag, host, port) for flag, host, port in out if port]

    def _check_own_ports(self) -> None:
        """Two of this server's own listeners on one port: the second bind failed with "in use (another
        process listens there)", and the operator went looking for a process that does not exist."""
        listeners = self._listeners()
        for i, (flag_a, host_a, port) in enumerate(listeners):
            for flag_b, host_b, port_b in listeners[i + 1 :]:
                if port == port_b and hosts_overlap(host_a, host_b):
                    where = host_a if host_a == host_b else f"{host_a} and {host_b}"
                    raise ConfigError(f"{flag_a} and {flag_b} are both port {port} on {where}: this server cannot "
                                      f"listen on one port twice; give each its own")  # fmt: skip

    def _check_authentication(self) -> None:
        """Off loopback, anyone who reaches a port could read and poison the cache: authentication, or
        the operator's explicit --insecure."""
        if self.insecure:
            return
        rpc, http = self.rpc, self.http
        if rpc.port and not is_loopback(rpc.host) and not rpc.curve:
            raise ConfigError(
                f"--host {rpc.host} is not loopback and the ZeroMQ port has no authentication: give --curve-server-key and "
                f"--curve-clients (make keys with `kvdepot keygen DIR`), or --insecure on a trusted network"
            )
        if http.port and not is_loopback(http.host) and not http.admin_token:
            raise ConfigError(
                f"--http-host {http.host} is not loopback and the admin API has no token: give --admin-token TOKEN "
                f"(or ${ADMIN_TOKEN_ENV}), or --insecure on a trusted network"
            )
        # The KV-event stream names every model, chunk hash and tenant's cache_salt (and token ids where
        # clients opt in), and has no authentication of its own.
        obs = self.observability
        for flag, endpoint in (("--kv-events-endpoint", obs.kv_events_endpoint), ("--kv-events-replay-endpoint", obs.kv_events_replay_endpoint)):
            host = zmq_endpoint_host(endpoint)
            if host is not None and not is_loopback(host):
                raise ConfigError(
                    f"{flag} {endpoint} is not loopback and KV events have no authentication (they name every chunk hash and "
                    f"tenant's cache_salt): use 127.0.0.1 or ipc://, or give --insecure on a trusted network"
                )
        # Spans carry each request's model and cache_salt too: in clear text only to this machine.
        if obs.otlp_endpoint.startswith("http://"):
            host = urlsplit(obs.otlp_endpoint).hostname or ""
            if not is_loopback(host):
                raise ConfigError(
                    f"--otlp-endpoint {mask_url(obs.otlp_endpoint)} sends every request's span (with its tenant's cache_salt) in clear "
                    f"text off this machine: use an https:// collector, one on 127.0.0.1, or give --insecure on a trusted network"
                )


# --- constraints ---------------------------------------------------------------------------------


def flag_of(cls: type, name: str) -> str:
    if name in getattr(cls, "_flags", {}):  # a flag named otherwise than its prefix would make it
        return cls._flags[name]
    if cls._flag_prefix is None:
        return name
    return f"--{cls._flag_prefix}{name.replace('_', '-')}"


@functools.cache
def _enum_fields(cls: type) -> list[tuple[str, type[enum.Enum]]]:
    """(field, enum class) for every enum-typed field of ``cls``."""
    return [(f.name, t.cls) for f in msgspec.inspect.type_info(cls).fields if isinstance(t := _bare(f.type), msgspec.inspect.EnumType)]


def _bare(t: Any) -> Any:
    return t.type if isinstance(t, msgspec.inspect.Metadata) else t


@functools.cache
def _checks(cls: type) -> list[tuple[str, Any]]:
    """(field, check(value) -> problem or '') for every constrained field of ``cls``."""
    out = []
    for f in msgspec.inspect.type_info(cls).fields:
        t = _bare(f.type)
        check = _check_for(t)
        if check is not None:
            out.append((f.name, check))
    return out


def _check_for(t: Any):
    if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        lo = t.ge if t.ge is not None else t.gt
        hi = t.le if t.le is not None else t.lt
        closed = ("[" if t.gt is None else "(", "]" if t.lt is None else ")")
        is_float = isinstance(t, msgspec.inspect.FloatType)

        def check_number(v: Any) -> str:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (not is_float and not isinstance(v, int)):
                return f"{v!r} is not {'a number' if is_float else 'an integer'}"
            if is_float and not math.isfinite(v):
                return f"{v} must be a finite number"
            bad = (t.ge is not None and v < t.ge) or (t.gt is not None and v <= t.gt) or (t.le is not None and v > t.le) or (
                t.lt is not None and v >= t.lt
            )
            if not bad:
                return ""
            if lo is not None and hi is not None:
                return f"{v:g} is outside {closed[0]}{lo:g}, {hi:g}{closed[1]}"
            return f"{v:g} must be {'>=' if t.ge is not None else '>' if t.gt is not None else '<=' if t.le is not None else '<'} {(lo if lo is not None else hi):g}"

        return check_number
    if isinstance(t, msgspec.inspect.StrType) and t.min_length:
        return lambda v: "must not be empty" if isinstance(v, str) and len(v) < t.min_length else ""
    if isinstance(t, msgspec.inspect.LiteralType):
        return lambda v: "" if v in t.values else f"{v!r} is not one of {list(t.values)}"
    if isinstance(t, msgspec.inspect.EnumType):
        return lambda v: "" if isinstance(v, t.cls) else f"{v!r} is not one of {[m.value for m in t.cls]}"
    return None


# --- the command line ----------------------------------------------------------------------------


def add_config_args(parser: argparse.ArgumentParser, cls: type[ConfigStruct], title: str, extra_help: dict[str, str] | None = None) -> None:
    """One flag per field of ``cls`` (nested structs are their own groups), help showing the default."""
    group = parser.add_argument_group(title)
    defaults = cls()
    for f in msgspec.inspect.type_info(cls).fields:
        meta = f.type if isinstance(f.type, msgspec.inspect.Metadata) else None
        t = meta.type if meta is not None else f.type
        if isinstance(t, msgspec.inspect.StructType):
            continue
        cli = (meta.extra or {}).get("cli", {}) if meta is not None else {}
        doc = (meta.extra_json_schema or {}).get("description", "") if meta is not None else ""
        doc += (extra_help or {}).get(f.name, "")
        default = getattr(defaults, f.name)
        flag = cli.get("flag") or flag_of(cls, f.name)
        dest = f"{cls.__name__}.{f.name}"
        shown = cli.get("shown", "%(default)s")
        if isinstance(t, msgspec.inspect.BoolType):
            if default:  # on by default: the flag turns it off
                group.add_argument(f"--no-{flag[2:]}", dest=dest, action="store_false", default=True, help=f"do not {doc}")
            else:
                group.add_argument(flag, dest=dest, action="store_true", default=False, help=doc)
            continue
        kw: dict[str, Any] = {"dest": dest, "default": cli.get("default", default), "metavar": cli.get("metavar", f.name.upper())}
        if default == "":
            shown = "off"
        if cli.get("action") == "append":
            kw.update(action="append", default=[], metavar=cli.get("metavar"))
            shown = "none"
        elif cli.get("action") == "comma":
            kw.update(type=_comma_list, default=())
            shown = "none"
        elif isinstance(t, msgspec.inspect.LiteralType):
            kw["choices"] = list(t.values)
            kw.pop("metavar")
        elif isinstance(t, msgspec.inspect.EnumType):
            kw["choices"] = [m.value for m in t.cls]
            kw["default"] = default.value
            kw.pop("metavar")
        elif isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
            kw["type"] = int if isinstance(t, msgspec.inspect.IntType) else float
        group.add_argument(flag, help=f"{doc} (default: {shown})", **kw)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def config_values(cls: type[ConfigStruct], args: argparse.Namespace) -> dict[str, Any]:
    """The values ``add_config_args(parser, cls, ...)`` parsed, by field name."""
    return _values_of(cls, args)


def _values_of(cls: type[ConfigStruct], args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"{cls.__name__}."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def add_server_args(p: argparse.ArgumentParser, tier_help: str = "") -> None:
    add_config_args(p, RpcConfig, "RPC (ZeroMQ)")
    add_config_args(p, StorageConfig, "storage (L1 and L2 tiers)", {"l2": f". Types: {tier_help}".replace("%", "%%") if tier_help else ""})
    add_config_args(p, HttpConfig, "HTTP API")
    add_config_args(p, ObservabilityConfig, "observability (event bus, KV events, traces)")
    add_config_args(p, PluginConfig, "runtime plugins")
    add_config_args(p, GpuConfig, "the server-driven path (GPU workers)")
    add_config_args(p, ServerConfig, "logging and security")


def server_from_args(a: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags describe; ConfigError (a ValueError) naming the first bad flag."""
    rpc = _build(RpcConfig, _values_of(RpcConfig, a))
    http_values = _values_of(HttpConfig, a)
    http_values.setdefault("host", rpc.host)  # --http-host defaults to --host
    if not http_values.get("admin_token") and os.environ.get(ADMIN_TOKEN_ENV):
        http_values["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
    storage_values = _values_of(StorageConfig, a)
    storage_values["l2"] = tuple(storage_values.get("l2", ()))
    return _build(
        ServerConfig,
        {
            "rpc": rpc,
            "storage": _build(StorageConfig, storage_values),
            "http": _build(HttpConfig, http_values),
            "observability": _build(ObservabilityConfig, _values_of(ObservabilityConfig, a)),
            "plugins": _build(PluginConfig, {**(pv := _values_of(PluginConfig, a)), "specs": tuple(pv.get("specs", ()))}),
            "gpu": _build(GpuConfig, _values_of(GpuConfig, a)),
            **_values_of(ServerConfig, a),
        },
    )


def _build(cls: type, values: dict[str, Any]):
    try:
        return cls(**values)
    except TypeError as exc:  # a field's type (argparse converted it already, so only in code)
        raise ConfigError(f"{cls.__name__}: {exc}") from None

