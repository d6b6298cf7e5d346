"""A peer node's settings: one struct for ``PeerStore(...)``, ``--l2 'peer:...'`` and ``kvdepot peer``."""

from __future__ import annotations

import os
from typing import Annotated, ClassVar

import msgspec

from kvdepot.config import ConfigStruct, flag_of, option
from kvdepot.errors import ConfigError
from kvdepot.peer.addresses import address_id, canonical_host, check_host, split_host_port
from kvdepot.peer.discovery import DEFAULT_MAX_MASTERS
from kvdepot.peer.ring import DEFAULT_VNODES

SECRET_ENV = "KVDEPOT_PEER_SECRET"
DEFAULT_CONTROL_PORT = 31995
DEFAULT_DATA_PORT = 31996


class PeerConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # keys (PeerStore(...), --l2 peer:...); PeerFlags names them as flags

    discovery: Annotated[
        str,
        option("the head node's HOST:PORT (its control port; an IPv6 address in brackets: [::1]:31995), then optionally other "
               "nodes' to bootstrap through, comma-separated; empty: this node is the head"),
    ] = ""  # fmt: skip
    host: Annotated[str, option("address this node listens on and tells the others (control and data plane; IPv6: ::1 or [::1])", min_length=1)] = "127.0.0.1"
    port: Annotated[int, option("control port (discovery, directory); 0 picks a free one", ge=0, le=65535)] = DEFAULT_CONTROL_PORT
    data_port: Annotated[int, option("data-plane port (pages); 0 picks a free one", ge=0, le=65535)] = DEFAULT_DATA_PORT
    pool_size_mb: Annotated[int, option("published pool: host memory other nodes read this node's pages from (LRU)", ge=1)] = 1024
    secret: Annotated[str, option(f"cluster secret for every join and every data-plane connection (else ${SECRET_ENV}; empty: an open cluster)")] = ""
    disk_path: Annotated[str, option("L4: keep pages that leave the pool in this directory and promote them back on a read (empty: off)")] = ""
    disk_size_gb: Annotated[float, option("the disk tier's bound (LRU beyond it)", gt=0)] = 100.0
    metrics_port: Annotated[int, option("Prometheus /metrics and an HTML page (/) on this port (0: off; taken: a warning)", ge=0, le=65535)] = 31997
    metrics_dashboard: Annotated[bool, option("serve the HTML page at / of the metrics port")] = True
    directory_replicas: Annotated[int, option("directory records per key (the owner and the next nodes on the ring)", ge=1, le=8)] = 2
    vnodes: Annotated[int, option("points per node on the consistent-hash ring", ge=1, le=4096)] = DEFAULT_VNODES
    max_channels_per_peer: Annotated[int, option("data-plane connections to one peer at most", ge=1, le=256)] = 16
    max_masters: Annotated[int, option("discovery masters (the head first, then by node id)", ge=1, le=16)] = DEFAULT_MAX_MASTERS
    heartbeat_interval_s: Annotated[float, option("how often a node heartbeats the masters", gt=0)] = 1.0
    member_ttl_s: Annotated[float, option("a node silent this long leaves the cluster", gt=0)] = 5.0
    timeout_s: Annotated[float, option("deadline of one get/exists/set (a slower peer is a miss)", gt=0)] = 2.0
    control_timeout_s: Annotated[float, option("deadline of one directory call to one node (then its replica is asked)", gt=0)] = 1.0
    location_cache_s: Annotated[
        float,
        option("how long a reader remembers where it found a page, to read it again without asking the directory (a stale location "
               "costs one data-plane round trip, then a lookup)", gt=0),
    ] = 5.0
    join_timeout_s: Annotated[float, option("how long start-up waits to join (then it serves its own pages and keeps trying)", ge=0)] = 10.0
    workers: Annotated[int, option("threads running the tier's tasks (as an L2 tier)", ge=1, le=256)] = 4

    def _check_together(self) -> None:
        if self.member_ttl_s <= self.heartbeat_interval_s:
            raise ConfigError("member_ttl_s must be longer than heartbeat_interval_s")
        self._check_addresses()
        self._check_own_ports()

    def _check_own_ports(self) -> None:
        """Two of the node's own listeners on one port: the second bind failed as "in use (another process
        listens there)" (the metrics port's as a warning), and the operator looked for a process that is not there."""
        ports = [(name, getattr(self, name)) for name in ("port", "data_port", "metrics_port")]
        for i, (a, port) in enumerate(ports):
            for b, other in ports[i + 1 :]:
                if port and port == other:  # 0: each picks a free port of its own
                    raise ConfigError(f"{flag_of(type(self), a)} and {flag_of(type(self), b)} are both port {port}: give each its own")

    def _check_addresses(self) -> None:
        """A bad host or discovery address is refused here, naming it, rather than as a bind or a join
        that never answers. ``[::1]`` is kept as ``::1``: the socket APIs want it bare."""
        problem = check_host(self.host)
        if problem:
            raise ConfigError(f"{flag_of(type(self), 'host')}: {problem}")
        if canonical_host(self.host) != self.host:
            msgspec.structs.force_setattr(self, "host", canonical_host(self.host))
        for address in self._addresses():
            try:
                split_host_port(address)
            except ValueError as exc:
                raise ConfigError(f"{flag_of(type(self), 'discovery')}: {exc}") from None

    @property
    def cluster_secret(self) -> str:
        return self.secret or os.environ.get(SECRET_ENV, "")

    @property
    def bootstrap(self) -> list[str]:
        """The discovery addresses as node ids (``[::1]:31995``; IPv4 as written), so the head's own id
        and the address the others were given compare equal."""
        return [address_id(a) for a in self._addresses()]

    def _addresses(self) -> list[str]:
        return [a.strip() for a in self.discovery.split(",") if a.strip()]

    def __repr__(self) -> str:  # the secret never reaches a log line
        fields = ", ".join(f"{f}={'<secret>' if f == 'secret' and self.secret else repr(getattr(self, f))}" for f in self.__struct_fields__)
        return f"PeerConfig({fields})"


class PeerFlags(PeerConfig, frozen=True, kw_only=True):
    """The same settings as ``kvdepot peer`` flags (``--pool-size-mb``): errors name the flag."""

    _flag_prefix: ClassVar[str | None] = ""
