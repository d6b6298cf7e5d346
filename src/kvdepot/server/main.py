"""The composition root: build every part, start them in order, serve, close them in reverse order.

Nothing starts a thread in a constructor; ``start`` does, and ``close`` undoes it. The server is built
from its config and the list of capability modules it serves (``DEFAULT_MODULES``): a new family of
requests plugs in as one more ``ModuleFactory``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence

from kvdepot import __version__
from kvdepot.admin.http import HttpServer
from kvdepot.admin.prometheus import PrometheusServer
from kvdepot.config import BlockTransfer, RpcConfig, ServerConfig, host_port, is_loopback
from kvdepot.daemon import raise_fd_limit, stop_on_signals
from kvdepot.errors import ConfigError, EndpointInUse
from kvdepot.gpu import runtime
from kvdepot.observability.metrics import Metrics
from kvdepot.protocol.messages import RequestType
from kvdepot.rpc.security import CurveServerKeys, load_key_pair
from kvdepot.rpc.server import RpcServer
from kvdepot.server.lifecycle import Lifecycle
from kvdepot.server.liveness import ClientWatch, LivenessTracker
from kvdepot.server.modules import ClosingModule, ModuleFactory, ServerContext
from kvdepot.server.modules.blocks import BlockTransferModule
from kvdepot.server.modules.lifecycle import LifecycleModule
from kvdepot.server.modules.lookup import LookupModule
from kvdepot.server.modules.management import ManagementModule
from kvdepot.server.modules.transfer import TransferModule
from kvdepot.server.observers import Observers
from kvdepot.server.plugins import PluginSupervisor
from kvdepot.server.state import ContextRegistry
from kvdepot.server.status import degraded_reasons, status_document, tenants_document
from kvdepot.storage.manager import QuotaControl, StorageManager
from kvdepot.types import ClearScope, ClientId, NodeId

log = logging.getLogger(__name__)
SESSION_SWEEP_S = 1.0  # how often lookup sessions nobody ended are looked for

DEFAULT_MODULES: tuple[ModuleFactory, ...] = (ManagementModule, LookupModule, TransferModule, LifecycleModule, BlockTransferModule)


def rpc_security(config: RpcConfig) -> CurveServerKeys | None:
    """The ZeroMQ port's CurveZMQ keys, if configured; a key file that cannot be used is a ConfigError
    naming its flag."""
    if not config.curve:
        return None
    try:
        load_key_pair(config.curve_server_key)
    except ValueError as exc:
        raise ConfigError(f"--curve-server-key: {exc}") from None
    try:
        return CurveServerKeys(config.curve_server_key, config.curve_clients)
    except ValueError as exc:
        raise ConfigError(f"--curve-clients: {exc}") from None


def node_id(config: ServerConfig) -> NodeId:
    """This server's name in a fleet: host name and the port (or ipc path) it serves."""
    return NodeId(f"{socket.gethostname()}:{config.rpc.port or config.rpc.ipc_path}")


class KVDepotServer:
    """Built in the order that fails cheapest first: every endpoint is bound (ZeroMQ and HTTP) before the
    arena's memory is reserved, so a taken port is a configuration error naming its flag within a
    moment, not after seconds of reserving and prefaulting gigabytes."""

    def __init__(self, config: ServerConfig, modules: Sequence[ModuleFactory] = DEFAULT_MODULES) -> None:
        self.config = config
        if config.gpu.transfer is BlockTransfer.ON and not runtime.cuda_devices():
            raise ConfigError(f"--gpu-transfer on: this server sees no CUDA GPU through torch ({runtime.INSTALL_HINT})")
        metrics = Metrics()
        self.observers = obs = Observers(config.observability, metrics, node=node_id(config))
        self.rpc = RpcServer(
            config.rpc.endpoints,
            workers=config.rpc.workers,
            io_threads=config.rpc.io_threads,
            max_frame_bytes=config.rpc.max_frame_bytes,
            housekeeping=self._housekeeping,
            goodbyes=(RequestType.UNREGISTER_CONTEXT,),
            metrics=metrics,
            events=obs.bus,
            security=rpc_security(config.rpc),
        )
        self.http = HttpServer(self, config.http) if config.http.port else None
        h = config.http
        self.prometheus = PrometheusServer(metrics.text, h.host, h.prometheus_port, h.allowed_hosts) if h.prometheus_port else None
        self._stopped = threading.Event()
        self._next_session_sweep = 0.0
        self.plugins = PluginSupervisor(config)  # a plugin module that is not there fails here, before any port is taken
        self._bind()
        try:
            obs.open_files()
            self.storage = StorageManager(config.storage, holder_alive=self._holder_alive, node=node_id(config), events=obs.bus)
        except BaseException:
            obs.close()
            self._unbind()
            raise
        self.liveness = LivenessTracker(config.rpc.client_timeout_s, lock_held=self.storage.lock_held)
        self.ctx = ServerContext(config, self.storage, self.liveness, metrics=metrics, events=obs.bus)
        self.ctx.contexts = ContextRegistry(on_namespace=obs.namespace_seen)
        self._lifecycle = Lifecycle(self.storage, self.ctx.contexts)
        obs.attach(self.storage)
        metrics.watch_storage(self.storage.snapshot)
        self._watch = ClientWatch(self.liveness, self.ctx.client_gone)
        self.rpc.observer = self.liveness
        self.modules = [make(self.ctx) for make in modules]
        for module in self.modules:
            self.rpc.add_handlers(module.handlers())

    def _bind(self) -> None:
        """Bind the ZeroMQ endpoints and the HTTP port; every one that cannot be had is named, with its
        flag, in one ConfigError (both ports when both are taken)."""
        rpc, http = self.config.rpc, self.config.http
        problem = self.observers.bind()
        problems = [problem] if problem else []
        for part, flag_in_use, flag_other in (
            (self.rpc, f"--port {rpc.port}", f"--host {rpc.host}"),
            (self.http, f"--http-port {http.port}", f"--http-host {http.host}"),
            (self.prometheus, f"--prometheus-port {http.prometheus_port}", f"--http-host {http.host}"),
        ):
            if part is None:
                continue
            try:
                part.bind()
            except EndpointInUse as exc:
                flag = "--ipc-path" if exc.endpoint.startswith("ipc://") else flag_in_use
                problems.append(f"{flag}: {exc}")
            except OSError as exc:
                # An ipc endpoint (its socket or its lock file) is --ipc-path's, whatever part it is of.
                where = str(exc.filename or "")
                ipc = bool(where) and not where.startswith("tcp://")
                detail = f"{exc.strerror} ({where})" if ipc and not where.startswith("ipc://") else exc.strerror or str(exc)
                problems.append(f"{'--ipc-path' if ipc else flag_other}: {detail}")
        if problems:
            self._unbind()
            raise ConfigError("; ".join(problems))

    def _unbind(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        if self.http is not None:
            self.http.close()
        self.rpc.close()
        self.observers.unbind()

    def _holder_alive(self, client) -> bool:
        """For the object table: may this client still touch arena memory? (loop thread only)"""
        return self.liveness.may_touch_arena(client)

    def _housekeeping(self) -> None:
        """On the RPC loop thread, every 0.1 s: watch the clients, then end what they no longer hold."""
        self._watch.sweep()
        expired = self.storage.expire()
        if expired:
            log.info("%d leases expired (TTL %.1fs)", expired, self.config.storage.lease_ttl_s)
        pins, sessions = self.storage.expire_protections()
        if pins or sessions:
            log.info("%d soft pins and %d agent sessions reached their deadline: their prefixes are evictable again", pins, sessions)
        self.observers.housekeeping()
        if (now := time.monotonic()) >= self._next_session_sweep:
            self._next_session_sweep = now + SESSION_SWEEP_S
            if ended := self.ctx.expire_sessions():
                log.info("%d lookup sessions nobody ended were dropped (their locks had ended, or they sat idle for a lease TTL)", ended)
        released = self.storage.recheck_quarantine()
        if released:
            log.info("%d quarantined leases released: their holders are gone", released)

    def start(self) -> None:
        """Start every part; if one fails, close what was started (the arena is real memory)."""
        try:
            self.observers.start()
            self.storage.start()
            if self.prometheus is not None:
                self.prometheus.start()
            if self.http is not None:
                self.http.start()  # before RPC: a PING reply then means every part is up
            self.rpc.start()
            self.plugins.start()  # last: a plugin that reads the ports at once finds them serving
        except BaseException:
            self.close()
            raise
        log.info(
            "kvdepot %s serving on %s%s (L1 %.2f GiB at %s, chunk %d tokens, hash %s, http %s)",
            __version__,
            ", ".join(self.config.rpc.endpoints),
            " with CurveZMQ" if self.config.rpc.curve else "",
            self.config.storage.l1_size_gb,
            self.storage.shm_offer(ClientId(b"")).path,
            self.config.storage.chunk_size,
            self.config.storage.hash_algorithm.value,
            host_port(self.config.http.host, self.config.http.port) if self.http else "off",
        )
        if self.config.insecure and not (is_loopback(self.config.rpc.host) and is_loopback(self.config.http.host)):
            log.warning("--insecure: serving off loopback without authentication; anyone who reaches these ports can read and write the cache")

    def close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.plugins.stop()  # first: they may still read the server while they stop
        if self.http is not None:
            self.http.close()
        if self.prometheus is not None:
            self.prometheus.close()
        self.rpc.close()
        for module in getattr(self, "modules", ()):
            if isinstance(module, ClosingModule):  # device resources, views of the arena
                module.close()
        self.liveness.close()  # the loop has stopped: its pidfds can go
        self.storage.close()
        self.observers.close()  # after every producer: what they said last is still handed out

    def serve_forever(self) -> None:
        """Start, block until SIGINT/SIGTERM/SIGHUP, then close."""
        stop = threading.Event()
        stop_on_signals(stop, before_exit=self.plugins.kill_now)  # a forced exit leaves no plugin running
        raise_fd_limit()
        self.start()  # closes what it opened if it fails
        try:
            while not stop.wait(0.5):
                pass
        finally:
            log.info("shutting down")
            self.close()

    # --- what the admin API asks (kvdepot.admin.backend.AdminBackend) ---------------------------------

    def rpc_alive(self) -> bool:
        return self.rpc.alive

    def degraded_reasons(self) -> list[str]:
        return degraded_reasons(self.storage.health()) + self.observers.reasons()  # no usage query: a probe answers at once

    def largest_chunk_bytes(self) -> int:
        return self.ctx.contexts.largest_chunk_bytes()

    def clear(self, scope: ClearScope) -> dict:
        result = self.storage.clear(scope)
        return {"removed": result.l1_removed, "tiers_removed": result.tiers_removed}

    def quotas(self) -> QuotaControl | None:
        return self.storage.quotas()

    def lifecycle(self) -> Lifecycle:
        return self._lifecycle

    def metrics_text(self) -> bytes:
        return self.ctx.metrics.text()

    def status(self) -> dict:
        """The /status document; asks each tier's backend (at most 0.5 s each), once."""
        quotas = self.storage.quotas()
        tenants = tenants_document(self.observers.tenants.snapshot(), quotas.all() if quotas is not None else {})
        return status_document(
            self.config,
            self.storage.snapshot(),
            self.liveness.snapshot(),
            self.ctx.metrics,
            len(self.ctx.contexts),
            len(self.ctx.sessions),
            tenants,
            self.plugins.snapshot(),
            next((m.snapshot() for m in self.modules if isinstance(m, BlockTransferModule)), None),
        )

    def recent_events(self, n: int, kinds: tuple[str, ...] = (), after: int = 0) -> list[dict]:
        return self.observers.recent.latest(n, kinds, after)
