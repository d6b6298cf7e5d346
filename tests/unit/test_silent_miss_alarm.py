"""The silent-miss alarm's model bound: a fleet that rolls model versions keeps watching new models."""

from __future__ import annotations

from kvdepot.events import ChunkRequestDone
from kvdepot.observability import alarm as mod
from kvdepot.observability.alarm import SilentMissAlarm


def _req(op: str, model: str, found: int) -> ChunkRequestDone:
    return ChunkRequestDone(op, 0.0, 0.001, model, "", (bytes(32),), 16, 8192, found, "ok")


def test_past_the_bound_a_new_model_takes_the_place_of_one_idle_for_two_windows(monkeypatch):
    monkeypatch.setattr(mod, "MAX_MODELS", 2)
    now = [100.0]
    changes: list[tuple[str, bool]] = []
    alarm = SilentMissAlarm(10.0, on_change=lambda model, firing: changes.append((model, firing)), clock=lambda: now[0])
    alarm.handle([_req("store", "old", 1), _req("store", "firing", 1), _req("lookup", "firing", 0)])
    now[0] += 15
    alarm.handle([_req("lookup", "firing", 0)])  # stored, and no hit for a whole window
    assert changes == [("firing", True)]
    alarm.handle([_req("store", "new", 1), _req("lookup", "new", 0)])  # no room: both seen within two windows
    now[0] += 30
    alarm.handle([_req("lookup", "firing", 0)])
    assert [r for r in alarm.reasons() if "'firing'" in r]
    # "old" has had no request for two windows: "new" takes its place and is watched from now on.
    alarm.handle([_req("store", "new", 1), _req("lookup", "new", 0)])
    now[0] += 11
    alarm.handle([_req("lookup", "new", 0)])
    assert ("new", True) in changes
    assert len(alarm._models) == 2 and "old" not in alarm._models
