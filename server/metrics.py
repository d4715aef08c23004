"""Prometheus metrics for one app, in its own `CollectorRegistry` (several apps per process in tests).

Two sources, both from the engine: its `EngineStats` snapshot, read at scrape time (slots,
running, waiting, rejected, token totals), and one `RequestTiming` per finished request, handed
to `Metrics.observe` (registered with `Engine.add_observer`; it runs on the engine thread, and
prometheus_client metrics are thread-safe). Besides, the process's cyclic-GC pauses
(`pallas_gc_pause_seconds`, by generation; scheduler/gc_pauses.py), and the engine process's
(`pallas_engine_gc_pause_seconds`, where the engine runs in a process of its own): a collection
holds its process's GIL, and a full one over a large heap is a p99 of its own. The
engine measures time to first token and inter-token gaps where it hands tokens to the stream,
including queue time the server cannot see, so the server reads no clock for request metrics.
HTTP responses are counted by the app's outermost middleware.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from scheduler.gc_pauses import GC_BUCKETS, GcSnapshot, gc_pauses
from scheduler.requests import RequestTiming
from scheduler.types import EngineStats

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _GcCollector:
    """A GC pause histogram by generation from a `GcSnapshot` read at scrape time; nothing while
    there is none (no engine process)."""

    def __init__(self, name: str, documentation: str, snapshot: Callable[[], GcSnapshot | None]) -> None:
        self._name, self._documentation, self._snapshot = name, documentation, snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        if snapshot is None:
            return
        counts, sums = snapshot
        family = HistogramMetricFamily(self._name, self._documentation, labels=["generation"])
        for generation in range(3):
            cumulative, buckets = 0, []
            for le, n in zip((*GC_BUCKETS, float("inf")), counts[generation]):
                cumulative += n
                buckets.append(("+Inf" if le == float("inf") else repr(le), cumulative))
            family.add_metric([str(generation)], buckets, sum_value=sums[generation])
        yield family


class _EngineCollector:
    """Reads `EngineStats` when scraped; zeros while no engine is attached."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        ready = st is not None and st.state == "ready"
        yield GaugeMetricFamily("pallas_engine_ready", "1 when the engine serves requests", value=float(ready))
        num_slots = st.num_slots if st else 0
        busy = st.slots_busy if st else 0
        yield GaugeMetricFamily("pallas_slots", "Decode slots", value=num_slots)
        yield GaugeMetricFamily("pallas_slots_busy", "Slots holding a request", value=busy)
        yield GaugeMetricFamily(
            "pallas_slot_occupancy", "Busy slots / slots", value=busy / num_slots if num_slots else 0.0
        )
        yield GaugeMetricFamily("pallas_requests_running", "Requests in a slot", value=st.requests_running if st else 0)
        yield GaugeMetricFamily(
            "pallas_requests_waiting", "Requests queued for a slot", value=st.requests_waiting if st else 0
        )
        yield CounterMetricFamily(
            "pallas_requests_rejected", "Requests refused (queue full)", value=st.requests_rejected_total if st else 0
        )
        yield CounterMetricFamily(
            "pallas_prompt_tokens", "Prompt tokens prefilled", value=st.prompt_tokens_total if st else 0
        )
        yield CounterMetricFamily(
            "pallas_prompt_tokens_cached", "Prompt tokens reused from the prompt cache, not prefilled",
            value=st.prompt_tokens_cached_total if st else 0,
        )
        yield CounterMetricFamily(
            "pallas_generation_tokens", "Tokens generated", value=st.generation_tokens_total if st else 0
        )
        yield CounterMetricFamily(
            "pallas_draft_tokens", "Draft tokens checked by the speculative decode (--draft-max)",
            value=st.draft_tokens_total if st else 0,
        )
        yield CounterMetricFamily(
            "pallas_draft_tokens_accepted", "Draft tokens the speculative decode accepted",
            value=st.draft_tokens_accepted_total if st else 0,
        )
        yield CounterMetricFamily(
            "pallas_speculative_steps", "Decode steps that ran the speculative program (the others ran the plain "
            "one: no busy request's drafts paid lately, --draft-min-gain)",
            value=st.speculative_steps_total if st else 0,
        )


class Metrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None],
                 engine_gc: Callable[[], GcSnapshot | None] = lambda: None) -> None:
        """`engine_gc`: the engine process's GC pauses (None where the engine runs in this one)."""
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "pallas_http_requests", "HTTP responses", ["route", "method", "status"], registry=self.registry
        )
        self.queue_time = Histogram(
            "pallas_request_queue_seconds",
            "Submit to the first prompt chunk dispatched",
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pallas_time_to_first_token_seconds",
            "Submit to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "pallas_inter_token_latency_seconds",
            "Time between successive generated tokens",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "pallas_request_duration_seconds",
            "Submit to finish, per engine request",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # The HTTP layer's own share of a streamed request's TTFT, on the event loop: handler entry
        # (routed, before the body is read) to its engine requests submitted, and handler entry to
        # the first frame with a token handed to the server (bench/http.py splits the TTFT the
        # client sees into these and the engine's own).
        self.http_admit = Histogram(
            "pallas_http_admit_seconds",
            "Handler entry to the engine requests' submission (body read, parsed, prompts prepared)",
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.http_first_frame = Histogram(
            "pallas_http_time_to_first_frame_seconds",
            "Handler entry to the first streamed frame with a token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "pallas_requests_finished", "Engine requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.registry.register(_EngineCollector(engine_stats))
        pauses = gc_pauses()
        self.registry.register(_GcCollector(
            "pallas_gc_pause_seconds", "Cyclic garbage collections of the process, by generation", pauses.snapshot))
        self.registry.register(_GcCollector(
            "pallas_engine_gc_pause_seconds", "Cyclic garbage collections of the engine process, by generation",
            engine_gc))

    def observe(self, timing: RequestTiming) -> None:
        """Engine thread: one finished request's timings."""
        if timing.queue_s is not None:
            self.queue_time.observe(timing.queue_s)
        if timing.ttft_s is not None:
            self.time_to_first_token.observe(timing.ttft_s)
        for gap in timing.itl_s:
            self.inter_token_latency.observe(gap)
        self.request_duration.observe(timing.e2e_s)
        self.requests_finished.labels(finish_reason=timing.finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
