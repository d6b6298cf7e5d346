"""A server short of memory: an allocation that fails is that work's failure, said clearly, and nothing
it reserved stays reserved; the server goes on serving once memory is back.

The limit is a real one: ``prlimit`` lowers the running server's address-space limit (RLIMIT_AS) to a
few MiB above what it maps, so the next thread stack (8 MiB) cannot be mapped, as on a host or in a
container out of memory.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from support.servers import wait_until
from support.tiers import make_prompt, store_full, store_stats, tier_of, wait_store_idle

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")

HEADROOM = 4 << 20  # room for small allocations, none for a thread's 8 MiB stack


def _mapped_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _limit_address_space(pid: int, soft: int | str) -> None:
    subprocess.run(["prlimit", f"--pid={pid}", f"--as={soft}:unlimited"], check=True)


def test_a_tier_thread_that_cannot_start_fails_its_push_and_frees_its_slot(make_server, seed):
    """The store controller's push to a tier is the first to need the tier's second worker thread.
    Under the limit that thread cannot start (``RuntimeError: can't start new thread``): the submit
    raised out of the controller's step with the batch counted in flight and its objects read-locked.
    Nothing ever completed it: ``in_flight`` stayed 1 for good (eight such and no store reached L2 again),
    the lease held its objects for BACKGROUND_LEASE_TTL_S, and the work the pool had queued ran later
    anyway, behind the controller's back."""
    srv = make_server("--l2", "memory:name=mem,size_gb=0.1,workers=2")
    pid = srv.proc.proc.pid
    with srv.client() as c:
        store_full(c, make_prompt(1, seed))  # the tier's first worker thread starts (and then idles)
        wait_store_idle(srv)
        _limit_address_space(pid, _mapped_bytes(pid) + HEADROOM)
        try:
            store_full(c, make_prompt(40, seed + 1))  # 3 batches: the second needs a second thread
        finally:
            _limit_address_space(pid, "unlimited")
        assert "can't start new thread" in srv.log_text()  # the failure is said, with why
        s = store_stats(wait_until(lambda: (st := srv.status()) and not store_stats(st)["in_flight"] and st,
                                   timeout_s=15, what="the store controller to have nothing in flight"))  # fmt: skip
        assert s["failed"] >= 1 and s["submitted"] == s["stored"] + s["failed"], s
        assert srv.leases() == 0  # the failed batch's read lock ended with it
        tier = tier_of(srv.status(), "mem")
        assert tier["objects"] == s["stored"]  # what is counted failed is not in the tier behind its back
        assert tier["healthy"]  # the backend did not fail: the tier is not taken down for it

        store_full(c, make_prompt(5, seed + 2))  # memory is back: pushes go on
        s2 = store_stats(wait_store_idle(srv))
        assert s2["stored"] == s["stored"] + 5
