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


def test_a_forgotten_model_takes_its_alarm_series_along(monkeypatch):
    """The gauge got a series for every model that ever fired, and kept it after the alarm forgot the
    model: a fleet rolling model versions grew the scrape without bound."""
    from kvdepot.observability.metrics import Metrics

    monkeypatch.setattr(mod, "MAX_MODELS", 1)
    metrics = Metrics()
    now = [100.0]
    alarm = SilentMissAlarm(10.0, on_change=lambda model, firing: metrics.silent_miss.labels(model).set(int(firing)),
                            clock=lambda: now[0], on_forget=metrics.forget_silent_miss)  # fmt: skip

    def series() -> set[str]:
        return {s.labels["model"] for fam in metrics.silent_miss.collect() for s in fam.samples}

    alarm.handle([_req("store", "v1", 1), _req("lookup", "v1", 0)])
    now[0] += 15
    alarm.handle([_req("lookup", "v1", 0)])
    assert series() == {"v1"}
    alarm.handle([_req("lookup", "v1", 1)])  # a hit: the alarm ends, its series reads 0
    now[0] += 25  # idle for two windows: the next model takes its place
    alarm.handle([_req("store", "v2", 1)])
    assert set(alarm._models) == {"v2"}
    assert series() == set(), "the forgotten model's series stayed"
