"""PIN_PREFIX, UNPIN and CLOSE_AGENT_SESSION: the lifecycle controls a client drives itself (an agent
framework pinning its system prompt, ending a conversation). The state lives in storage (pins.py); the
HTTP side (admin/routes/lifecycle.py) reaches the same verbs."""

from __future__ import annotations

from kvdepot.errors import BadRequest
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import MAX_AGENT_SESSION_NAME, context_and_keys
from kvdepot.storage.manager import PinInfo

MAX_PIN_TTL_S = 30 * 24 * 3600.0


def _reply(info: PinInfo) -> Reply:
    left = -1.0 if info.expires_in_s is None else info.expires_in_s
    return Reply(m.PinReply(pin_id=info.id, pinned=info.pinned, state=info.state.value, expires_in_s=left))


class LifecycleModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.storage = ctx.storage

    def handlers(self) -> list[HandlerSpec]:
        R, S = m.RequestType, HandlerMode.SYNC  # in-memory tables only: on the loop thread
        return [
            HandlerSpec(R.PIN_PREFIX, self.pin, S),
            HandlerSpec(R.UNPIN, self.unpin, S),
            HandlerSpec(R.CLOSE_AGENT_SESSION, self.close_agent_session, S),
        ]

    def pin(self, call: Call) -> Reply:
        body: m.PinPrefixRequest = call.body
        if not 0 <= body.ttl_s <= MAX_PIN_TTL_S:  # also refuses NaN
            raise BadRequest(f"ttl_s must lie in [0, {MAX_PIN_TTL_S:g}] (0: a hard pin), got {body.ttl_s}")
        _, keys = context_and_keys(self.ctx, call)
        return _reply(self.storage.pin(keys, body.cache_salt, body.ttl_s or None))

    def unpin(self, call: Call) -> Reply:
        return _reply(self.storage.unpin(call.body.pin_id))

    def close_agent_session(self, call: Call) -> Reply:
        body: m.CloseAgentSessionRequest = call.body
        if not body.name or len(body.name) > MAX_AGENT_SESSION_NAME:
            raise BadRequest(f"an agent session name has 1 to {MAX_AGENT_SESSION_NAME} characters")
        self.storage.close_agent_session(body.cache_salt, body.name)
        return Reply(m.Ack())
