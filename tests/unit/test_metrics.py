"""``/metrics`` exports what the storage snapshot says, under the names written out in
``observability/metrics.py``: each name is checked against the snapshot field it claims to show, on a real
StorageManager (a 1 MiB arena, an in-memory tier) after real stores, a clear and a prefetch."""

from __future__ import annotations

import threading
from dataclasses import asdict

from prometheus_client.parser import text_string_to_metric_families

from kvdepot.config import StorageConfig
from kvdepot.observability import metrics as mod
from kvdepot.observability.metrics import Metrics
from kvdepot.storage.l1 import Toucher
from kvdepot.storage.manager import StorageManager
from kvdepot.types import ClearScope, ClientId, ObjectKey

SIZE = 64 << 10


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def exported(name: str, counter: bool) -> str:
    return name + "_total" if counter else name


def test_every_storage_metric_shows_its_snapshot_field(tmp_path):
    sm = StorageManager(StorageConfig(l1_size_gb=1 / 1024, shm_dir=str(tmp_path), prefault=False, l2=("memory:size_gb=0.01",)))
    sm.start()
    try:
        keys = [ObjectKey(bytes([i]) * 48) for i in range(3)]
        res = sm.reserve(keys, SIZE, ClientId(b"a"), toucher=Toucher.SERVER)
        sm.commit(res.lease_id, ClientId(b"a"))
        # wait until the tier has all three (the store controller pushes in the background)
        for _ in range(2000):
            if sm.snapshot().tiers[0].stored == 3:
                break
            threading.Event().wait(0.005)
        sm.clear(ClearScope.L1)
        done = threading.Event()
        sm.prefetch(keys, 0, SIZE, "", lambda p: done.set())
        assert done.wait(30)
        metrics = Metrics()
        metrics.watch_storage(sm.snapshot)
        got = samples(metrics.text())
        snap = sm.snapshot()
        assert snap.prefetch is not None and snap.prefetch.chunks_loaded == 3 and snap.store is not None
        for part, gauges, counters in (
            (snap.l1, mod._L1_GAUGES, mod._L1_COUNTERS),
            (snap.store, mod._STORE_GAUGES, mod._STORE_COUNTERS),
            (snap.prefetch, mod._PREFETCH_GAUGES, mod._PREFETCH_COUNTERS),
        ):
            fields = asdict(part)
            for table, counter in ((gauges, False), (counters, True)):
                for name, _, field in table:
                    assert got[(exported(name, counter), ())] == fields[field], name
        tier = snap.tiers[0]
        assert got[("kvdepot_l2_healthy", (("kind", "memory"), ("tier", tier.name)))] == 1.0
        assert got[("kvdepot_l2_objects", (("tier", tier.name),))] == tier.objects == 3
        assert got[("kvdepot_l2_stored_total", (("tier", tier.name),))] == tier.stored == 3
        assert got[("kvdepot_l2_loaded_total", (("tier", tier.name),))] == tier.loaded == 3
    finally:
        sm.close()


def test_without_tiers_no_l2_controller_metrics(tmp_path):
    sm = StorageManager(StorageConfig(l1_size_gb=1 / 1024, shm_dir=str(tmp_path), prefault=False))
    sm.start()
    try:
        metrics = Metrics()
        metrics.watch_storage(sm.snapshot)
        names = {name for name, _ in samples(metrics.text())}
        assert "kvdepot_l1_capacity_bytes" in names
        assert not any(n.startswith(("kvdepot_l2_store", "kvdepot_l2_prefetch")) for n in names)
    finally:
        sm.close()


def test_past_the_model_cap_a_new_model_takes_the_label_of_one_idle_past_the_limit(monkeypatch):
    from types import SimpleNamespace

    now = [1000.0]
    monkeypatch.setattr(mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(mod, "MAX_MODELS", 2)
    m = Metrics()

    def used(model: str) -> None:
        m.lookup_asked(model, 16)
        m.lookup_answered(model, {mod.L1: 16}, 0)
        m.stored(model, 1, 100, "shm")

    def labels() -> set[str]:
        return {dict(k[1]).get("model") for k in samples(m.text()) if k[0] == "kvdepot_lookups_total"}

    used("old")
    used("busy")
    now[0] += 10
    used("new")  # both labels taken and in use: the new model shares "(other)"
    assert labels() == {"old", "busy", mod.OTHER_MODELS}
    now[0] += mod.MODEL_IDLE_S - 5
    used("busy")  # in use all along (its lookups keep it), while "old" is idle past the limit
    m.lookup_asked("busy", 16)
    now[0] += 6
    used("newer")  # takes the place of "old", whose series go
    assert labels() == {"busy", "newer", mod.OTHER_MODELS}
    s = samples(m.text())
    assert not any(dict(k[1]).get("model") == "old" for k in s)
    assert s[("kvdepot_lookups_total", (("model", "newer"),))] == 1
    assert s[("kvdepot_hit_tokens_total", (("model", "newer"), ("tier", mod.L1)))] == 16
    assert s[("kvdepot_lookups_total", (("model", "busy"),))] == 3  # kept its counts
    # "new", counted as "(other)" before, gets no label of its own while both are in use: nothing is idle yet.
    used("new")
    assert s[("kvdepot_lookups_total", (("model", mod.OTHER_MODELS),))] == 1
    assert samples(m.text())[("kvdepot_lookups_total", (("model", mod.OTHER_MODELS),))] == 2


def test_status_totals_never_go_back_when_an_idle_models_label_is_given_to_another(monkeypatch):
    """Past the model cap, a model idle for 6 h gives its label to a new one and its series go. /status
    summed its totals (lookups, tokens asked, found and missed, chunks stored and read back) over the
    series left, so they fell: the dashboard's rates went negative, usage_log's history went back, and
    ``kvdepot status`` showed fewer lookups than a minute before."""
    from types import SimpleNamespace

    from kvdepot.server.status import lookups_document, transfers_document

    now = [1000.0]
    monkeypatch.setattr(mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(mod, "MAX_MODELS", 2)
    m = Metrics()

    def used(model: str) -> None:
        m.lookup_asked(model, 32)
        m.lookup_answered(model, {mod.L1: 16}, 16)
        m.stored(model, 1, 100, "shm")
        m.retrieved(model, 1, 100, "shm")

    def totals() -> dict:
        lk = lookups_document(m)
        st, rt = transfers_document(m.stored_chunks, m.stored_bytes, m), transfers_document(m.retrieved_chunks, m.retrieved_bytes, m)
        return {
            **{k: lk[k] for k in ("requests", "requested_tokens", "hit_tokens", "missed_tokens")},
            "hit_l1": lk["hit_tokens_by_tier"].get(mod.L1, 0),
            "stored_chunks": st["chunks"], "stored_bytes": st["bytes"], "retrieved_chunks": rt["chunks"], "retrieved_bytes": rt["bytes"],
        }

    for _ in range(3):
        used("old")
    used("busy")
    before = totals()
    now[0] += mod.MODEL_IDLE_S + 10
    used("busy")
    used("newer")  # takes the place of "old", whose series go
    after = totals()
    assert "old" not in lookups_document(m)["by_model"]
    went_back = {k: (before[k], after[k]) for k in before if after[k] < before[k]}
    assert not went_back, f"/status totals went backwards: {went_back}"
    assert after == {k: v + v // 4 * 2 for k, v in before.items()}  # two more uses on top of the four


def test_every_removal_reason_is_documented():
    """Every reason an object leaves L1 is a label value of ``kvdepot_l1_removed_objects``: its help text
    and README's metrics paragraph name each (``deleted`` was missing from the one, ``discarded`` from the other)."""
    import re
    from pathlib import Path

    from kvdepot.events import RemovedBecause

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [paragraph] = [p for p in readme.split("\n\n") if "removals by reason" in p]
    helptext = Metrics().l1_removed._documentation
    for reason in RemovedBecause:
        assert reason.value in helptext, f"kvdepot_l1_removed_objects' help does not name reason {reason.value!r}"
        assert re.search(rf"`{reason.value}`", paragraph), f"README's metrics paragraph does not name removal reason {reason.value!r}"
