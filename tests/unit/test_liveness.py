"""LivenessTracker and ClientWatch with an injected clock and a fake liveness-lock probe.

Clients are this test process itself (``local_client_info()``: same boot and PID namespace, so the
tracker opens a real pidfd), a child process the test starts and ends, or a client from another PID
namespace (no pidfd: only its liveness lock in the arena, faked here as a set of held offsets, says
whether it may still run).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kvdepot.protocol.identity import local_client_info
from kvdepot.protocol.messages import ClientInfo
from kvdepot.server.liveness import (
    MAX_NOTICES,
    ClientState,
    ClientView,
    ClientWatch,
    LivenessTracker,
    Revocation,
)
from kvdepot.types import ClientId

TIMEOUT_S = 10.0
T0 = 1000.0
ME = local_client_info()
C1, C2, C3 = ClientId(b"client-1"), ClientId(b"client-2"), ClientId(b"client-3")
LOCK = 1 << 40  # a liveness-lock offset (any offset the fake probe is told about)


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def foreign(pid: int = 4242) -> ClientInfo:
    """A client in another PID namespace (a container): its pid means nothing here."""
    return ClientInfo(pid=pid, hostname="container", boot_id=ME.boot_id, pid_namespace=ME.pid_namespace + 1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def held() -> set[int]:
    """Liveness-lock offsets some process holds."""
    return set()


@pytest.fixture
def tracker(clock, held) -> Iterator[LivenessTracker]:
    t = LivenessTracker(TIMEOUT_S, clock=clock, lock_held=held.__contains__)
    yield t
    t.close()


@pytest.fixture
def watch(tracker) -> tuple[ClientWatch, list[tuple[ClientId, str, bool, bool]]]:
    """A ClientWatch whose on_gone records (client, why, exited, whether the record was still there)."""
    gone: list[tuple[ClientId, str, bool, bool]] = []
    return ClientWatch(tracker, lambda c, why, exited: gone.append((c, why, exited, tracker.record(c) is not None))), gone


# --- registration --------------------------------------------------------------------------------------


def test_a_client_in_this_pid_namespace_is_watched_through_a_pidfd(tracker):
    rec = tracker.register(C1, ME)
    assert rec.pidfd >= 0
    assert tracker.pidfds() == [rec.pidfd]
    assert tracker.client_of_pidfd(rec.pidfd) == C1
    assert (rec.state, rec.last_seen, rec.in_flight, rec.lock_offset) == (ClientState.ACTIVE, T0, 0, -1)
    assert tracker.record(C1) is rec
    assert tracker.watchable(C1) is True
    assert tracker.may_touch_arena(C1) is True  # this process runs
    tracker.forget(C1)
    assert (tracker.pidfds(), tracker.record(C1), tracker.client_of_pidfd(rec.pidfd)) == ([], None, None)


def test_a_client_in_another_pid_namespace_gets_no_pidfd(tracker, held):
    rec = tracker.register(C1, foreign())
    assert rec.pidfd == -1 and tracker.pidfds() == []
    assert tracker.watchable(C1) is False  # nothing tells when it is gone
    assert tracker.may_touch_arena(C1) is False
    other_boot = ClientInfo(pid=ME.pid, hostname=ME.hostname, boot_id="another-boot", pid_namespace=ME.pid_namespace)
    assert tracker.register(C2, other_boot).pidfd == -1  # same pid numbers, another machine
    assert tracker.register(C3, ClientInfo()).pidfd == -1  # says nothing about itself


def test_a_client_whose_process_is_already_gone_gets_no_pidfd(tracker):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names nobody now
    info = ClientInfo(pid=child.pid, hostname=ME.hostname, boot_id=ME.boot_id, pid_namespace=ME.pid_namespace)
    assert tracker.register(C1, info).pidfd == -1
    assert tracker.watchable(C1) is False


def test_a_liveness_lock_seen_once_makes_a_client_watchable(tracker, held):
    tracker.register(C1, foreign(), lock_offset=LOCK)
    assert tracker.watchable(C1) is False  # offered an arena, not yet holding its lock
    held.add(LOCK)
    assert tracker.watchable(C1) is True
    assert tracker.may_touch_arena(C1) is True
    held.discard(LOCK)
    assert tracker.watchable(C1) is True  # it was seen: from now on its lock tells when it is gone
    assert tracker.may_touch_arena(C1) is False
    assert tracker.watchable(C2) is False  # unknown


def test_without_a_lock_probe_only_a_pidfd_watches(clock):
    t = LivenessTracker(TIMEOUT_S, clock=clock)
    try:
        t.register(C1, foreign(), lock_offset=LOCK)
        assert (t.watchable(C1), t.may_touch_arena(C1)) == (False, False)
        t.register(C2, ME)
        assert (t.watchable(C2), t.may_touch_arena(C2)) == (True, True)
    finally:
        t.close()


def test_registering_again_refreshes_the_same_record(tracker, clock):
    rec = tracker.register(C1, foreign(), lock_offset=LOCK)
    clock.now += 3
    again = tracker.register(C1, foreign(pid=1), lock_offset=-1)
    assert again is rec
    assert (rec.last_seen, rec.lock_offset, rec.info.pid) == (T0 + 3, LOCK, 4242)  # -1 keeps the offset


# --- silence -------------------------------------------------------------------------------------------


def test_a_client_times_out_after_client_timeout_s_of_silence(tracker, clock):
    tracker.register(C1, foreign())
    tracker.register(C2, foreign())
    clock.now = T0 + TIMEOUT_S
    assert tracker.timed_out() == []  # exactly the timeout is not past it
    tracker.request_started(C2)
    tracker.request_finished(C2)  # C2 spoke at T0 + TIMEOUT_S
    clock.now = T0 + TIMEOUT_S + 0.001
    assert tracker.timed_out() == [C1]
    clock.now = T0 + 2 * TIMEOUT_S + 0.001
    assert tracker.timed_out() == [C1, C2]


def test_a_request_in_flight_keeps_a_client_from_timing_out(tracker, clock):
    tracker.register(C1, foreign())
    tracker.request_started(C1)
    tracker.request_started(C1)
    clock.now = T0 + 100 * TIMEOUT_S
    assert tracker.timed_out() == []
    tracker.request_finished(C1)
    assert tracker.record(C1).in_flight == 1
    clock.now += 100 * TIMEOUT_S
    assert tracker.timed_out() == []  # one is still in flight
    tracker.request_finished(C1)
    finished_at = clock.now
    assert (tracker.record(C1).in_flight, tracker.record(C1).last_seen) == (0, finished_at)
    tracker.request_finished(C1)  # a stray finish never goes below zero
    assert tracker.record(C1).in_flight == 0
    clock.now = finished_at + TIMEOUT_S
    assert tracker.timed_out() == []
    clock.now = finished_at + TIMEOUT_S + 0.001
    assert tracker.timed_out() == [C1]
    tracker.request_started(C2)  # an unknown client: ignored
    tracker.request_finished(C2)
    assert tracker.record(C2) is None


# --- revocation ----------------------------------------------------------------------------------------


def test_revoke_keeps_a_client_whose_liveness_lock_is_held(tracker, held, clock):
    held.add(LOCK)
    tracker.register(C1, foreign(), lock_offset=LOCK)
    assert tracker.revoke(C1, "silent") is True
    rec = tracker.record(C1)
    assert rec.state is ClientState.REVOKED and rec.revocation.why == "silent"
    assert tracker.snapshot().clients[C1].state is ClientState.REVOKED
    assert tracker.snapshot().active == 0
    clock.now += 10 * TIMEOUT_S
    assert tracker.timed_out() == []  # revoked already
    assert tracker.vanished() == []  # may still run
    held.discard(LOCK)
    assert tracker.vanished() == [C1]


def test_revoke_forgets_a_client_that_cannot_touch_the_arena(tracker):
    tracker.register(C1, foreign())
    assert tracker.revoke(C1, "silent") is False
    assert tracker.record(C1) is None
    assert dict(tracker.snapshot().clients) == {}
    notice = tracker.take_notice(C1)
    assert isinstance(notice, Revocation) and notice.why == "silent"
    assert "silent" in notice.message() and "register again" in notice.message()


def test_registering_again_resumes_a_revoked_client(tracker, held, clock):
    held.add(LOCK)
    rec = tracker.register(C1, foreign(), lock_offset=LOCK)
    tracker.revoke(C1, "silent")
    clock.now = T0 + 50
    assert tracker.register(C1, foreign(), lock_offset=LOCK) is rec
    assert (rec.state, rec.revocation, rec.last_seen) == (ClientState.ACTIVE, None, T0 + 50)
    assert tracker.snapshot().clients[C1].state is ClientState.ACTIVE
    assert tracker.take_notice(C1).why == "silent"  # its next request is still told what happened
    clock.now = T0 + 50 + TIMEOUT_S + 0.001
    assert tracker.timed_out() == [C1]  # and it is watched for silence again


def test_a_notice_is_told_once_and_only_the_newest_are_kept(tracker):
    assert tracker.revoke(C1, "first") is False  # unknown client: nothing kept, but it is told
    assert tracker.revoke(C1, "second") is False
    assert tracker.take_notice(C1).why == "second"
    assert tracker.take_notice(C1) is None
    assert tracker.take_notice(C2) is None

    for i in range(MAX_NOTICES + 1):
        tracker.revoke(ClientId(b"n%d" % i), f"why {i}")
    assert tracker.take_notice(ClientId(b"n0")) is None  # the oldest fell off
    assert tracker.take_notice(ClientId(b"n1")).why == "why 1"
    assert tracker.take_notice(ClientId(b"n%d" % MAX_NOTICES)).why == f"why {MAX_NOTICES}"


# --- snapshots -----------------------------------------------------------------------------------------


def test_a_snapshot_is_immutable_and_does_not_change_under_its_reader(tracker, held):
    held.add(LOCK)
    tracker.register(C1, foreign(pid=11))
    tracker.register(C2, foreign(pid=22), lock_offset=LOCK)
    tracker.revoke(C2, "silent")
    before = tracker.snapshot()
    assert dict(before.clients) == {
        C1: ClientView(11, "container", ClientState.ACTIVE),
        C2: ClientView(22, "container", ClientState.REVOKED),
    }
    assert before.active == 1
    with pytest.raises(TypeError):
        before.clients[C3] = ClientView(33, "x", ClientState.ACTIVE)  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.clients[C1].state = ClientState.REVOKED  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.clients = {}  # type: ignore[misc]

    tracker.forget(C1)
    after = tracker.snapshot()
    assert list(before.clients) == [C1, C2]  # what a reader holds stays as it was
    assert list(after.clients) == [C2] and after.active == 0
    assert tracker.snapshot() is after  # no change, no new snapshot
    assert repr(tracker) == "LivenessTracker(active=0, revoked=1)"


def test_snapshots_read_from_another_thread_while_clients_come_and_go(tracker):
    """The loop thread registers and forgets clients while another thread (/status) reads snapshots:
    every snapshot the reader gets is whole (a contiguous window of the clients the writer kept)."""
    n, window = 4000, 8
    cid = lambda i: ClientId(i.to_bytes(8, "big"))
    errors: list[BaseException] = []
    reads = 0
    started, saw_middle, stop = threading.Event(), threading.Event(), threading.Event()

    def read() -> None:
        nonlocal reads
        started.set()
        while not stop.is_set():
            try:
                snap = tracker.snapshot()
                ids = sorted(int.from_bytes(c, "big") for c in snap.clients)
                assert all(v.state is ClientState.ACTIVE for v in snap.clients.values())
                assert snap.active == len(ids) <= window + 1
                assert ids == list(range(ids[0], ids[0] + len(ids))) if ids else True
                repr(tracker)
                reads += 1
                if n // 2 in ids:
                    saw_middle.set()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                saw_middle.set()  # do not keep the writer waiting for a reader that is gone
                return

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(TIMEOUT_S)
        for i in range(n):
            tracker.register(cid(i), foreign(pid=i + 1))
            if i >= window:
                tracker.forget(cid(i - window))
            if i == n // 2:
                assert saw_middle.wait(TIMEOUT_S)  # the reader runs while the writer is mid-way
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert errors == []
    assert reads > 0
    assert sorted(int.from_bytes(c, "big") for c in tracker.snapshot().clients) == list(range(n - window, n))


# --- ClientWatch ---------------------------------------------------------------------------------------


def test_the_watch_sees_a_child_process_exit(tracker, watch):
    w, gone = watch
    # A pidfd number freed by a goodbye is likely to be the child's: the watch must still see it.
    tracker.register(C1, ME)
    w.sweep()
    tracker.forget(C1)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        info = ClientInfo(pid=child.pid, hostname=ME.hostname, boot_id=ME.boot_id, pid_namespace=ME.pid_namespace)
        rec = tracker.register(C2, info)
        assert rec.pidfd >= 0
        w.sweep()
        assert gone == []
        assert tracker.may_touch_arena(C2) is True
    finally:
        child.stdin.close()  # the child reads to EOF, then exits
        child.wait(TIMEOUT_S)
    assert tracker.may_touch_arena(C2) is False  # its pidfd is readable from the moment it exited
    w.sweep()
    assert gone == [(C2, "process exited", True, True)]  # cleaned up while its record still existed
    assert (tracker.record(C2), tracker.pidfds(), dict(tracker.snapshot().clients)) == (None, [], {})
    w.sweep()
    assert len(gone) == 1


def test_the_watch_revokes_a_silent_client_that_may_still_run(tracker, watch, clock):
    w, gone = watch
    tracker.register(C1, ME)  # this process: alive, watched through its pidfd
    clock.now = T0 + TIMEOUT_S + 1
    w.sweep()
    assert gone == [(C1, f"no request or heartbeat for {TIMEOUT_S:g} s", False, True)]
    assert tracker.record(C1).state is ClientState.REVOKED
    assert tracker.take_notice(C1).why == f"no request or heartbeat for {TIMEOUT_S:g} s"
    w.sweep()
    assert len(gone) == 1  # told once


def test_the_watch_forgets_a_silent_client_that_cannot_run(tracker, watch, clock):
    w, gone = watch
    tracker.register(C1, foreign())
    clock.now = T0 + TIMEOUT_S + 1
    w.sweep()
    assert [(c, exited) for c, _, exited, _ in gone] == [(C1, False)]
    assert tracker.record(C1) is None


def test_the_watch_forgets_a_revoked_client_once_its_lock_is_released(tracker, watch, clock, held):
    w, gone = watch
    held.add(LOCK)
    tracker.register(C1, foreign(), lock_offset=LOCK)
    clock.now = T0 + TIMEOUT_S + 1
    w.sweep()
    assert tracker.record(C1).state is ClientState.REVOKED
    w.sweep()
    assert len(gone) == 1
    held.discard(LOCK)  # its process exited (the lock goes with the last file description)
    w.sweep()
    assert gone[1:] == [(C1, "process exited", True, True)]
    assert tracker.record(C1) is None


def test_a_failing_clean_up_still_ends_the_client(tracker, clock):
    def on_gone(client, why, exited):
        raise RuntimeError("clean-up failed")

    w = ClientWatch(tracker, on_gone)
    tracker.register(C1, foreign())
    clock.now = T0 + TIMEOUT_S + 1
    w.sweep()
    assert tracker.record(C1) is None
    assert tracker.take_notice(C1) is not None


def test_close_forgets_every_client_and_closes_their_pidfds(clock):
    t = LivenessTracker(TIMEOUT_S, clock=clock)
    fd = t.register(C1, ME).pidfd
    t.register(C2, foreign())
    t.close()
    assert (t.pidfds(), dict(t.snapshot().clients)) == ([], {})
    link = f"/proc/self/fd/{fd}"
    assert not os.path.exists(link) or os.readlink(link) != "anon_inode:[pidfd]"
