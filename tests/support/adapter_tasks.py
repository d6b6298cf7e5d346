"""Driving an L2 adapter one task at a time, as the contract and edge tests do: submit, then wait on its
eventfd for that task's result."""

from __future__ import annotations

import select
import time

import pytest

from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import TaskResult


def run(adapter: BackendAdapter, task_id: int, timeout_s: float = 20.0) -> TaskResult:
    """Wait on the eventfd for one task's result (one task at a time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        select.select([adapter.eventfd], [], [], 0.2)
        for result in adapter.completed():
            assert result.task_id == task_id, f"unexpected result {result}"
            return result
    pytest.fail(f"task {task_id} of {adapter!r} did not complete in {timeout_s}s")


def store(adapter: BackendAdapter, key: bytes, value: bytes) -> TaskResult:
    return run(adapter, adapter.submit_store([(key, memoryview(value))]))


def load(adapter: BackendAdapter, key: bytes, size: int) -> tuple[TaskResult, bytes]:
    dest = bytearray(size)
    return run(adapter, adapter.submit_load([key], [memoryview(dest)])), bytes(dest)


class EventRecorder:
    """A tier's event sink (``TierServices(sink=...)``) that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def wants(self, kind) -> bool:
        return True
