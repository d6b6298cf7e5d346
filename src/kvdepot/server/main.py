"""The composition root: build every part, start them in order, serve, close them in reverse order.

Nothing starts a thread in a constructor; ``start`` does, and ``close`` undoes it.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading

from kvdepot import __version__
from kvdepot.config import ServerConfig
from kvdepot.server.liveness import LivenessTracker
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.lookup import LookupModule
from kvdepot.server.modules.management import ManagementModule
from kvdepot.server.modules.transfer import TransferModule
from kvdepot.server.rpc import RpcServer
from kvdepot.admin.http import HttpServer
from kvdepot.observability.metrics import counts
from kvdepot.storage.manager import ClearScope, QuotaControl, StorageManager, StorageSnapshot
from kvdepot.types import ClientId

log = logging.getLogger(__name__)


class KVDepotServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        node = f"{socket.gethostname()}:{config.rpc.port or config.rpc.ipc_path}"
        self.storage = StorageManager(config.storage, holder_alive=self._holder_alive, node=node)
        liveness = LivenessTracker(config.rpc.client_timeout_s, lock_held=self.storage.lock_held)
        self.ctx = ServerContext(config, self.storage, liveness)
        self.ctx.metrics.watch_storage(self.storage.snapshot)
        self.management = ManagementModule(self.ctx)
        modules = [self.management, LookupModule(self.ctx), TransferModule(self.ctx)]
        self.rpc = RpcServer(
            config.rpc.endpoints,
            [spec for module in modules for spec in module.handlers()],
            self.ctx.liveness,
            on_client_gone=self.management.client_gone,
            workers=config.rpc.workers,
            max_frame_bytes=config.rpc.max_frame_bytes,
            housekeeping=self._housekeeping,
            metrics=self.ctx.metrics,
        )
        self.http = HttpServer(self, config.http) if config.http.port else None
        self._stopped = threading.Event()

    def _holder_alive(self, client) -> bool:
        """For the object table: may this client still touch arena memory? (loop thread only)"""
        return self.ctx.liveness.may_touch_arena(client)

    def _housekeeping(self) -> None:
        expired = self.storage.expire()
        if expired:
            log.info("%d leases expired (TTL %.1fs)", expired, self.config.storage.lease_ttl_s)
        released = self.storage.recheck_quarantine()
        if released:
            log.info("%d quarantined leases released: their holders are gone", released)

    def start(self) -> None:
        """Start every part; if one fails, close what was started (the arena is real memory)."""
        try:
            self.storage.start()
            if self.http is not None:
                self.http.start()  # before RPC: a PING reply then means every part is up
            self.rpc.start()
        except BaseException:
            self.close()
            raise
        log.info(
            "kvdepot %s serving on %s (L1 %.2f GiB at %s, chunk %d tokens, hash %s, http %s)",
            __version__,
            ", ".join(self.config.rpc.endpoints),
            self.config.storage.l1_size_gb,
            self.storage.shm_offer(ClientId(b"")).path,
            self.config.storage.chunk_size,
            self.config.storage.hash_algorithm,
            f"{self.config.http.host}:{self.config.http.port}" if self.http else "off",
        )

    def close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.http is not None:
            self.http.close()
        self.rpc.close()
        self.storage.close()

    def serve_forever(self) -> None:
        """Start, block until SIGINT/SIGTERM, then close."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()  # closes what it opened if it fails
        try:
            while not stop.wait(0.5):
                pass
        finally:
            log.info("shutting down")
            self.close()

    # --- what the admin API asks (kvdepot.admin.http.AdminBackend) ---------------------------------

    def rpc_alive(self) -> bool:
        return self.rpc.alive

    def degraded_reasons(self) -> list[str]:
        """Why the server serves less than it was configured to (empty: it serves everything)."""
        snap = self.storage.snapshot()
        reasons = [
            f"L2 tier {t['name']} ({t['kind']}) is down: {t['last_error'] or 'unknown error'}" for t in snap.tiers if not t["healthy"]
        ]
        if snap.prefault.state == "failed":
            reasons.append(f"the L1 prefault failed: {snap.prefault.error}")
        return reasons

    def largest_chunk_bytes(self) -> int:
        return self.ctx.contexts.largest_chunk_bytes()

    def clear(self, scope: str) -> dict:
        result = self.storage.clear(ClearScope(scope))
        return {"removed": result.l1_removed, "tiers_removed": result.tiers_removed}

    def quotas(self) -> QuotaControl | None:
        return self.storage.quotas()

    def metrics_text(self) -> bytes:
        return self.ctx.metrics.text()

    def status(self) -> dict:
        """The /status document (and ``kvdepot status``): storage's snapshot and the metric registry."""
        snap = self.storage.snapshot()  # asks each tier's backend (at most 0.5 s each): once
        l1, pf, metrics = snap.l1, snap.prefault, self.ctx.metrics
        errors = {k: v for k, v in counts(metrics.errors).items() if v}
        failures = counts(metrics.request_failures)
        blocks = counts(metrics.engine_blocks)
        return {
            "version": __version__,
            "chunk_size": self.config.storage.chunk_size,
            "hash_algorithm": self.config.storage.hash_algorithm,
            "endpoints": self.config.rpc.endpoints,
            "l1": {
                "capacity_bytes": l1.capacity_bytes,
                "used_bytes": l1.used_bytes,
                "objects": l1.objects,
                "ready": l1.ready,
                "writing": l1.writing,
                "read_locked": l1.read_locked,
                "fragmentation": round(l1.fragmentation, 4),
                "largest_free_bytes": l1.largest_free_bytes,
                "evicted_objects": l1.evicted_objects,
                "quota_refused": l1.quota_refused,
                "eviction_policy": snap.eviction_policy,
                "shm_path": snap.shm_path,
                "prefault": {
                    "state": pf.state,
                    "progress": round(pf.progress, 4),
                    "finished": pf.finished,
                    "supported": pf.supported,
                    "error": pf.error,
                },
            },
            "quarantine": self._quarantine_status(snap),
            "leases": l1.leases,
            "expired_leases": l1.expired_leases,
            "contexts": len(self.ctx.contexts),
            "sessions": len(self.ctx.sessions),
            "clients": len(self.ctx.liveness),
            "requests": {k: v for k, v in counts(metrics.requests).items() if v},
            "errors": errors,
            "request_failures": {
                # Per-request problems by class: each made one request recompute what it lacked, and
                # none stops anyone from caching (transport failures never reach the server).
                "lease_expired": errors.get("LEASE_EXPIRED", 0) + failures.get("lease_expired_frees", 0),
                "lease_revoked": errors.get("LEASE_REVOKED", 0),
                "short_retrieves": failures.get("short_retrieves", 0),
                "over_quota": l1.quota_refused,
                "corrupt_in_l2": sum(t["corrupt"] for t in snap.tiers),
            },
            "block_events": {"allocated": blocks.get("allocated", 0), "freed": blocks.get("freed", 0)},
            "tiers": snap.tiers,
            "l2_controllers": snap.controllers,
        }

    def _quarantine_status(self, snap: StorageSnapshot) -> dict:
        """Arena space held back because a client that was given it may still be running."""
        clients = []
        for q in snap.quarantine:
            rec = self.ctx.liveness.record(q.owner)
            clients.append(
                {
                    "client": q.owner.hex()[:12],
                    "pid": rec.info.pid if rec is not None else 0,
                    "hostname": rec.info.hostname if rec is not None else "",
                    "state": rec.state.value if rec is not None else "server",
                    "leases": q.leases,
                    "bytes": q.bytes,
                    "since": q.since,
                    "why": q.why,
                }
            )
        return {"leases": snap.l1.quarantined_leases, "bytes": snap.l1.quarantined_bytes, "clients": clients}
