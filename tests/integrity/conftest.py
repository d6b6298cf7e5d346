"""Fixtures for the integrity suite: the same real server processes as the integration tests.

Each test here reproduces a way kvdepot used to return wrong KV without an error, crash, or mislead its
operator, on real processes (servers, paused and killed workers, a real tmpfs, a second PID namespace,
a real browser) and checks that it no longer can.
"""

from __future__ import annotations

from integration.conftest import make_server, seed, server  # noqa: F401  (fixtures)
