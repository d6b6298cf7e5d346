"""``CopyWatcher`` (server/modules/blocks.py): a copy's finish (its locks' release) runs once the copy is
done, in any order, and a copy that never ends holds up nobody else's finish."""

from __future__ import annotations

import threading
import time

from kvdepot.server.modules.blocks import CopyWatcher


class Copy:
    """A completion whose end the test decides (the interface ``Completion`` has: done, wait)."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ended.wait(timeout_s)


def test_finishes_run_when_their_copies_end_and_a_stuck_one_blocks_nobody():
    watcher = CopyWatcher()
    finished: list[str] = []
    stuck, quick, done_now = Copy(), Copy(), Copy()
    done_now.ended.set()
    watcher.after(stuck, lambda: finished.append("stuck"))
    watcher.after(quick, lambda: finished.append("quick"))
    watcher.after(done_now, lambda: finished.append("done now"))
    assert finished == ["done now"]  # already over: finished at once, on the caller's thread
    quick.ended.set()
    deadline = time.monotonic() + 5
    while finished != ["done now", "quick"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert finished == ["done now", "quick"]  # the stuck copy, handed over first, did not hold it up
    threading.Timer(0.2, stuck.ended.set).start()
    watcher.close()  # waits for every copy still running before it returns
    assert finished == ["done now", "quick", "stuck"]
