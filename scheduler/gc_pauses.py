"""The process's cyclic-GC pauses per generation, recorded from `gc.callbacks`.

A collection holds the GIL, so it stalls every thread of its process (the engine thread, the
event loop), and a full one over a large heap is a p99 of its own. `gc_pauses()` installs one
recorder per process. The server exports its process's (server/metrics.py,
`pallas_gc_pause_seconds`), and the engine process sends its own snapshots to the server with
its stats (scheduler/engine_process.py; `pallas_engine_gc_pause_seconds`).
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
import logging
from typing import Any

_log = logging.getLogger(__name__)

GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# (counts, sums): per generation 0..2, the collections per bucket of GC_BUCKETS (+Inf last), and
# the seconds in all.
GcSnapshot = tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]


class GcPauses:
    """The callback runs inside the collection with the GIL held and takes no lock (a collection
    can start inside any code, a lock's own section included); GC never nests, so one callback
    runs at a time. A reader may see counts one collection apart: harmless. `gc_pauses()` is the
    process's; another instance, added to `gc.callbacks` for a while, records that while
    (bench/server_metrics.py's `GcRecorder`)."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.counts = [[0] * (len(GC_BUCKETS) + 1) for _ in range(3)]  # per generation: per bucket, +Inf last
        self.sums = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause, self._started = time.perf_counter() - self._started, None
        generation = min(int(info.get("generation", 2)), 2)
        self.sums[generation] += pause
        self.longest[generation] = max(self.longest[generation], pause)
        self.counts[generation][bisect.bisect_left(GC_BUCKETS, pause)] += 1  # the first bound >= pause

    def snapshot(self) -> GcSnapshot:
        return tuple(tuple(c) for c in self.counts), tuple(self.sums)


_GC_PAUSES: GcPauses | None = None
_GC_LOCK = threading.Lock()


def gc_pauses() -> GcPauses:
    """The process's recorder, installed in `gc.callbacks` on first use."""
    global _GC_PAUSES
    with _GC_LOCK:
        if _GC_PAUSES is None:
            _GC_PAUSES = GcPauses()
            gc.callbacks.append(_GC_PAUSES.callback)
        return _GC_PAUSES


def freeze_heap() -> None:
    """`EngineConfig.gc_freeze`: a full collection, then everything alive moves to the permanent
    generation. Objects frozen there are never collected, so the heap frozen is what loading left,
    freed of its garbage first; what requests allocate later is collected as usual."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    _log.info("gc: %d objects frozen after warm-up (%.0f ms)", gc.get_freeze_count(),
             1e3 * (time.perf_counter() - started))
