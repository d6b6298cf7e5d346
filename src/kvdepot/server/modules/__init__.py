"""Capability modules. Each owns one family of requests and returns its HandlerSpecs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.config import ServerConfig
from kvdepot.hashing import HashAlgorithm
from kvdepot.server.liveness import LivenessTracker
from kvdepot.server.state import ContextRegistry, SessionTable
from kvdepot.storage.manager import StorageManager


@dataclass
class ServerContext:
    """Everything a module may use; built once by the composition root."""

    config: ServerConfig
    storage: StorageManager
    liveness: LivenessTracker
    contexts: ContextRegistry = field(default_factory=ContextRegistry)
    sessions: SessionTable = field(default_factory=SessionTable)
    block_events: dict[str, int] = field(default_factory=lambda: {"allocated": 0, "freed": 0})

    @property
    def digest_size(self) -> int:
        return HashAlgorithm(self.config.storage.hash_algorithm).digest_size
