"""The kvdepot tier's settings, from its entry in ``secondary_tiers`` of vLLM's
``kv_connector_extra_config``: the connectors' common settings (``ClientSettings``) and the tier's own.

vLLM takes ``type``, ``module_path`` and ``backpressure`` out of the entry and hands everything else to
the tier's constructor; every other key must be one of these (an unknown key or a bad value fails
vLLM's start, naming the key). Defaults live here only.
"""

from __future__ import annotations

from typing import Annotated

from kvdepot.config import ConfigError, option
from kvdepot.connectors.common import ClientSettings

LOCALITIES = ("", "LOCAL", "REMOTE")  # vLLM's Locality values; "" leaves it unknown
HOST_TRANSPORTS = ("auto", "shm", "inline")  # the tier moves host memory (vLLM's CPU rows), never GPU blocks


class TierSettings(ClientSettings, frozen=True, kw_only=True):
    # A lookup answers a request vLLM keeps waiting (it asks again every step): a slow or dead server
    # must be a miss in a moment, not after the common 5 s.
    timeout_s: Annotated[float, option("deadline of one request to the server (a lookup past it is a miss)", gt=0)] = 2.0
    locality: Annotated[
        str, option("LOCAL or REMOTE: where the kvdepot server is relative to this engine (vLLM's per-request tier filters use it); empty: unknown")
    ] = ""

    def _check_together(self) -> None:
        super()._check_together()
        if self.chunk_size:
            raise ConfigError(
                "chunk_size: the tier stores one vLLM offload chunk per kvdepot chunk; size it with vLLM's own "
                "'block_size' or 'blocks_per_chunk' in kv_connector_extra_config"
            )
        if self.transport.value not in HOST_TRANSPORTS:
            raise ConfigError(f"transport: the tier copies vLLM's CPU rows; use one of {list(HOST_TRANSPORTS)}, not {self.transport.value!r}")
        if self.locality.upper() not in LOCALITIES:
            raise ConfigError(f"locality must be LOCAL, REMOTE or empty, got {self.locality!r}")

    @classmethod
    def from_tier_options(cls, options: dict) -> TierSettings:
        """The settings from the keyword arguments vLLM's tier factory passes; ValueError naming the key."""
        return cls.from_extra(options, "kvdepot tier option")
