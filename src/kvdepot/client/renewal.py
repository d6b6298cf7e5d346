"""Keeping a client's leases and its registration alive while it works.

The server ends a lease nobody renews after ``--lease-ttl-s`` and revokes a client silent for
``--client-timeout-s``. ``LeaseRenewer`` runs the client's heartbeat thread: well within the TTL it
renews the leases of zero-copy blocks still open (``holding``) and of the sessions the owner still names
(``renew_sessions``: an engine's requests waiting or computing), and when the client is otherwise idle it
pings. A renewal is a request too, so it is proof of life as well. A heartbeat never queues behind a
request in flight (that request is proof of life already).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from kvdepot.client.registration import Registration
from kvdepot.errors import KVDepotError
from kvdepot.rpc.channel import Heartbeat, RpcChannel

log = logging.getLogger(__name__)

SessionNames = Callable[[], Iterable[str]]


class Renewing(Protocol):
    """What the renewer needs of its client."""

    channel: RpcChannel

    @property
    def registration(self) -> Registration: ...

    def renew(self, sessions: Iterable[str] = (), lease_ids: Iterable[int] = (), reregister: bool = True) -> int: ...


class LeaseRenewer:
    def __init__(self, client: Renewing) -> None:
        self._client = client
        self._held: set[int] = set()  # leases of zero-copy blocks open right now
        self._lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None
        self._last_renewal = 0.0
        self.renew_sessions: SessionNames | None = None
        """The owner's sessions still in use (e.g. an engine's requests waiting or computing): their
        locks are renewed with the heartbeat. Called from the heartbeat thread: it must be thread-safe.
        A session the owner stops naming is no longer renewed, so the TTL ends it if it leaked."""

    def __repr__(self) -> str:
        return f"LeaseRenewer(held={len(self._held)}, running={self._heartbeat is not None})"

    def start(self) -> None:
        reg = self._client.registration
        tick = max(0.05, min(reg.heartbeat_interval_s, reg.lease_ttl_s / 4))
        self._last_renewal = time.monotonic()
        self._heartbeat = Heartbeat(tick, self._beat)
        self._heartbeat.start()

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    @contextmanager
    def holding(self, lease_id: int) -> Iterator[None]:
        """While the block runs, the heartbeat renews its lease: a slow block is not a leaked one."""
        if not lease_id:
            yield
            return
        with self._lock:
            self._held.add(lease_id)
        try:
            yield
        finally:
            with self._lock:
                self._held.discard(lease_id)

    def _beat(self) -> None:
        """Renew what is held well within the lease TTL, and ping when idle (the server counts silence
        as death)."""
        reg = self._client.registration
        channel = self._client.channel
        now = time.monotonic()
        if now - self._last_renewal >= reg.lease_ttl_s / 4:
            self._last_renewal = now
            if self._renew_held(reg):
                return
        if now - channel.last_request < reg.heartbeat_interval_s:
            return
        with channel.held(reg.heartbeat_interval_s) as got:
            if not got:
                return  # a request is in flight: that is proof of life already
            try:
                channel.ping(timeout_s=max(reg.heartbeat_interval_s, 1.0))
            except KVDepotError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _renew_held(self, reg: Registration) -> bool:
        with self._lock:
            leases = list(self._held)
        sessions: list[str] = []
        if self.renew_sessions is not None:
            try:
                sessions = list(self.renew_sessions())
            except Exception:  # the owner's callback must never stop the heartbeat
                log.exception("kvdepot: renew_sessions failed")
        if not leases and not sessions:
            return False
        with self._client.channel.held(reg.lease_ttl_s / 4) as got:
            if not got:
                return False
            try:
                self._client.renew(sessions, leases, reregister=False)
            except KVDepotError as exc:
                log.debug("lease renewal failed: %s", exc)
        return True
