"""A synchronous load's copies spread over threads: every chunk once, errors after all are done."""

from __future__ import annotations

import threading
import time

import pytest

from kvdepot.connectors.vllm.copies import ChunkCopier


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 2, 7, 16])
def test_every_chunk_is_copied_exactly_once(threads, count):
    copier = ChunkCopier(threads)
    seen: list[int] = []
    lock = threading.Lock()

    def copy(i: int) -> None:
        with lock:
            seen.append(i)

    copier.each(count, copy)
    copier.close()
    assert sorted(seen) == list(range(count))


def test_two_threads_run_at_once_and_an_error_waits_for_the_others():
    copier = ChunkCopier(2)
    names: set[str] = set()
    finished: list[int] = []
    both = threading.Barrier(2, timeout=10)

    def copy(i: int) -> None:
        names.add(threading.current_thread().name)
        both.wait()  # only passes if the two halves run at the same time
        if i == 0:
            raise ValueError("chunk 0 failed")
        time.sleep(0.05)
        finished.append(i)

    with pytest.raises(ValueError, match="chunk 0"):
        copier.each(2, copy)
    assert finished == [1], "each returned before the other thread's copy was done"
    assert len(names) == 2
    copier.close()


def test_zero_means_one_per_core_at_most_four():
    copier = ChunkCopier(0)
    assert 1 <= copier.threads <= 4
    copier.close()
