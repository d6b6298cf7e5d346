"""What every engine connector needs around a KVClient: its settings, telling a transport failure from a
request's own problem, a circuit breaker per direction, counting both in the log, and one resilient
client (connected on first need, checked, switched off for a while after a transport failure).

Failure classes:

- **transport** (no connection, a timeout, the server shutting down): the server cannot be reached in
  time, so asking again at once would stall every step. The *failing direction* (``Direction``: lookups,
  loads, saves, or connecting) is switched off: its ``CircuitBreaker`` (``kvdepot.breaker``, the one
  design tiers use too) goes DOWN, calls in that direction are misses at once, and after
  ``retry_after_s`` one call probes the server; the first reply to a request of that direction closes it
  again. The other directions go on.
- **per request** (an expired or revoked lease, a chunk evicted since its lookup, a checksum miss, a
  quota refusal, a bad request): that request recomputes what it lacks, and nothing else changes.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from kvdepot.breaker import CircuitBreaker
from kvdepot.client.client import CurveClientKeys, KVClient, check_url
from kvdepot.client.options import ClientOptions, Transport
from kvdepot.config import ConfigError, ConfigStruct, option
from kvdepot.errors import ChannelBusy, ErrorCode, KVDepotError
from kvdepot.layout import KVLayout
from kvdepot.limits import MAX_CHUNK_TOKENS
from kvdepot.protocol.messages import RequestType

S = TypeVar("S", bound="ClientSettings")
LOG_LEVEL_ENV = "KVDEPOT_LOG_LEVEL"


def ensure_logging() -> None:
    """Make the connectors' INFO lines (each request's hit) visible inside an engine that configures
    only its own logger (vLLM does: its messages go through the ``vllm`` logger, and nothing handles
    others'). When neither the ``kvdepot`` logger nor the root logger has a handler, ``kvdepot`` gets one
    on stderr at ``KVDEPOT_LOG_LEVEL`` (INFO by default); an engine or application that configured
    logging itself (SGLang does) is left as it is. Idempotent."""
    logger = logging.getLogger("kvdepot")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvdepot] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    wanted = os.environ.get(LOG_LEVEL_ENV, "INFO")
    level = logging.getLevelName(wanted.strip().upper())
    # A typo here raised logging's ValueError inside the engine's connector set-up: the engine did not start.
    logger.setLevel(level if isinstance(level, int) else logging.INFO)
    if not isinstance(level, int):
        logger.warning("%s=%r is not a log level (debug, info, warning, error): logging at INFO", LOG_LEVEL_ENV, wanted)


class ClientSettings(ConfigStruct, frozen=True, kw_only=True):
    """The settings every connector has, from its engine's extra-config JSON (unknown keys are an error;
    errors name the key)."""

    _flag_prefix: ClassVar[str | None] = None  # keys, not flags

    url: Annotated[str, option("the kvdepot server's ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")] = "tcp://127.0.0.1:5555"
    model_name: Annotated[
        str, option("the model part of every key; empty: the engine's model. Engines share chunks only when they agree on it")
    ] = ""
    chunk_size: Annotated[
        int, option("tokens per chunk, a multiple of the engine's block size; 0: 256 rounded up to one", ge=0, le=MAX_CHUNK_TOKENS)
    ] = 0
    transport: Annotated[
        Transport,
        option("shm (same host, one copy), inline, cuda_ipc (vLLM on a GPU: the server copies the blocks itself), or auto (cuda_ipc "
               "where the server offers this GPU, else shm, else inline)"),
    ] = Transport.AUTO
    timeout_s: Annotated[float, option("deadline of one request to the server", gt=0)] = 5.0
    retry_after_s: Annotated[
        float, option("after a transport failure, how long the failing direction leaves the server alone", ge=0)
    ] = 5.0
    curve_server_key: Annotated[str, option("CurveZMQ: the server's public key file (server.key from `kvdepot keygen`)")] = ""
    curve_client_key: Annotated[str, option("CurveZMQ: this client's secret key file (client.key_secret), admitted by the server")] = ""

    def _check_together(self) -> None:
        try:
            check_url(self.url)
        except ValueError as exc:
            raise ConfigError(f"url: {exc}") from None
        if bool(self.curve_server_key) != bool(self.curve_client_key):
            raise ConfigError("CurveZMQ needs both curve_server_key and curve_client_key")
        if self.curve_server_key:
            self.curve()  # a key file that cannot be read fails the engine's start, naming the key

    def curve(self) -> CurveClientKeys | None:
        """The CurveZMQ keys the settings name (None: a plain connection)."""
        if not self.curve_server_key:
            return None
        try:
            return CurveClientKeys.from_files(self.curve_server_key, self.curve_client_key)
        except ValueError as exc:
            raise ConfigError(f"curve_server_key/curve_client_key: {exc}") from None

    @classmethod
    def from_extra(cls: type[S], extra: dict[str, Any] | None, what: str = "kvdepot connector option") -> S:
        """Settings from a JSON object: strings such as "true" or "256" are converted; unknown keys
        and bad values raise ValueError naming the key."""
        try:
            return msgspec.convert(dict(extra or {}), cls, strict=False)
        except msgspec.ValidationError as exc:
            text = str(exc)
            known = sorted(f.name for f in msgspec.structs.fields(cls))
            if text.startswith("Object contains unknown field"):
                name = text.split("`")[1]
                raise ValueError(f"unknown {what}(s) [{name!r}]; known: {known}") from None
            head, sep, where = text.rpartition(" - at `$.")
            raise ValueError(f"{what} {where.rstrip('`')}: {head}" if sep else f"{what}: {text}") from None

TRANSPORT_CODES = frozenset(
    {ErrorCode.TIMEOUT, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CONNECTION, ErrorCode.SHUTTING_DOWN, ErrorCode.VERSION_MISMATCH}
)


def is_transport_failure(exc: BaseException) -> bool:
    """True when the server could not be used at all (the breaker opens); False for a problem of one
    request (it recomputes). A wait for the channel another thread of this process holds (its own save
    or load in flight) is neither: nothing reached the server, so no direction is switched off."""
    if isinstance(exc, ChannelBusy):
        return False
    return not isinstance(exc, KVDepotError) or exc.code in TRANSPORT_CODES


def failure_class(exc: BaseException) -> str:
    """A short name for logs and counters: 'transport' or the error code's name in lower case."""
    if is_transport_failure(exc):
        return "transport"
    return exc.code.name.lower() if isinstance(exc, KVDepotError) else type(exc).__name__


class Direction(str, enum.Enum):
    """What a connector asks of the server; each has its own breaker, so saves timing out on a busy
    server do not stop lookups."""

    CONNECT = "connect"
    LOOKUP = "lookup"
    LOAD = "load"
    SAVE = "save"


# Which direction's breaker a reply to each request closes (requests not named here close none).
DIRECTION_OF: dict[RequestType, Direction] = {
    RequestType.REGISTER_CONTEXT: Direction.CONNECT,
    RequestType.LOOKUP: Direction.LOOKUP,
    RequestType.QUERY_PREFETCH_STATUS: Direction.LOOKUP,
    RequestType.FREE_LOOKUP_LOCKS: Direction.LOOKUP,
    RequestType.END_SESSION: Direction.LOOKUP,
    RequestType.PREPARE_RETRIEVE: Direction.LOAD,
    RequestType.COMMIT_RETRIEVE: Direction.LOAD,
    RequestType.RETRIEVE_INLINE: Direction.LOAD,
    RequestType.PREPARE_STORE: Direction.SAVE,
    RequestType.COMMIT_STORE: Direction.SAVE,
    RequestType.STORE_INLINE: Direction.SAVE,
    # the server-driven path (the server moves a worker's blocks: cuda_ipc, host cache files): without
    # these, a probe on that path was served and closed nothing, so its direction let one transfer
    # through per retry interval, and turned the others away, for as long as the engine ran
    RequestType.RETRIEVE_BLOCKS: Direction.LOAD,
    RequestType.STORE_BLOCKS: Direction.SAVE,
}


class Breakers:
    """One ``CircuitBreaker`` per ``Direction``. Thread-safe (loader threads use it); several clients
    (one per rank) may share one set."""

    def __init__(self, retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._by = {d: CircuitBreaker(retry_after_s, clock) for d in Direction}
        # Told once each time a switched-off direction is answered again (``ResilientClient``: the log).
        self.on_recovered: Callable[[Direction], None] | None = None

    def __repr__(self) -> str:
        return f"Breakers(down={sorted(d.value for d, b in self._by.items() if not b.up)})"

    def __getitem__(self, direction: Direction) -> CircuitBreaker:
        return self._by[direction]

    def admit(self, direction: Direction) -> bool:
        """May a call in ``direction`` go to the server now? (while it is down: one probe per interval)"""
        return self._by[direction].admit()

    def failed(self, direction: Direction, error: str) -> bool:
        """Switch ``direction`` off; True if it was on until now (worth saying)."""
        return self._by[direction].failed(error)

    def answered(self, rtype: RequestType) -> None:
        """The server answered a request (``RpcChannel.answered``): its direction works."""
        direction = DIRECTION_OF.get(rtype)
        if direction is not None and self._by[direction].succeeded() and self.on_recovered is not None:
            self.on_recovered(direction)


class FailureTally:
    """Counts failures by (direction, class) and logs them: each new class at once, then a summary at
    most every ``every_s`` seconds, so a burst of misses is visible without flooding the log."""

    def __init__(self, logger: logging.Logger, name: str, every_s: float = 30.0) -> None:
        self._log = logger
        self._name = name
        self._every = every_s
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self._last_summary = 0.0

    def add(self, direction: Direction, exc: BaseException, what: str, retry_after_s: float | None = None, switched_off: bool = True) -> str:
        """Count a failure and say it. ``switched_off``: a transport failure that switched its direction
        off (said as a warning); one of a direction that was off already (a probe that failed) is counted,
        and said at debug only: an outage is one warning, then its recovery one line (``recovered``),
        not a warning every ``retry_after_s`` for as long as it lasts."""
        cls = failure_class(exc)
        key = (direction.value, cls)
        with self._lock:
            first = key not in self.counts
            self.counts[key] += 1
            now = time.monotonic()
            summary = now - self._last_summary >= self._every and not first
            if summary:
                self._last_summary = now
                totals = ", ".join(f"{d} {c}: {n}" for (d, c), n in sorted(self.counts.items()))
        if cls == "transport":
            self._log.log(
                logging.WARNING if switched_off else logging.DEBUG,
                "%s: %s failed (%s); no %ss for %.1fs, everything else goes on", self._name, what, exc, direction.value, retry_after_s or 0.0
            )
        elif first:
            self._log.warning("%s: %s failed (%s: %s); that request recomputes what it lacks", self._name, what, cls, exc)
        if summary:
            self._log.info("%s: failures so far: %s", self._name, totals)
        return cls

    def recovered(self, direction: Direction) -> None:
        """A switched-off direction was answered again: said once, with the failures it counted so far."""
        with self._lock:
            failed = self.counts[(direction.value, "transport")]
        what = "connecting" if direction is Direction.CONNECT else f"{direction.value}s"
        self._log.info("%s: %s back on, the server answers again (%d transport failure(s) so far)", self._name, what, failed)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{d}/{c}": n for (d, c), n in self.counts.items()}


class ResilientClient:
    """A KVClient for one engine process (or one TP rank of it), connected on first need rather than in
    the engine's constructor (which may run before it forks), with the chunk size checked, and switched
    off per direction after a transport failure (``Breakers``) until a probe gets through. Several (one
    per rank) may share one set of breakers and one tally. Its client's options come from the
    settings; ``options`` overrides some of them (``dataclasses.replace`` fields)."""

    def __init__(
        self,
        settings: ClientSettings,
        model: str,
        layout: KVLayout,
        chunk_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        connect_timeout_s: float = 1.0,
        breakers: Breakers | None = None,
        tally: FailureTally | None = None,
        **options: Any,
    ) -> None:
        self.settings = settings
        self.model = model
        self.layout = layout
        self.chunk_size = chunk_size
        self.rank = rank
        self.world_size = world_size
        self.options = ClientOptions(
            **{
                "transport": settings.transport,
                "timeout_s": settings.timeout_s,
                # a missing server stalls no step for long
                "connect_timeout_s": min(settings.timeout_s, connect_timeout_s),
                "chunk_size": chunk_size,
                "curve": settings.curve(),
                **options,
            }
        )
        self.breakers = breakers or Breakers(settings.retry_after_s)
        self.tally = tally or FailureTally(logging.getLogger(__name__), "kvdepot")
        if self.breakers.on_recovered is None:  # (ranks sharing one set of breakers share one tally too)
            self.breakers.on_recovered = self.tally.recovered
        self._connect_lock = threading.Lock()  # SGLang calls from its prefetch and backup threads at once
        self.client: KVClient | None = None

    def __repr__(self) -> str:
        return f"ResilientClient({self.settings.url}, rank={self.rank}/{self.world_size}, {self.client!r}, {self.breakers!r})"

    def get(self, direction: Direction) -> KVClient | None:
        """The client for a call in ``direction``, or None while that direction (or connecting) is
        switched off."""
        return self.connected() if self.breakers.admit(direction) else None

    def connected(self) -> KVClient | None:
        """The client, connecting it first if need be (None while connecting is switched off). For a
        caller that admitted its direction itself (several ranks sharing one set of breakers)."""
        if self.client is None:
            with self._connect_lock:
                if self.client is None and self.breakers.admit(Direction.CONNECT):
                    self.client = self._connect()
        return self.client

    def _connect(self) -> KVClient | None:
        try:
            client = KVClient(
                self.settings.url, self.model, self.layout, rank=self.rank, world_size=self.world_size, options=self.options, connect=False
            )
            client.link.channel.answered = self.breakers.answered
            client.connect()
        except KVDepotError as exc:
            self.failed(Direction.CONNECT, exc, f"connecting to {self.settings.url}")
            return None
        if client.chunk_size != self.chunk_size:
            client.close()
            raise ValueError(f"kvdepot registered chunk_size {client.chunk_size}, asked for {self.chunk_size}")
        return client

    def failed(self, direction: Direction, exc: BaseException, what: str) -> str:
        """Count the failure; a transport failure also switches ``direction`` off for a while (said when
        it goes off, not again at each probe that fails while it is off)."""
        switched_off = self.breakers.failed(direction, str(exc)) if is_transport_failure(exc) else False
        return self.tally.add(direction, exc, what, self.settings.retry_after_s, switched_off=switched_off)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
