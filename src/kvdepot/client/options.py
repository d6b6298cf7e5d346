"""How a client behaves (``ClientOptions``), and the transports it may use (``Transport``).

The context a client registers (model, layout, rank, world size) is its identity, not an option; the
options say how it talks to the server. Engine connectors build them from their own settings
(``connectors.common.ClientSettings``), so every knob has one home and one default.
"""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass

from kvdepot.hashing import HASH_SCHEME
from kvdepot.rpc.security import CurveClientKeys

NO_MALLOC_TUNING_ENV = "KVDEPOT_NO_MALLOC_TUNING"


class Transport(str, enum.Enum):
    """How KV bytes travel (ARCHITECTURE §4)."""

    AUTO = "auto"  # shm when this process can map the server's arena, else inline (and say why)
    SHM = "shm"  # same host: the worker copies straight into / out of the server's arena (one copy)
    INLINE = "inline"  # any host: raw payload frames over the socket
    # The server-driven path (same host, NVIDIA GPU): the server copies a registered paged cache's blocks
    # itself (``KVClient.register_kv_cache``). Arrays a client hands over still go as with AUTO.
    CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class ClientOptions:
    transport: Transport = Transport.AUTO
    timeout_s: float = 10.0  # deadline of one request
    connect_timeout_s: float = 5.0  # how long to wait for a server to answer at all
    chunk_size: int = 0  # 0: the server's default
    heartbeat: bool = True  # ping when idle and renew held leases (off: the TTL ends them)
    prefault: bool = True  # populate this process's mapping of the arena in the background
    tune_malloc: bool = True  # keep freed multi-MiB buffers in the heap (inline receives)
    # The compatibility handshake: the hash algorithm this client's keys need ("": the server's, which
    # kvdepot's own hashing then uses), and how its keys are made from tokens.
    hash_algorithm: str = ""
    hash_scheme: str = HASH_SCHEME
    send_token_ids: bool = False  # stores carry their chunks' token ids, for KV events (protocol.messages.TOKEN_IDS_NOTE)
    curve: CurveClientKeys | None = None  # CurveZMQ keys for a server that requires them (off loopback)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "transport", Transport(self.transport))
        except ValueError:
            raise ValueError(f"transport must be one of {[t.value for t in Transport]}, got {self.transport!r}") from None
        if not 0 < self.timeout_s <= threading.TIMEOUT_MAX or not 0 < self.connect_timeout_s <= threading.TIMEOUT_MAX:
            # Infinity cannot be waited for (a lock's timeout raises past TIMEOUT_MAX); a large number waits as long as it takes.
            raise ValueError(f"timeout_s and connect_timeout_s must be positive and finite, at most {threading.TIMEOUT_MAX:.0f} s "
                             f"(a large number waits as long as it takes), got {self.timeout_s} and {self.connect_timeout_s}")  # fmt: skip
        if self.curve is not None and not isinstance(self.curve, CurveClientKeys):
            raise ValueError(f"curve must be a CurveClientKeys (CurveClientKeys.from_files(server_public, client_secret)), got {self.curve!r}")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0: the server's), got {self.chunk_size}")

    @property
    def malloc_tuning(self) -> bool:
        """Keep large freed buffers in the heap? ``tune_malloc``, unless the environment says no
        (``KVDEPOT_NO_MALLOC_TUNING=1``): the one place that override applies."""
        return self.tune_malloc and not os.environ.get(NO_MALLOC_TUNING_ENV)
