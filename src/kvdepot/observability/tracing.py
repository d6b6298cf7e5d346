"""OpenTelemetry spans from the event bus's request records (``--otlp-endpoint``; the extra ``kvdepot[otel]``).

::

    RequestDone, ChunkRequestDone ──drain thread──► RequestSpans.handle ──► spans, timed by the records
                                                                              │
                        BatchSpanProcessor (its own thread, bounded queue) ◄──┘──► OTLP/HTTP collector

Only the composition root imports this module, and only when ``--otlp-endpoint`` is given: without it
kvdepot never imports OpenTelemetry, and without the package that flag is a ConfigError.

One span per answered request, named ``kvdepot/<request type>``. A LOOKUP, STORE or RETRIEVE is
described by its ``ChunkRequestDone`` (model, salt, chunks asked and found, tokens, bytes); its
``RequestDone`` says ``described`` and makes no second span. Every other request (and a chunk request
that failed) is a span from its ``RequestDone``. A LOOKUP that prefetched from L2 gets a child span for
the prefetch, which is the tail of the lookup. Start and end come from the records (start = end -
duration), so a span is exact however late the bus hands its record over; exporting runs on the batch
processor's thread, so a slow or absent collector never holds up the drain thread. An export that fails
is logged by OpenTelemetry's exporter and the spans are dropped: tracing never fails a request.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvdepot.events import ChunkRequestDone, RequestDone
from kvdepot.redact import mask_url

log = logging.getLogger(__name__)

TRACER = "kvdepot"
EXPORT_TIMEOUT_S = 5.0  # one export's budget, retries included
CLOSE_TIMEOUT_S = 5.0  # the flush at close: a collector that hangs never holds a shutdown up longer
PREFETCH_SPAN = "kvdepot/L2_PREFETCH"


def ns(seconds: float) -> int:
    """Seconds (wall clock or a duration) as the integer nanoseconds OpenTelemetry takes."""
    return round(seconds * 1e9)


def tracer_provider(service_name: str, sample_ratio: float, version: str = "") -> TracerProvider:
    """A provider sampling ``sample_ratio`` of the requests (a prefetch span follows its LOOKUP's fate)."""
    resource = Resource.create({"service.name": service_name, "service.version": version})
    return TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample_ratio)), resource=resource, shutdown_on_exit=False)


class RequestSpans:
    """The bus subscriber: each record of an answered request becomes a span (drain thread only)."""

    KINDS = (RequestDone, ChunkRequestDone)

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def handle(self, events: list[object]) -> None:
        for e in events:
            if isinstance(e, ChunkRequestDone):
                self._chunk_request(e)
            elif isinstance(e, RequestDone) and not e.described:
                end = ns(e.t_end)
                self._span(e.rtype, e.outcome, end - ns(e.duration_s), end, {})

    def _chunk_request(self, e: ChunkRequestDone) -> None:
        start = ns(e.t)
        end = start + ns(e.duration_s)
        attributes = {
            "kvdepot.op": e.op,
            "kvdepot.model": e.model,
            "kvdepot.chunks": len(e.keys),
            "kvdepot.chunks_found": e.found,
            "kvdepot.tokens": len(e.keys) * e.chunk_tokens,
            "kvdepot.tokens_found": e.found * e.chunk_tokens,
            "kvdepot.bytes": e.found * e.chunk_bytes,
        }
        if e.salt:
            attributes["kvdepot.cache_salt"] = e.salt
        span = self._span(e.rtype or e.op.upper(), e.outcome, start, end, attributes, finish=False)
        if e.prefetch_s > 0:
            # The lookup's own part found found - prefetched chunks in L1; the prefetch asked L2 for the rest.
            asked = len(e.keys) - (e.found - e.prefetched)
            prefetch = self.tracer.start_span(
                PREFETCH_SPAN,
                context=trace.set_span_in_context(span),
                kind=SpanKind.INTERNAL,
                attributes={"kvdepot.chunks": asked, "kvdepot.chunks_found": e.prefetched, "kvdepot.bytes": e.prefetched * e.chunk_bytes},
                start_time=end - ns(e.prefetch_s),
            )
            prefetch.end(end_time=end)
        span.end(end_time=end)

    def _span(self, rtype: str, outcome: str, start: int, end: int, attributes: dict, finish: bool = True) -> trace.Span:
        span = self.tracer.start_span(
            f"kvdepot/{rtype}",
            kind=SpanKind.SERVER,
            attributes={"rpc.service": "kvdepot", "rpc.method": rtype, "kvdepot.outcome": outcome, **attributes},
            start_time=start,
        )
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, outcome))
        if finish:
            span.end(end_time=end)
        return span


class OtlpExport:
    """The spans' way out: ``start`` attaches a BatchSpanProcessor exporting to ``endpoint`` over
    OTLP/HTTP (its thread starts there, never in the constructor); ``close`` flushes what is queued
    (within ``CLOSE_TIMEOUT_S``) and stops it. The composition root closes it after the bus."""

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float, version: str = "") -> None:
        self.endpoint = endpoint
        self.provider = tracer_provider(service_name, sample_ratio, version)
        self.spans = RequestSpans(self.provider.get_tracer(TRACER, version))
        self._started = self._closed = False

    def start(self) -> None:
        if self._started or self._closed:
            return
        self._started = True
        exporter = OTLPSpanExporter(endpoint=self.endpoint, timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_S * 1000))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        # The SDK's shutdown takes no deadline (an export in flight, then the last one, each up to
        # EXPORT_TIMEOUT_S): it runs on a thread of its own, and what it has not sent in time is dropped.
        flush = threading.Thread(target=self.provider.shutdown, name="kvdepot-otlp-close", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            log.warning("spans not exported to %s within %.0f s at shutdown were dropped", mask_url(self.endpoint), timeout_s)
