"""``TraceRecorder``: an event-bus subscriber that appends every LOOKUP, STORE and RETRIEVE the server
finishes to a recording (``trace_format.py``).

It runs on the bus's drain thread, never on a request's path: each batch of events it is handed becomes
one frame, written and flushed at once. It reads the events' fields only (``ChunkRequestDone`` in
``kvdepot/events.py``), so it depends on nothing but the recording format. A path it cannot
open is a ``ConfigError`` at start-up naming ``--trace-record``; a write that fails later (a full disk)
is logged once and ends the recording, never the server.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

from kvdepot.errors import ConfigError
from kvdepot.observability.trace_format import FORMAT, KEY_BYTES, VERSION, Record, RecordingHeader, frame, start_bytes

log = logging.getLogger(__name__)

RECORDED_OPS = frozenset({"lookup", "store", "retrieve"})


class TraceRecorder:
    def __init__(self, path: str, server_version: str = "") -> None:
        if not path:
            raise ConfigError("--trace-record needs a file path")
        self.path = path
        self.records = 0  # written so far
        self.failed = ""  # why recording stopped, if it did
        self._lock = threading.Lock()  # handle() on the drain thread, close() on the main thread
        try:
            kept = _keep_previous(path)
            # 0600, as the arena: a recording names every tenant's cache salt and what each asked for.
            # O_NOFOLLOW: a link planted at the path in a shared directory is refused, not truncated.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)  # also when it replaces an older file
            if kept:
                log.info("--trace-record: the previous recording at %s was kept as %s", path, kept)
            self._file = os.fdopen(fd, "wb")
            self._file.write(start_bytes(RecordingHeader(FORMAT, VERSION, KEY_BYTES, time.time(), server_version)))
            self._file.flush()
        except OSError as exc:
            raise ConfigError(f"--trace-record {path}: cannot write there: {exc.strerror or exc}") from None

    def handle(self, events: list[object]) -> None:
        """Append the batch's chunk requests as one frame (other events are ignored)."""
        batch = [_record(ev) for ev in events if getattr(ev, "op", None) in RECORDED_OPS]
        if not batch:
            return
        data = frame(batch)
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(data)
                self._file.flush()
                self.records += len(batch)
            except OSError as exc:
                self.failed = f"{exc.strerror or exc}"
                log.error("trace recording to %s stopped after %d records: %s", self.path, self.records, self.failed)
                self._close_file()

    def close(self) -> None:
        with self._lock:
            self._close_file()

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as exc:
                log.error("closing the trace recording %s: %s", self.path, exc)


def _keep_previous(path: str) -> str:
    """A recording already at ``path`` (a supervisor restarting a crashed server with the same flags:
    the traffic that led to the crash) moves to ``path.1`` instead of being erased; returns that name,
    or "" when there was none. One generation is kept."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return ""
    os.replace(path, path + ".1")
    return path + ".1"


def _record(ev) -> Record:
    return Record(
        t=float(ev.t),
        op=str(ev.op),
        model=str(ev.model),
        salt=str(ev.salt),
        keys=b"".join(bytes(k[:KEY_BYTES]) for k in ev.keys),
        chunk_tokens=int(ev.chunk_tokens),
        chunk_bytes=int(ev.chunk_bytes),
        found=int(ev.found),
        outcome=str(ev.outcome),
        duration_s=float(ev.duration_s),
        space=bytes(ev.space),
    )
