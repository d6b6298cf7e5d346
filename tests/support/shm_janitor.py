"""Tests leave /dev/shm as they found it.

The engines a test starts (vLLM's multiprocessing, SGLang's schedulers) create shared-memory files
(``psm_*``, ``sem.mp-*``, ``sglang_*``, a tensor-parallel vLLM's ``vllm_dist_*``) that they remove on a clean exit, and leave behind when they are
killed, as tests kill them; so do the CUDA runtime (``cuda.shm.*``, for interprocess events) and torch
(``torch_*``, the reference counts of CUDA memory a process shared) in a GPU worker the tests kill. After a module's engines are stopped, every file that appeared in
/dev/shm during the module and that no live process has open or mapped is removed; what is left is
a leak a test must fail on (a kvdepot arena outliving its server would be one).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
FRESH_S = 10.0  # an engine leftover younger than this may belong to an engine still starting: left alone
# what killed engine processes leave behind (vllm_dist_*: a tensor-parallel vLLM's CPU shared-memory channel)
ENGINE_LEFTOVERS = ("psm_", "sem.mp-", "sglang_", "mp-", "cuda.shm.", "torch_", "vllm_dist_")


def entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except FileNotFoundError:
        return set()


def in_use() -> set[str]:
    """Names under /dev/shm that some process has open or mapped (that we may look at)."""
    used: set[str] = set()
    prefix = str(SHM) + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    used.add(target[len(prefix) :].removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                    if path.startswith(prefix):
                        used.add(path[len(prefix) :].removesuffix(" (deleted)"))
        except (OSError, ValueError):
            continue  # the process is gone, or not ours to read
    return used


def sweep(before: set[str]) -> list[str]:
    """Remove the engines' leftovers that appeared since ``before`` and nobody uses any more; returns
    what else appeared and is not in use (a leak)."""
    new = entries() - before
    if not new:
        return []
    busy = in_use()
    leaked = []
    now = time.time()
    for name in sorted(new - busy):
        if name.startswith(ENGINE_LEFTOVERS):
            try:
                # A file made a moment ago may be a live engine's that no map names yet: glibc's sem_open
                # maps a temporary file and links it under its name after, so the map shows the other
                # name. Another test session's engine starting beside this one lost its semaphore so.
                if now - (SHM / name).stat().st_mtime < FRESH_S:
                    continue
                (SHM / name).unlink()
            except FileNotFoundError:
                pass
        else:
            leaked.append(name)
    return leaked
