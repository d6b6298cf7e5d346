"""What a runtime plugin is given: the environment ``kvdepot server --plugin MODULE[:ARGS]`` starts it with.

A plugin is any module run as ``python -m MODULE ARGS`` (ARGS split like a shell would), a separate
process beside the server, talking to it only through its ports. It finds in its environment:

- ``KVDEPOT_CONFIG``: the server's resolved configuration as JSON (``ServerConfig``); secrets are
  withheld (the admin token, and secret-looking options of ``--l2`` tiers read ``<withheld>``).
- ``KVDEPOT_HTTP_URL`` (empty when the HTTP API is off) and ``KVDEPOT_RPC_URL``: where to reach it.
- ``KVDEPOT_PLUGIN_NAME``: its name in ``/status`` and the server's log.
- ``KVDEPOT_SERVER_PID``: its parent. A server that is killed outright cannot stop its plugins, so a
  plugin that runs in a loop should end once ``server_alive()`` is false.

What it prints goes to the server's log, line by line, under its name. It gets SIGTERM at shutdown.
The admin token is not handed over: a plugin that must change the server (POST) is given its own way
to the token by the operator, e.g. a file named in its ARGS.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from kvdepot.config import ServerConfig
from kvdepot.redact import WITHHELD  # in place of a secret in KVDEPOT_CONFIG

CONFIG_ENV = "KVDEPOT_CONFIG"
HTTP_URL_ENV = "KVDEPOT_HTTP_URL"
RPC_URL_ENV = "KVDEPOT_RPC_URL"
NAME_ENV = "KVDEPOT_PLUGIN_NAME"
SERVER_PID_ENV = "KVDEPOT_SERVER_PID"


@dataclass(frozen=True)
class PluginEnvironment:
    name: str
    http_url: str
    rpc_url: str
    server_pid: int
    config_json: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> PluginEnvironment:
        pid = environ.get(SERVER_PID_ENV, "")
        return cls(
            name=environ.get(NAME_ENV, ""),
            http_url=environ.get(HTTP_URL_ENV, ""),
            rpc_url=environ.get(RPC_URL_ENV, ""),
            server_pid=int(pid) if pid.isdigit() else 0,
            config_json=environ.get(CONFIG_ENV, ""),
        )

    def config(self) -> ServerConfig:
        """The server's configuration (a ConfigError or msgspec error if the JSON is not one)."""
        return msgspec.json.decode(self.config_json or "{}", type=ServerConfig)

    def server_alive(self) -> bool:
        """Is the server that started this process still its parent? (True when run by hand)"""
        return not self.server_pid or os.getppid() == self.server_pid
