"""What a long-running kvdepot process (``kvdepot serve``, ``kvdepot peer``) sets up for itself.

- ``stop_on_signals``: SIGINT, SIGTERM and SIGHUP set an event the main thread waits on, so the process
  closes cleanly (its arena leaves /dev/shm, its node says goodbye). SIGHUP is a closed terminal (a
  dropped ssh session), which killed the process outright; where it is ignored at start (``nohup``),
  the process is meant to outlive its terminal and it stays ignored. A second SIGINT or SIGTERM while
  the process closes (a close that hangs: a tier that does not answer, a plugin that ignores SIGTERM
  for its grace period) exits at once, as an operator's second Ctrl-C expects: what the close had not
  reached stays behind (an arena in /dev/shm, which the next server's start sweeps).
- ``raise_fd_limit``: the soft limit on open files up to the hard one. Every client, peer channel and
  tier connection takes a descriptor; at the soft limit libzmq's listener spins a core and new clients
  hang (``ServerUnreachable``), and distributions ship a soft limit of 1,024 under a hard one far above.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def stop_on_signals(stop: threading.Event, before_exit: Callable[[], None] | None = None) -> None:
    """The first signal sets ``stop``; a second SIGINT or SIGTERM once it is set exits with 128 + the
    signal, after ``before_exit`` (best effort: it runs in the signal handler, on the thread that is
    closing, so it must take no lock that thread may hold)."""

    def on_signal(sig: int, _frame) -> None:
        if stop.is_set() and sig != signal.SIGHUP:
            log.warning("%s again while closing: exiting now, without closing the rest", signal.Signals(sig).name)
            if before_exit is not None:
                try:
                    before_exit()
                except Exception:  # exiting anyway
                    pass
            os._exit(128 + sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, on_signal)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (where allowed); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.info("open files limit stays %d (raising it to %d failed: %s)", soft, hard, exc)
        return soft
    log.debug("open files limit raised from %d to %d", soft, hard)
    return hard
