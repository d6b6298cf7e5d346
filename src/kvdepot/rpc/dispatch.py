"""What a served request is and how a handler answers it.

A capability module (``kvdepot.server.modules``, later the peer tier's node) returns ``HandlerSpec``s;
the ``RpcServer`` runs each handler with a ``Call`` and sends its ``Reply`` (or the error it raised) as
the request's one reply.

- SYNC handlers run on the loop thread and must be quick (table lookups, no big copies).
- BLOCKING handlers run on the server's thread pool (copies, anything that may wait).

A reply may carry raw payload frames sent without a copy; ``on_sent`` runs once ZeroMQ has let go of
them (so the read locks that keep them valid end only then), and also when the send failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
import zmq

from kvdepot.protocol.messages import RequestType
from kvdepot.types import ClientId


class HandlerMode(Enum):
    SYNC = "sync"
    BLOCKING = "blocking"


@dataclass(slots=True)
class Call:
    client: ClientId
    request_id: int
    rtype: RequestType
    body: Any
    payload: list[zmq.Frame]
    deadline: float  # monotonic; inf when the client set none
    received: float = 0.0  # monotonic
    described: bool = False  # a handler published a richer record of this call (its RequestDone says so)


@dataclass(slots=True)
class Reply:
    body: msgspec.Struct
    payload: Sequence[Any] = ()
    on_sent: Callable[[], None] | None = None


Handler = Callable[[Call], Reply]


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    rtype: RequestType
    fn: Handler
    mode: HandlerMode
    # Its replies carry payload sent zero-copy from memory the reply pins until ZeroMQ is done with it:
    # refused for a client whose earlier such replies are unsent past MAX_UNSENT_BYTES (it stopped reading).
    pins_until_sent: bool = False
