"""The composition root: build every part, start them in order, serve, close them in reverse order.

Nothing starts a thread in a constructor; ``start`` does, and ``close`` undoes it.
"""

from __future__ import annotations

import logging
import signal
import threading

from kvdepot import __version__
from kvdepot.config import ServerConfig
from kvdepot.server.liveness import LivenessTracker
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.lookup import LookupModule
from kvdepot.server.modules.management import ManagementModule
from kvdepot.server.modules.transfer import TransferModule
from kvdepot.server.rpc import RpcServer
from kvdepot.storage.manager import StorageManager

log = logging.getLogger(__name__)


class KVDepotServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.storage = StorageManager(config.storage, holder_alive=self._holder_alive)
        liveness = LivenessTracker(config.rpc.client_timeout_s, lock_held=self.storage.arena.lock_held)
        self.ctx = ServerContext(config, self.storage, liveness)
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
        )
        self.http = None
        if config.http.port:
            from kvdepot.admin.http import HttpServer

            self.http = HttpServer(self, config.http)
        self._stopped = threading.Event()

    def _holder_alive(self, client) -> bool:
        """For the object table: may this client still touch arena memory? (loop thread only)"""
        return self.ctx.liveness.may_touch_arena(client)

    def _housekeeping(self) -> None:
        table = self.storage.table
        expired = table.expire()
        if expired:
            log.info("%d leases expired (TTL %.1fs)", expired, self.config.storage.lease_ttl_s)
        if table.stats().quarantined_leases:
            released = table.recheck_quarantine()
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
            self.storage.arena.path,
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

    def _quarantine_status(self, l1) -> dict:
        """Arena space held back because a client that was given it may still be running."""
        clients = []
        for q in self.storage.table.quarantine():
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
        return {"leases": l1.quarantined_leases, "bytes": l1.quarantined_bytes, "clients": clients}

    def _request_failures(self, l1, tiers: list[dict]) -> dict:
        """Per-request problems by class: each made one request recompute what it lacked, and none
        stops anyone from caching. (Transport failures are the clients' to see: they never got here.)"""
        errors = _snapshot(self.rpc.stats.errors)
        counts = self.ctx.failures.snapshot()
        return {
            "lease_expired": errors.get("LEASE_EXPIRED", 0) + counts["lease_expired_frees"],
            "lease_revoked": errors.get("LEASE_REVOKED", 0),
            "short_retrieves": counts["short_retrieves"],
            "over_quota": l1.quota_refused,
            "corrupt_in_l2": sum(t["corrupt"] for t in tiers),
        }

    def degraded_reasons(self) -> list[str]:
        """Why the server serves less than it was configured to (empty: it serves everything)."""
        reasons = []
        for tier in self.storage.tiers_status():
            if not tier["healthy"]:
                reasons.append(f"L2 tier {tier['name']} ({tier['kind']}) is down: {tier['last_error'] or 'unknown error'}")
        pf = self.storage.prefault_status()
        if pf.state == "failed":
            reasons.append(f"the L1 prefault failed: {pf.error}")
        return reasons

    def largest_chunk_bytes(self) -> int:
        return self.ctx.contexts.largest_chunk_bytes()

    def rpc_alive(self) -> bool:
        return self.rpc.alive

    def status(self) -> dict:
        """The /status document (and ``kvdepot status``)."""
        l1 = self.storage.stats()
        pf = self.storage.prefault_status()
        tiers = self.storage.tiers_status()  # asks each backend (at most 0.5 s each): once
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
                "eviction_policy": self.config.storage.eviction_policy,
                "shm_path": self.storage.arena.path,
                "prefault": {
                    "state": pf.state,
                    "progress": round(pf.progress, 4),
                    "finished": pf.finished,
                    "supported": pf.supported,
                    "error": pf.error,
                },
            },
            "quarantine": self._quarantine_status(l1),
            "leases": l1.leases,
            "expired_leases": l1.expired_leases,
            "contexts": len(self.ctx.contexts),
            "sessions": len(self.ctx.sessions),
            "clients": len(self.ctx.liveness),
            "requests": {getattr(k, "name", str(k)): v for k, v in _snapshot(self.rpc.stats.requests).items()},
            "errors": _snapshot(self.rpc.stats.errors),
            "request_failures": self._request_failures(l1, tiers),
            "block_events": _snapshot(self.ctx.block_events),
            "tiers": tiers,
            "l2_controllers": self.storage.controllers_status(),
        }


def _snapshot(counts: dict) -> dict:
    """Copy a dict another thread may be adding keys to (a copy can race with an insert)."""
    for _ in range(10):
        try:
            return dict(counts)
        except RuntimeError:
            continue
    return {}
