"""OpenTelemetry spans from the bus's request records (``kvdepot.observability.tracing``): records go
through a real EventBus to ``RequestSpans``, whose spans land in the SDK's in-memory exporter. Times are
the records' own, to the nanosecond; a chunk request is one span, however many records tell of it."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # the otel extra is part of the test extra
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvdepot.config import ObservabilityConfig
from kvdepot.errors import ConfigError
from kvdepot.events import ChunkRequestDone, L1Changed, RequestDone
from kvdepot.observability.bus import EventBus
from kvdepot.observability.tracing import PREFETCH_SPAN, RequestSpans, ns, tracer_provider

T0 = 1_790_000_000.123456  # a wall-clock second of 2026
KEYS = tuple(bytes([i]) * 16 for i in range(4))


def traced(events: list[object], sample_ratio: float = 1.0) -> list:
    """The finished spans ``events`` make, published through a real bus to the subscriber."""
    provider = tracer_provider("kvdepot-unit", sample_ratio, "9.9")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = RequestSpans(provider.get_tracer("kvdepot"))
    bus = EventBus(4096)
    bus.subscribe("otlp", spans.handle, RequestSpans.KINDS)
    bus.start()
    try:
        for e in events:
            bus.publish(e)
        assert bus.flush()
    finally:
        bus.close()
    assert bus.stats().handler_errors == {"otlp": 0} and bus.stats().dropped == 0
    return list(exporter.get_finished_spans())


def lookup(found: int = 3, salt: str = "", **extra) -> ChunkRequestDone:
    return ChunkRequestDone("lookup", T0, 0.0025, "m-1", salt, KEYS, 16, 8192, found, "ok", "LOOKUP", **extra)


def test_a_chunk_request_is_one_span_with_exact_times_and_its_attributes():
    record = lookup(found=3, salt="tenant-a")
    [span] = traced([record, RequestDone("LOOKUP", "ok", 0.0024, T0 + 0.0024, described=True)])
    assert span.name == "kvdepot/LOOKUP"
    assert span.kind is SpanKind.SERVER
    assert (span.start_time, span.end_time) == (ns(T0), ns(T0) + 2_500_000)
    assert dict(span.attributes) == {
        "rpc.service": "kvdepot",
        "rpc.method": "LOOKUP",
        "kvdepot.outcome": "ok",
        "kvdepot.op": "lookup",
        "kvdepot.model": "m-1",
        "kvdepot.cache_salt": "tenant-a",
        "kvdepot.chunks": 4,
        "kvdepot.chunks_found": 3,
        "kvdepot.tokens": 64,
        "kvdepot.tokens_found": 48,
        "kvdepot.bytes": 3 * 8192,
    }
    assert span.status.status_code is StatusCode.UNSET
    assert span.parent is None
    assert span.resource.attributes["service.name"] == "kvdepot-unit"
    assert span.resource.attributes["service.version"] == "9.9"


def test_no_salt_no_salt_attribute_and_the_request_type_names_the_span():
    store = ChunkRequestDone("store", T0, 0.001, "m-1", "", KEYS[:2], 16, 8192, 2, "ok", "STORE_INLINE")
    [span] = traced([store])
    assert span.name == "kvdepot/STORE_INLINE"
    assert "kvdepot.cache_salt" not in span.attributes
    assert (span.attributes["kvdepot.op"], span.attributes["kvdepot.chunks_found"], span.attributes["kvdepot.bytes"]) == ("store", 2, 16384)


def test_other_requests_are_spans_from_request_done_and_a_failure_is_an_error():
    ping = RequestDone("PING", "ok", 0.000125, T0 + 1.0)
    failed = RequestDone("COMMIT_STORE", "LEASE_EXPIRED", 0.0005, T0 + 2.0)
    spans = traced([ping, L1Changed(()), failed])  # L1Changed: not a request, no span
    assert [s.name for s in spans] == ["kvdepot/PING", "kvdepot/COMMIT_STORE"]
    p, f = spans
    assert (p.start_time, p.end_time) == (ns(T0 + 1.0) - 125_000, ns(T0 + 1.0))
    assert p.status.status_code is StatusCode.UNSET and p.attributes["kvdepot.outcome"] == "ok"
    assert (f.start_time, f.end_time) == (ns(T0 + 2.0) - 500_000, ns(T0 + 2.0))
    assert f.status.status_code is StatusCode.ERROR and f.status.description == "LEASE_EXPIRED"
    assert f.attributes["kvdepot.outcome"] == "LEASE_EXPIRED" and f.attributes["rpc.method"] == "COMMIT_STORE"


def test_a_chunk_request_that_failed_is_a_span_from_its_request_done():
    [span] = traced([RequestDone("LOOKUP", "BAD_REQUEST", 0.0001, T0)])  # its handler raised: no ChunkRequestDone
    assert span.name == "kvdepot/LOOKUP" and span.status.status_code is StatusCode.ERROR
    assert "kvdepot.model" not in span.attributes


def test_a_lookup_that_prefetched_from_l2_has_a_child_span_for_the_prefetch():
    # 1 chunk was in L1; the prefetch (the last 2 ms of 2.5) brought 2 of the 3 others from L2.
    record = lookup(found=3, prefetch_s=0.002, prefetched=2)
    described = RequestDone("LOOKUP", "ok", 0.0004, T0 + 0.0004, described=True)  # the reply went out first
    spans = traced([described, record])
    assert sorted(s.name for s in spans) == sorted(["kvdepot/LOOKUP", PREFETCH_SPAN])
    [parent] = [s for s in spans if s.name == "kvdepot/LOOKUP"]
    [child] = [s for s in spans if s.name == PREFETCH_SPAN]
    assert child.parent is not None and child.parent.span_id == parent.context.span_id
    assert child.context.trace_id == parent.context.trace_id
    end = ns(T0) + 2_500_000
    assert (parent.start_time, parent.end_time) == (ns(T0), end)
    assert (child.start_time, child.end_time) == (end - 2_000_000, end)
    assert child.kind is SpanKind.INTERNAL
    assert dict(child.attributes) == {"kvdepot.chunks": 3, "kvdepot.chunks_found": 2, "kvdepot.bytes": 2 * 8192}
    assert parent.attributes["kvdepot.chunks_found"] == 3


def test_sampling_zero_makes_no_span_and_one_makes_every_span():
    events = [lookup(prefetch_s=0.001, prefetched=1), RequestDone("PING", "ok", 0.0001, T0)]
    assert traced(events, sample_ratio=0.0) == []
    assert len(traced(events, sample_ratio=1.0)) == 3


def test_a_sampling_ratio_keeps_about_that_share_of_requests():
    kept = traced([RequestDone("PING", "ok", 0.0001, T0 + i) for i in range(2000)], sample_ratio=0.25)
    assert 300 < len(kept) < 700  # 500 expected; random trace ids (sd ~19), so these bounds never fail by chance


def test_otlp_settings_are_checked_naming_their_flags():
    with pytest.raises(ConfigError, match="--otlp-endpoint collector:4318: give an OTLP/HTTP URL"):
        ObservabilityConfig(otlp_endpoint="collector:4318")
    with pytest.raises(ConfigError, match="--otlp-sample-ratio"):
        ObservabilityConfig(otlp_sample_ratio=1.5)
    with pytest.raises(ConfigError, match="--otlp-service-name"):
        ObservabilityConfig(otlp_service_name="")
    ok = ObservabilityConfig(otlp_endpoint="https://collector:4318/v1/traces", otlp_sample_ratio=0.0)
    assert (ok.otlp_endpoint, ok.otlp_service_name, ok.otlp_sample_ratio) == ("https://collector:4318/v1/traces", "kvdepot", 0.0)
