"""The event bus and every concern it feeds, built from ``ObservabilityConfig``: one part of the server.

::

    built (flags checked; subscribers wired) ─► bind() (KV-events sockets, with the server's other ports)
      ─► open_files() (trace recording, lookup log: once the ports are ours) ─► attach(storage)
      ─► start() ─► [serving: housekeeping(), reasons()] ─► close()

Concerns: metrics (latency, removals, tier events, the bus's own counters), the recent-events ring
behind ``/events/recent``, the per-tenant tally, the silent-miss alarm, KV events for routers, the
trace recorder, the lookup log and OpenTelemetry spans. Each is a subscriber; none is on the request
path. ``close`` comes after every producer has stopped, so what they said last is still handed out.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from typing import TYPE_CHECKING

from kvdepot import __version__
from kvdepot.config import ObservabilityConfig
from kvdepot.errors import ConfigError
from kvdepot.events import ChunkRequestDone, L1Changed, NamespaceSeen
from kvdepot.observability import recent
from kvdepot.observability.alarm import SilentMissAlarm
from kvdepot.observability.bus import Dropped, EventBus
from kvdepot.observability.kv_events import KVEventsPublisher, topic_template_problem
from kvdepot.observability.lookup_log import LookupLog
from kvdepot.observability.metrics import Metrics
from kvdepot.observability.tenants import TenantTally
from kvdepot.observability.trace import TraceRecorder
from kvdepot.server.state import Context
from kvdepot.storage.manager import StorageManager

if TYPE_CHECKING:
    from kvdepot.observability.tracing import OtlpExport  # imports OpenTelemetry: only when --otlp-endpoint is given

ALARM_CHECK_S = 1.0  # a window of silence ends without any event saying so: the alarm looks this often


def otlp_export(config: ObservabilityConfig) -> OtlpExport | None:
    """The OpenTelemetry exporter for ``--otlp-endpoint`` (an ``OtlpExport``), or None. OpenTelemetry is
    an optional extra: it is imported here only, and only when the flag is given."""
    if not config.otlp_endpoint:
        return None
    try:
        from kvdepot.observability.tracing import OtlpExport
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        raise ConfigError(f"--otlp-endpoint needs OpenTelemetry ({exc.name} is not installed): pip install kvdepot[otel]") from None
    return OtlpExport(config.otlp_endpoint, config.otlp_service_name, config.otlp_sample_ratio, __version__)


def kv_events_publisher(config: ObservabilityConfig, metrics: Metrics, node: str) -> KVEventsPublisher | None:
    """The publisher of KV events for routers, or None without ``--kv-events-endpoint``. A topic
    template with another placeholder than {model} and {node} is a ConfigError naming the flag,
    given or not with an endpoint (a typo found when the endpoint is added later is found late)."""
    problem = topic_template_problem(config.kv_events_topic)
    if problem:
        raise ConfigError(f"--kv-events-topic {config.kv_events_topic!r}: {problem}")
    if not config.kv_events_endpoint:
        return None
    return KVEventsPublisher(
        config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_buffer, metrics, topic=config.kv_events_topic, node=node,
        connect=config.kv_events_connect,
    )


TALLY_RESYNC_S = 5.0


class Observers:
    def __init__(self, config: ObservabilityConfig, metrics: Metrics, node: str = "") -> None:
        """``node``: this server's name in a fleet (``HOST:PORT``), the ``{node}`` of
        ``--kv-events-topic``; the host name alone when not given."""
        self.config = config
        self.bus = EventBus(config.event_queue_size)
        if not self.bus.enabled:
            needing = [flag for flag, on in (("--kv-events-endpoint", config.kv_events_endpoint), ("--trace-record", config.trace_record),
                                             ("--lookup-log", config.lookup_log), ("--otlp-endpoint", config.otlp_endpoint)) if on]  # fmt: skip
            if needing:
                raise ConfigError(f"{needing[0]} needs the event bus: --event-queue-size must be > 0")
        metrics.subscribe_to(self.bus)
        self.recent = recent.RecentEvents()  # what /events/recent and the dashboard show
        self.bus.subscribe("recent", recent.bus_feed(self.recent), recent.BUS_KINDS)
        self.log_to_recent = recent.RecentLogHandler(self.recent)
        self.tenants = TenantTally()
        # Dropped: the bus lost records (a removal, maybe): the tally starts over from what L1 holds
        self.bus.subscribe("tenants", self._tally, (L1Changed, Dropped))
        self._storage: StorageManager | None = None
        self._resync_owed = False
        self._resynced_at = -math.inf
        metrics.watch_tenants(self.tenants.snapshot)
        self.alarm = SilentMissAlarm(config.silent_miss_window_s, on_change=lambda model, firing: metrics.silent_miss.labels(model).set(int(firing)),
                                     on_forget=metrics.forget_silent_miss)  # fmt: skip
        self.bus.subscribe("alarm", self.alarm.handle, SilentMissAlarm.KINDS)
        self._next_alarm_check = 0.0
        self.kv_events = kv_events_publisher(config, metrics, node or socket.gethostname())
        self.otlp = otlp_export(config)  # spans from the bus's request records; exported from start() on
        if self.otlp is not None:
            self.bus.subscribe("otlp", self.otlp.spans.handle, self.otlp.spans.KINDS)
        self.recorder: TraceRecorder | None = None
        self.lookup_log: LookupLog | None = None

    def _tally(self, events: list) -> None:
        for e in events:
            if isinstance(e, Dropped):
                self._resync_owed = True
            else:
                self.tenants.on_events(list(e.events))
        # A resync lists all of L1 under its table's lock: at most one per TALLY_RESYNC_S however many
        # drops a burst makes (one owed meanwhile is done by the first batch after it).
        now = time.monotonic()
        if self._resync_owed and self._storage is not None and now - self._resynced_at >= TALLY_RESYNC_S:
            self._resync_owed, self._resynced_at = False, now
            self.tenants.resync(self._storage.ready_objects())

    # --- building ----------------------------------------------------------------------------------

    def bind(self) -> str | None:
        """Bind the KV-events sockets; the problem, naming the flags, or None."""
        if self.kv_events is None:
            return None
        try:
            self.kv_events.bind()
        except OSError as exc:
            c = self.config
            return f"--kv-events-endpoint {c.kv_events_endpoint} / --kv-events-replay-endpoint {c.kv_events_replay_endpoint}: {exc}"
        return None

    def unbind(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    def open_files(self) -> None:
        """Open the recording and the lookup log (after the ports are ours: a server that cannot start
        leaves an old recording be). A path that cannot be written is a ConfigError naming its flag."""
        c = self.config
        if c.trace_record:
            self.recorder = TraceRecorder(c.trace_record, __version__)
            self.bus.subscribe("tracing", self.recorder.handle, (ChunkRequestDone,))
        if c.lookup_log:
            try:
                self.lookup_log = LookupLog(c.lookup_log, c.lookup_log_max_mb, c.lookup_log_backups)
            except OSError as exc:
                self._close_files()
                raise ConfigError(f"--lookup-log {c.lookup_log}: {exc.strerror or exc}") from None
            self.bus.subscribe("lookup_log", self.lookup_log.handle, LookupLog.KINDS)

    def attach(self, storage: StorageManager) -> None:
        """L1's batches onto the bus (with the bus off, to the tenant tally directly), and the tiers'
        names for KV events' media."""
        self._storage = storage
        if self.bus.enabled:
            storage.subscribe(lambda batch: self.bus.publish(L1Changed(tuple(batch))))
        else:
            # --event-queue-size 0: no bus carries L1's batches, and the tally fed only through it said every
            # tenant held nothing (/status, the dashboard, the tenant metrics) while /quota counted its bytes.
            # Fed directly instead: quick, its own lock, and made for batches in any order.
            storage.subscribe(self.tenants.on_events)
        if self.kv_events is not None:
            self.kv_events.name_tiers(storage.tier_names())
            self.bus.subscribe("kv_events", self.kv_events.handle, KVEventsPublisher.KINDS)

    def namespace_seen(self, context: Context, salt: str, digest: bytes) -> None:
        """The context registry's hook: what a namespace digest means (KV events name blocks by it)."""
        spec = context.spec
        self.bus.publish(NamespaceSeen(digest, spec.model, spec.world_size, spec.rank, salt, spec.chunk_size))

    # --- running -----------------------------------------------------------------------------------

    def start(self) -> None:
        logging.getLogger("kvdepot").addHandler(self.log_to_recent)
        if self.kv_events is not None:
            self.kv_events.start()  # its first batch goes out before the drain thread owns the socket
        if self.otlp is not None:
            self.otlp.start()
        self.bus.start()

    def housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._next_alarm_check:
            self._next_alarm_check = now + ALARM_CHECK_S
            self.alarm.check()

    def reasons(self) -> list[str]:
        """What ``/healthcheck`` should say on top of storage's reasons (a silent-miss alarm)."""
        return self.alarm.reasons()

    def close(self) -> None:
        self.bus.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self._close_files()
        if self.otlp is not None:
            self.otlp.close()  # after the bus: the last requests' spans are made, then flushed
        logging.getLogger("kvdepot").removeHandler(self.log_to_recent)

    def _close_files(self) -> None:
        for log_file in (self.recorder, self.lookup_log):
            if log_file is not None:
                log_file.close()
