"""The server's own view of a benchmark level, read from its /metrics (server/metrics.py)
before and after the level: the engine thread's timings of the level's requests (TTFT, queue,
and the HTTP handler's own parts), its inter-token gaps' tail and the server's GC collections;
and this process's own GC collections meanwhile (`GcRecorder`). bench/http.py reports them.
Imports neither JAX nor the server (the test of `server_tails` renders a real /metrics)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from bench import common
from scheduler.gc_pauses import GcPauses

log = logging.getLogger("bench.server_metrics")


# The server's own histograms (server/metrics.py): submit -> first token, and submit -> first
# prompt chunk dispatched, as the engine thread measures them; and on the event loop, handler
# entry -> engine requests submitted ("admit") and handler entry -> first frame with a token
# handed over (absent from servers before the fourteenth session).
ENGINE_TIMINGS = {"ttft": "pallas_time_to_first_token_seconds", "queue": "pallas_request_queue_seconds",
                  "admit": "pallas_http_admit_seconds", "first_frame": "pallas_http_time_to_first_frame_seconds"}
OPTIONAL_TIMINGS = ("admit", "first_frame")


def parse_metrics(text: str) -> dict[str, str]:
    """Prometheus text: each sample's value by its name with labels (`name{label="v",...}`)."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")  # "name value [timestamp]"
        values[name] = rest.split()[0] if rest.split() else ""
    return values


async def engine_timing_sums(client, url: str) -> dict[str, Any] | None:
    """(sum, count) of each of ENGINE_TIMINGS from the server's /metrics, and under "raw" every
    sample by its name with labels (`name{label="v",...}`); None where it cannot be read."""
    try:
        resp = await client.get(url + "/metrics")
        resp.raise_for_status()
    except Exception as e:  # noqa: BLE001 - a diagnostic: the bench goes on without it
        log.warning("no engine timings from %s/metrics: %s", url, e)
        return None
    values = parse_metrics(resp.text)
    try:
        sums: dict[str, Any] = {
            key: (float(values[f"{name}_sum"]), float(values[f"{name}_count"]))
            for key, name in ENGINE_TIMINGS.items() if key not in OPTIONAL_TIMINGS or f"{name}_sum" in values}
    except (KeyError, ValueError):
        log.warning("the server's /metrics lacks %s", ", ".join(
            name for key, name in ENGINE_TIMINGS.items() if key not in OPTIONAL_TIMINGS))
        return None
    sums["raw"] = values
    return sums


# Where an inter-token p99 stands apart from its p50: the server's engine-thread gaps
# (server/metrics.py's histogram; its bounds are common.LONG_GAP_BOUNDS_MS) and its process's
# cyclic-GC pauses, between two reads of /metrics.
ITL_HISTOGRAM = "pallas_inter_token_latency_seconds"
GC_HISTOGRAM = "pallas_gc_pause_seconds"
ENGINE_GC_HISTOGRAM = "pallas_engine_gc_pause_seconds"  # where the engine runs in a process of its own


def server_tails(before, after) -> dict[str, Any] | None:
    """The share (%) of the engine thread's inter-token gaps over each bound of
    common.LONG_GAP_BOUNDS_MS, and the server's GC collections per generation (count, ms in
    all: "gc0".."gc2"; the engine process's, where it has one, "engine_gc0".."engine_gc2"), over
    the requests finished between two reads of `engine_timing_sums`."""
    if before is None or after is None:
        return None
    b, a = before["raw"], after["raw"]

    def delta(name: str) -> float | None:
        try:
            return float(a[name]) - float(b.get(name, 0.0))
        except (KeyError, ValueError):
            return None

    out: dict[str, Any] = {}
    gaps = delta(f"{ITL_HISTOGRAM}_count")
    for bound in common.LONG_GAP_BOUNDS_MS:
        within = delta(f'{ITL_HISTOGRAM}_bucket{{le="{bound / 1e3!r}"}}')
        out[f"itl_over_{bound}ms_pct"] = (round(100 * (gaps - within) / gaps, 3)
                                          if gaps and within is not None else None)
    for prefix, histogram in (("gc", GC_HISTOGRAM), ("engine_gc", ENGINE_GC_HISTOGRAM)):
        for gen in range(3):
            count, total = delta(f'{histogram}_count{{generation="{gen}"}}'), delta(
                f'{histogram}_sum{{generation="{gen}"}}')
            if count is not None:
                out[f"{prefix}{gen}"] = {"count": int(count), "ms": round(1e3 * (total or 0.0), 3)}
    return out


class GcRecorder:
    """This process's cyclic-GC collections while a level runs (the client's own pauses stall
    its event loop, and with it the arrival times it records): count, total and longest ms per
    generation, by a `GcPauses` of its own in `gc.callbacks` meanwhile."""

    def __init__(self) -> None:
        self.pauses = GcPauses()

    def __enter__(self) -> "GcRecorder":
        gc.callbacks.append(self.pauses.callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self.pauses.callback)

    def summary(self) -> dict[str, dict[str, float]]:
        p = self.pauses
        return {f"gc{g}": {"count": sum(p.counts[g]), "ms": round(1e3 * p.sums[g], 3),
                           "max_ms": round(1e3 * p.longest[g], 3)} for g in range(3)}


async def scrape_after(client, url: str, before, requests: int, deadline_s: float = 2.0):
    """`engine_timing_sums` once the server's histograms count `requests` more finished requests
    with a first token than `before` (its engine thread observes a request's timings just after its last event,
    so a scrape right after the last stream ends can miss them); the last scrape at the
    deadline, with a warning, if they never do."""
    t_end = time.monotonic() + deadline_s
    while True:
        after = await engine_timing_sums(client, url)
        if before is None or after is None or after["ttft"][1] - before["ttft"][1] >= requests:
            return after
        if time.monotonic() > t_end:
            log.warning("the server's /metrics counts %d of the level's %d requests",
                        int(after["ttft"][1] - before["ttft"][1]), requests)
            return after
        await asyncio.sleep(0.05)


def engine_timing_means(before, after) -> dict[str, Any] | None:
    """The server-side means (ms) of ENGINE_TIMINGS over the requests finished between two reads
    of `engine_timing_sums`: with the client's own TTFT, what the HTTP layer adds to it."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {"requests": int(after["ttft"][1] - before["ttft"][1])}
    for key in ENGINE_TIMINGS:
        if key not in after or key not in before:
            continue
        count = after[key][1] - before[key][1]
        out[f"{key}_ms_mean"] = round(1e3 * (after[key][0] - before[key][0]) / count, 3) if count else None
    return out
