"""``--lookup-log PATH``: one JSON line per engine lookup, in a rotating file (a bus subscriber).

Each line: ``{"t", "model", "salt", "chunks", "found", "requested_tokens", "hit_tokens", "ms"}``: what an
operator greps when a model's hit rate drops ("which prompts missed, how long, which tenant"). The file
rotates at ``--lookup-log-max-mb`` and keeps ``--lookup-log-backups`` old ones (the standard library's
``RotatingFileHandler``); it is written on the bus's drain thread, never on the request path. A write
that fails is reported by logging's own handler-error path and costs no request anything.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os

from kvdepot.events import ChunkRequestDone


class _PrivateRotatingFile(logging.handlers.RotatingFileHandler):
    """Every file it opens, the first and each one after a rotation, is the owner's alone (mode 0600,
    whatever the umask): the log names every tenant's salt."""

    def _open(self):
        # O_NOFOLLOW: a link planted at the path (a shared directory, or between two rotations) is refused,
        # not followed: its target would get every tenant's lookups appended and its mode changed to 0600.
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # also a file that was there before
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)


class LookupLog:
    KINDS = (ChunkRequestDone,)

    def __init__(self, path: str, max_mb: int = 100, backups: int = 5) -> None:
        """Opens (creates) the file now: a path that cannot be written is an OSError at start-up."""
        self.path = path
        self._handler = _PrivateRotatingFile(path, maxBytes=max_mb << 20, backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def handle(self, events: list) -> None:
        for e in events:
            if e.op != "lookup":
                continue
            line = json.dumps(
                {
                    "t": round(e.t, 6), "model": e.model, "salt": e.salt, "chunks": len(e.keys), "found": e.found,
                    "requested_tokens": len(e.keys) * e.chunk_tokens, "hit_tokens": e.found * e.chunk_tokens,
                    "ms": round(e.duration_s * 1000, 3),
                },
                separators=(",", ":"),
            )
            self._handler.emit(logging.LogRecord("kvdepot.lookups", logging.INFO, "", 0, line, None, None))

    def close(self) -> None:
        self._handler.close()
