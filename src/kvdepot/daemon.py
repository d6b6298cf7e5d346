"""What a long-running kvdepot process (``kvdepot serve``, ``kvdepot peer``) sets up for itself.

- ``stop_on_signals``: SIGINT, SIGTERM and SIGHUP set an event the main thread waits on, so the process
  closes cleanly (its arena leaves /dev/shm, its node says goodbye). SIGHUP is a closed terminal (a
  dropped ssh session), which killed the process outright; where it is ignored at start (``nohup``),
  the process is meant to outlive its terminal and it stays ignored.
- ``raise_fd_limit``: the soft limit on open files up to the hard one. Every client, peer channel and
  tier connection takes a descriptor; at the soft limit libzmq's listener spins a core and new clients
  hang (``ServerUnreachable``), and distributions ship a soft limit of 1,024 under a hard one far above.
"""

from __future__ import annotations

import logging
import resource
import signal
import threading

log = logging.getLogger(__name__)


def stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, lambda *_: stop.set())


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
