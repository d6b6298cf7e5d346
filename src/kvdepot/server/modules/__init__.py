"""Capability modules. Each owns one family of requests and returns its HandlerSpecs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.config import ServerConfig
from kvdepot.errors import LeaseRevoked, UnknownContext
from kvdepot.observability.metrics import Metrics
from kvdepot.hashing import HashAlgorithm
from kvdepot.server.liveness import LivenessTracker
from kvdepot.server.sessions import SessionTable
from kvdepot.server.state import Context, ContextRegistry
from kvdepot.storage.manager import StorageManager
from kvdepot.types import ClientId


@dataclass
class ServerContext:
    """Everything a module may use; built once by the composition root."""

    config: ServerConfig
    storage: StorageManager
    liveness: LivenessTracker
    contexts: ContextRegistry = field(default_factory=ContextRegistry)
    sessions: SessionTable = field(default_factory=SessionTable)
    metrics: Metrics = field(default_factory=Metrics)

    def context_of(self, context_id: int, client: ClientId) -> Context:
        """The caller's context. A client that was revoked (declared gone while it was only silent)
        learns so on its first request after it: LEASE_REVOKED saying why and when, not a bare
        UNKNOWN_CONTEXT."""
        try:
            return self.contexts.get(context_id, client)
        except UnknownContext:
            notice = self.liveness.take_notice(client)
            if notice is not None:
                raise LeaseRevoked(notice.message()) from None
            raise

    @property
    def digest_size(self) -> int:
        return HashAlgorithm(self.config.storage.hash_algorithm).digest_size
