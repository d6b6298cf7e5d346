"""The vLLM connector's asynchronous save queue: a finished request is reported to vLLM (its blocks
freed) exactly once, only after every save of it has run, and only once vLLM has said it finished;
``drain`` waits for every save handed over; the queue is bounded. Saves here are gated by events, so
each step happens where the test says."""

from __future__ import annotations

import threading
import time

import pytest

from kvdepot.connectors.vllm.metadata import SaveOp
from kvdepot.connectors.vllm.saves import SaveQueue

WAIT_S = 10.0


class GatedSaves:
    """The queue's ``run``: each save waits for its request's gate, then records itself."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.ran: list[str] = []
        self.started = threading.Semaphore(0)
        self.fail: set[str] = set()

    def gate(self, req_id: str) -> threading.Event:
        return self.gates.setdefault(req_id, threading.Event())

    def __call__(self, op: SaveOp) -> None:
        self.started.release()
        assert self.gate(op.req_id).wait(WAIT_S), f"{op.req_id}'s gate never opened"
        if op.req_id in self.fail:
            raise RuntimeError("the server went away")
        self.ran.append(op.req_id)


def op(req_id: str) -> SaveOp:
    return SaveOp(req_id, [b"h" * 16], "", [0])


def submit(queue: SaveQueue, run: GatedSaves, req_id: str) -> float:
    save = op(req_id)
    return queue.submit([req_id], lambda: run(save))


@pytest.fixture
def saves():
    run = GatedSaves()
    queue = SaveQueue(limit=4)
    yield run, queue
    for gate in run.gates.values():
        gate.set()
    queue.close(timeout=WAIT_S)


def wait_for(predicate) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "not within the wait"
        time.sleep(0.005)


def test_a_request_finished_while_its_save_runs_is_reported_after_it(saves):
    run, queue = saves
    submit(queue, run, "a")
    submit(queue, run, "a")
    assert run.started.acquire(timeout=WAIT_S)
    assert queue.finished({"a"}) == set()  # its saves still read its blocks
    assert queue.finished(set()) == set()
    run.gate("a").set()
    assert queue.drain(WAIT_S)
    assert run.ran == ["a", "a"]
    assert queue.finished(set()) == {"a"}  # reported at the next ask: vLLM said finished before
    assert queue.finished({"a"}) == set()  # exactly once


def test_a_request_whose_saves_ran_is_reported_when_vllm_says_finished(saves):
    run, queue = saves
    run.gate("a").set()
    submit(queue, run, "a")
    assert queue.drain(WAIT_S)
    assert queue.finished(set()) == set()  # still running in vLLM: its blocks are its own
    assert queue.finished({"a", "never-saved"}) == {"a"}  # a request without saves is vLLM's alone


def test_drain_waits_for_a_save_reading_preempted_blocks(saves):
    run, queue = saves
    submit(queue, run, "a")
    assert run.started.acquire(timeout=WAIT_S)
    assert not queue.drain(0.05)
    run.gate("a").set()
    assert queue.drain(WAIT_S)


def test_a_preempted_request_is_owed_no_report_for_its_drained_saves(saves):
    """vLLM frees a preempted request's blocks itself; once its saves are drained they are forgotten, so
    when it finishes later (with no save since) nothing is reported: a report of a request vLLM already
    let go of fails there. A later save of it is reported as usual."""
    run, queue = saves
    run.gate("a").set()
    run.gate("b").set()
    submit(queue, run, "a")
    submit(queue, run, "b")
    assert queue.drain(WAIT_S)
    queue.forget(["a"])
    assert queue.finished({"a", "b"}) == {"b"}
    submit(queue, run, "a")  # saved again after its re-admission
    assert queue.drain(WAIT_S)
    assert queue.finished({"a"}) == {"a"}


def test_a_full_queue_makes_the_step_wait_for_room(saves):
    run, queue = saves
    for _ in range(4):
        submit(queue, run, "a")
    waited: list[float] = []
    step = threading.Thread(target=lambda: waited.append(submit(queue, run, "b")))
    step.start()
    time.sleep(0.1)
    assert not waited, "a fifth save went in past the limit"
    run.gate("a").set()
    step.join(WAIT_S)
    assert waited and waited[0] >= 0.05
    run.gate("b").set()
    assert queue.drain(WAIT_S)
    assert queue.finished({"a", "b"}) == {"a", "b"}


def test_a_failed_save_still_frees_the_request(saves):
    run, queue = saves
    run.fail.add("a")
    run.gate("a").set()
    submit(queue, run, "a")
    assert queue.drain(WAIT_S)
    assert run.ran == []
    assert queue.finished({"a"}) == {"a"}


def test_close_runs_what_was_queued():
    run = GatedSaves()
    run.gate("a").set()
    queue = SaveQueue(limit=8)
    for _ in range(3):
        submit(queue, run, "a")
    queue.close(timeout=WAIT_S)
    assert run.ran == ["a"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        submit(queue, run, "a")


def test_a_job_over_several_requests_reports_each_once_it_ran(saves):
    run, queue = saves
    queue.submit(["a", "b", "a"], lambda: run(op("a")))  # one step's layerwise saves: a twice, b once
    assert run.started.acquire(timeout=WAIT_S)
    assert queue.finished({"a", "b"}) == set()
    run.gate("a").set()
    assert queue.drain(WAIT_S)
    assert queue.finished(set()) == {"a", "b"}


def test_layerwise_saves_without_async_saves_is_refused_and_other_checks_still_run():
    from kvdepot.connectors.vllm.config import ConnectorConfig

    with pytest.raises(ValueError, match="layerwise_saves needs async_saves"):
        ConnectorConfig.from_extra({"layerwise_saves": True, "async_saves": False})
    with pytest.raises(ValueError, match="curve_server_key and curve_client_key"):  # the common settings' own rule
        ConnectorConfig.from_extra({"layerwise_saves": True, "curve_server_key": "/nowhere.key"})
    assert ConnectorConfig.from_extra({"layerwise_saves": "true"}).layerwise_saves
