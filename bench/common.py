"""Helpers shared by the benchmark scripts: memory probes, device facts, percentiles, prompt
generation, the weight bytes a decode step reads, copy bandwidth, result files, and the
client-side record of one request's token arrivals.

Nothing here imports JAX at module level: `bench/http.py` runs the server and the engine in
child processes, and a parent that touched the GPU would hold most of its memory.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Collection, Iterable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"

# llama.cpp on one H200, synthetic Llama-2-7B Q4_0 (the file bench/make_synthetic_gguf.py writes):
# llama-bench pp512 / tg128, and batched-bench generation tok/s by parallel sequences.
LLAMA_CPP_H200 = {
    "model": "synthetic Llama-2-7B Q4_0",
    "pp512_tok_s": 11481,
    "tg128_tok_s": 356,
    "batched_generation_tok_s": {"1": 347, "4": 1021, "8": 1374, "16": 2317, "32": 3469},
}
# The same build and GPU on the synthetic Llama-3-8B Q4_0 (issue 6's anchor): llama-bench only.
LLAMA_CPP_H200_LLAMA3_8B = {"model": "synthetic Llama-3-8B Q4_0", "pp512_tok_s": 10858, "tg128_tok_s": 334}


def llama_cpp_anchor(model_name: str | None) -> dict[str, Any]:
    """llama.cpp's H200 figures for the model's shape where they were measured (by the names
    bench/make_synthetic_gguf.py gives its files), else the Llama-2-7B Q4_0 ones; each names its
    model."""
    if model_name and "llama3-8b-q4_0" in model_name:
        return LLAMA_CPP_H200_LLAMA3_8B
    return LLAMA_CPP_H200


# ---------------------------------------------------------------------------------------------
# memory and device


def full_collection() -> dict[str, Any]:
    """One full cyclic-GC collection timed, with the objects it had to scan and those frozen out of
    its reach (`gc.freeze`, EngineConfig.gc_freeze): what a full collection, which holds the GIL,
    would stall the engine and the event loop for at this point."""
    import gc

    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    started = time.perf_counter()
    gc.collect()
    return {"ms": round(1e3 * (time.perf_counter() - started), 2), "tracked_objects": tracked,
            "frozen_objects": frozen}


def rss_mib() -> dict[str, float]:
    """Current and peak resident set size of this process, MiB."""
    try:
        import psutil  # optional

        info = psutil.Process().memory_info()
        peak = getattr(info, "peak_wset", None)  # Windows only
        out = {"rss_mib": info.rss / 2**20}
        if peak:
            out["peak_rss_mib"] = peak / 2**20
        else:
            out["peak_rss_mib"] = _proc_status().get("VmHWM", info.rss / 2**20)
        return out
    except ImportError:
        status = _proc_status()
        return {"rss_mib": status.get("VmRSS", float("nan")), "peak_rss_mib": status.get("VmHWM", float("nan"))}


def _proc_status() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = float(value.split()[0]) / 1024  # kB -> MiB
    except OSError:
        pass
    return out


def device_memory() -> dict[str, float] | None:
    """jax's memory_stats of device 0 in MiB (None where the backend has none, e.g. CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved")
    return {k.replace("bytes", "mib"): stats[k] / 2**20 for k in keys if k in stats}


def device_info() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {
        "gpu": dev.device_kind if dev.platform != "cpu" else None,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }


def enable_compilation_cache(directory: str | os.PathLike[str]) -> None:
    """JAX's persistent compilation cache, for every compiled program however quick."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def copy_bandwidth_gb_s(num_bytes: int, repeats: int = 10) -> float:
    """Device copy bandwidth (read + write bytes per second, 1e9) of `y = x + 1` over num_bytes."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    del x
    return 2 * (num_bytes // 4 * 4) / statistics.median(times) / 1e9


def weight_bytes_per_decode(model_path: str | os.PathLike[str], splits: Collection[str] = ()) -> int:
    """Device bytes of the weights one decode step reads: every layer, the output matrix and
    the norms, as the loader places them (`model.loader.tensor_bytes`, the formats in `splits`
    split); the token embedding only when it is also the output (otherwise a decode gathers B
    rows of it). KV-cache reads are not included."""
    from model.gguf_file import GGUFFile
    from model.loader import tensor_bytes

    gf = GGUFFile(model_path)
    untied = "output.weight" in gf.tensors
    return sum(tensor_bytes(gf, name, frozenset(splits)) for name in gf.tensors
               if not (untied and name == "token_embd.weight"))


# ---------------------------------------------------------------------------------------------
# statistics and prompts


# --mosaic-<kind>-tuning -> the tuning of pallas_kernels/mgpu_tuning.py it replaces fields of: decode
# (Q4_0, Q8_0, the Q6_K split), decode of the formats with offsets (Q4_K, Q4_1, Q5_K, Q5_1 split),
# prefill, and prefill of the 6-bit Q6_K split (its own K steps, `mgpu_tuning.MIN_TILE_K6`).
MOSAIC_TUNING_KINDS = {"decode": "DEFAULT_TUNING", "offset-decode": "OFFSET_DECODE_TUNING",
                       "prefill": "PREFILL_TUNING", "prefill6": "PREFILL6_TUNING"}


def add_mosaic_tuning_arguments(ap: Any) -> None:
    """Bench-only variants of the Mosaic GPU matmul's tunings (`pallas_kernels.mgpu_tuning`), for
    A/B runs without scratch code: `apply_mosaic_tuning_arguments` replaces the named fields."""
    for kind in MOSAIC_TUNING_KINDS:
        ap.add_argument(f"--mosaic-{kind}-tuning", default="", metavar="FIELD=VALUE,...",
                        help=f"a variant: these fields of the Mosaic GPU matmul's {kind.replace('-', ' ')} tuning "
                             "replaced (MosaicMatmulTuning, e.g. even_split=true, fold_offsets=false)")


def parse_tuning_fields(spec: str, base: Any) -> dict[str, Any]:
    """'a=1,b=true' -> {'a': 1, 'b': True}, each value read as the type of `base`'s field (a
    frozen dataclass); an unknown field or a value of the wrong kind raises ValueError."""
    fields = {f.name for f in dataclasses.fields(base)}
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"{item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        current = getattr(base, name)
        if current is None:  # an optional int field (e.g. DecodeAttentionConfig.num_splits)
            out[name] = None if text.lower() == "none" else int(text)
        elif isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{item!r}: {name} takes true or false")
            out[name] = text.lower() in ("true", "1")
        else:
            out[name] = type(current)(text)
    return out


def apply_mosaic_tuning_arguments(args: Any) -> dict[str, dict[str, Any]]:
    """Replaces `mgpu_tuning.DEFAULT_TUNING` / `OFFSET_DECODE_TUNING` / `PREFILL_TUNING` /
    `PREFILL6_TUNING` in this process per `add_mosaic_tuning_arguments` (the kernels take
    `default_tuning(m, offsets, fmt)` as they are lowered); returns the replaced fields, for the
    result file."""
    from pallas_kernels import mgpu_tuning

    changed: dict[str, dict[str, Any]] = {}
    for kind, name in MOSAIC_TUNING_KINDS.items():
        base = getattr(mgpu_tuning, name)
        fields = parse_tuning_fields(getattr(args, f"mosaic_{kind.replace('-', '_')}_tuning", ""), base)
        if fields:
            setattr(mgpu_tuning, name, dataclasses.replace(base, **fields))
            changed[kind] = fields
    return changed


def add_attention_config_arguments(ap: Any) -> None:
    """A bench-only variant of the Triton decode attention's plan (`attention_triton.DecodeAttentionConfig`)."""
    ap.add_argument("--attention-decode-config", default="", metavar="FIELD=VALUE,...",
                    help="a variant: these fields of the Triton decode attention's default config replaced "
                         "(DecodeAttentionConfig, e.g. target_programs=512,min_split_keys=64)")


def apply_attention_config_arguments(args: Any) -> dict[str, Any]:
    """Replaces `attention_triton.DEFAULT_DECODE_CONFIG` in this process (calls read it when they
    are traced); returns the replaced fields, for the result file."""
    from pallas_kernels import attention_triton

    base = attention_triton.DEFAULT_DECODE_CONFIG
    fields = parse_tuning_fields(args.attention_decode_config, base)
    if fields:
        attention_triton.DEFAULT_DECODE_CONFIG = dataclasses.replace(base, **fields)
    return fields


def percentile(values: Iterable[float], q: float) -> float | None:
    arr = np.asarray(list(values), np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    """Token ids drawn from the upper part of the vocabulary (past the byte and special tokens
    most vocabularies put first)."""
    low = min(1000, vocab_size // 4)
    return tuple(int(t) for t in rng.integers(low, vocab_size, size=length))


@dataclasses.dataclass
class StreamRecord:
    """Client-side times (perf_counter seconds) of one request's token arrivals."""

    label: str
    submitted: float
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, tokens)
    finish_reason: str | None = None
    error: str | None = None
    rejected: bool = False  # 429 / QueueFullError
    reported_tokens: int | None = None  # the server's usage count, where one was sent
    sent: float | None = None  # when the request was written (HTTP clients that know it)
    cached_tokens: int = 0  # prompt tokens the engine reused from its prompt cache
    tokens: list[int] = dataclasses.field(default_factory=list)  # the generated ids (the engine's streams)
    logprobs: list[Any] = dataclasses.field(default_factory=list)  # their TokenLogprobs, where asked for

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.submitted if self.arrivals else None

    @property
    def gaps(self) -> list[float]:
        times = [t for t, _ in self.arrivals]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def last(self) -> float | None:
        return self.arrivals[-1][0] if self.arrivals else None


def steady_tok_s(records: list[StreamRecord]) -> float | None:
    """Tokens per second while every request is generating: between the last request's first
    token and the first request's last token (prefill and TTFT excluded)."""
    window = steady_window(records)
    if window is None:
        return None
    start, end, live = window
    count = sum(n for r in live for t, n in r.arrivals if start < t <= end)
    return count / (end - start)


def steady_window(records: list[StreamRecord]) -> tuple[float, float, list[StreamRecord]] | None:
    """(start, end, streams) of the steady state `steady_tok_s` counts: the last request's first
    token to the first request's last token, and the streams that generate in it (every request
    not rejected, with two tokens or more); None where there is none."""
    live = [r for r in records if len(r.arrivals) >= 2]
    if not live or len(live) != len([r for r in records if not r.rejected]):
        return None
    start = max(r.arrivals[0][0] for r in live)
    end = min(r.arrivals[-1][0] for r in live)
    return (start, end, live) if end > start else None


def steady_gaps(records: list[StreamRecord]) -> dict[str, Any] | None:
    """The inter-token gaps wholly inside the steady window, every stream's: where the steady
    rate stands below one step per p50 gap, whether a few long gaps or all of them make the
    difference. A gap that starts before the window is left out: the window opens with the step
    that gives the last prompt its first token, so the other streams' gaps that end there span
    that prompt's prefill (they may be counted only for arriving a moment after it). "long" gaps
    are over twice the p50; "long_excess_pct" is what they last beyond the p50, summed over the
    streams and divided by the window times the streams (the share of the steady rate they
    cost)."""
    window = steady_window(records)
    if window is None:
        return None
    start, end, live = window
    gaps = [b - a for r in live for (a, _), (b, _) in zip(r.arrivals, r.arrivals[1:]) if start <= a and b <= end]
    if not gaps:
        return None
    arr = np.asarray(gaps, np.float64)
    p50 = float(np.percentile(arr, 50))
    long = arr[arr > 2 * p50]
    return {
        "gaps": int(arr.size),
        "ms_mean": ms(float(arr.mean())), "ms_p50": ms(p50), "ms_p90": ms(float(np.percentile(arr, 90))),
        "ms_p99": ms(float(np.percentile(arr, 99))), "ms_max": ms(float(arr.max())),
        "long": int(long.size),
        "long_excess_pct": round(100 * float((long - p50).sum()) / ((end - start) * len(live)), 2),
    }


def summarize(records: list[StreamRecord]) -> dict[str, Any]:
    """Throughput over the wall time, steady-state throughput, TTFT and inter-token gaps."""
    done = [r for r in records if not r.rejected and r.arrivals]
    out: dict[str, Any] = {
        "requests": len(records),
        "rejected": sum(r.rejected for r in records),
        "errors": sum(r.error is not None for r in records),
        "tokens": sum(r.num_tokens for r in done),
    }
    if done:
        wall = max(r.last for r in done) - min(r.submitted for r in done)
        out["tok_s"] = round(out["tokens"] / wall, 2) if wall > 0 else None
        steady = steady_tok_s(records)
        out["steady_tok_s"] = round(steady, 2) if steady else None
        out["steady_itl"] = steady_gaps(records)
        ttfts = [r.ttft for r in done]
        gaps = [g for r in done for g in r.gaps]
        out.update(
            ttft_ms_p50=ms(percentile(ttfts, 50)), ttft_ms_p99=ms(percentile(ttfts, 99)),
            itl_ms_p50=ms(percentile(gaps, 50)), itl_ms_p99=ms(percentile(gaps, 99)),
        )
        out.update(long_gaps(gaps))
    return out


LONG_GAP_BOUNDS_MS = (5, 10)  # bounds of the server's ITL histogram (server/metrics.py ITL_BUCKETS)


def long_gaps(gaps: list[float]) -> dict[str, float | int | None]:
    """How many inter-token gaps (seconds) there are ("itl_gaps") and how many are longer than each
    of LONG_GAP_BOUNDS_MS ("itl_over_5ms", ...), and that share in % ("itl_over_5ms_pct", ...):
    where a p99 stands apart from the p50, how many gaps make it. A gap equal to a bound is not
    over it, as the server's histogram counts it in the bucket `le` that bound."""
    out: dict[str, float | int | None] = {"itl_gaps": len(gaps)}
    for b in LONG_GAP_BOUNDS_MS:
        over = sum(g > b / 1e3 for g in gaps)
        out[f"itl_over_{b}ms"] = over
        out[f"itl_over_{b}ms_pct"] = round(100 * over / len(gaps), 3) if gaps else None
    return out


# ---------------------------------------------------------------------------------------------
# result files


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def result_path(out_dir: str | os.PathLike[str] | None, kind: str, stamp: str, suffix: str = ".json") -> pathlib.Path:
    directory = pathlib.Path(out_dir) if out_dir else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{kind}-{stamp}{suffix}"


def write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def run_facts(model: str | os.PathLike[str]) -> dict[str, Any]:
    """What every result file opens with: the device, the checkout, the model and the command."""
    return {**device_info(), "git": git_rev(), "model": str(model), "command": " ".join(sys.argv)}


def save_report(out_dir: str | os.PathLike[str] | None, kind: str, report: Any) -> pathlib.Path | None:
    """Writes `report` as `<kind>-<timestamp>.json` under `out_dir` and says so; nothing without one."""
    if not out_dir:
        return None
    path = result_path(out_dir, kind, timestamp())
    write_json(path, report)
    print(f"wrote {path}", flush=True)
    return path


def git_rev() -> str | None:
    """The checkout's commit ("+dirty" with uncommitted changes); None outside a git checkout."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read-only: never refresh the index
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, env=env)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=30,
                               env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def model_facts(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = pathlib.Path(path)
    return {"path": str(p), "name": p.name, "file_gib": round(p.stat().st_size / 2**30, 3)}


def read_trace(log_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The complete events of the newest `jax.profiler` trace under log_dir, read once:
    {"device": those on the device tracks (process names with /device:GPU), "host": the others,
    "threads": {(pid, tid): thread name}}; None when there is no trace file."""
    files = sorted(pathlib.Path(log_dir).rglob("*.trace.json.gz"))
    if not files:
        return None
    with gzip.open(files[-1]) as f:
        raw = json.load(f).get("traceEvents", [])
    meta = [e for e in raw if e.get("ph") == "M"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta if e.get("name") == "thread_name"}
    gpu = {pid for pid, name in names.items() if "/device:GPU" in name}
    complete = [e for e in raw if e.get("ph") == "X"]
    return {"device": [e for e in complete if e.get("pid") in gpu],
            "host": [e for e in complete if e.get("pid") not in gpu], "threads": threads}


def trace_events(log_dir: str | os.PathLike[str]) -> tuple[list[dict], list[dict]] | None:
    """`read_trace`'s device events and the host's CUDA driver or runtime calls (names cu*/cuda*:
    graph launches, host functions; kernels launched one by one do not show as such); None when
    there is no trace file."""
    trace = read_trace(log_dir)
    if trace is None:
        return None
    return trace["device"], [e for e in trace["host"] if str(e.get("name", "")).startswith("cu")]


def traced_device_events(fn: Any, reps: int) -> list[dict]:
    """The device events of a profiler trace of `reps` calls of `fn` (each waited for); [] where
    the trace has none (the CPU)."""
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(reps):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        return device_trace_events(d) or []


def device_trace_events(log_dir: str | os.PathLike[str]) -> list[dict] | None:
    """The device events of `trace_events`; None when there is no trace file."""
    events = trace_events(log_dir)
    return None if events is None else events[0]


def idle_gaps(events: list[dict], top: int = 10, min_us: float = 20.0) -> dict[str, Any]:
    """Where a device trace's span is idle: the gaps between the end of the work so far and the
    next event (events overlap on several streams). Returns the span, the busy and idle
    microseconds, the number and sum of gaps of at least `min_us`, and the `top` largest with
    the kernels on either side."""
    if not events:
        return {"error": "no device events"}
    ordered = sorted(events, key=lambda e: e["ts"])
    start, end = ordered[0]["ts"], ordered[0]["ts"] + ordered[0].get("dur", 0.0)
    last_name, gaps = ordered[0]["name"], []
    for e in ordered[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, last_name, e["name"]))
        e_end = e["ts"] + e.get("dur", 0.0)
        if e_end >= end:
            end, last_name = e_end, e["name"]
    span = end - start
    idle = sum(g for g, _, _ in gaps)
    big = [g for g in gaps if g[0] >= min_us]
    return {
        "span_us": round(span, 1),
        "busy_us": round(span - idle, 1),
        "idle_fraction": round(idle / span, 4) if span else None,
        f"gaps_of_{min_us:g}us_or_more": {"count": len(big), "sum_us": round(sum(g for g, _, _ in big), 1)},
        "largest": [{"us": round(g, 1), "after": a[:60], "before": b[:60]}
                    for g, a, b in sorted(gaps, reverse=True)[:top]],
    }


def request_timeline(trace: dict[str, Any], start_us: float, end_us: float, min_us: float = 30.0,
                     top: int = 80) -> dict[str, Any]:
    """One request laid out on a `read_trace` trace's clock, from `start_us` (its submit) to
    `end_us` (its first token's arrival), in ms from the submit: when the device's first work
    began and its last ended, the device's busy time and idle gaps in between, and the host's
    events of at least `min_us` (the `top` longest, in time order, with their thread)."""
    def ms_from_start(t: float) -> float:
        return round((t - start_us) / 1e3, 3)

    inside = [e for e in trace["device"] if start_us <= e["ts"] <= end_us]
    out: dict[str, Any] = {"ttft_ms": ms_from_start(end_us), "kernels": len(inside)}
    if inside:
        out["device_first_ms"] = ms_from_start(min(e["ts"] for e in inside))
        out["device_last_end_ms"] = ms_from_start(max(e["ts"] + e.get("dur", 0.0) for e in inside))
        out["device"] = idle_gaps(inside, min_us=min_us)
    host = [e for e in trace["host"] if e["ts"] < end_us and e["ts"] + e.get("dur", 0.0) > start_us
            and e.get("dur", 0.0) >= min_us]
    host = sorted(sorted(host, key=lambda e: -e.get("dur", 0.0))[:top], key=lambda e: e["ts"])
    out["host"] = [{"ms": ms_from_start(e["ts"]), "us": round(e.get("dur", 0.0), 1),
                    "thread": f'{trace["threads"].get((e.get("pid"), e.get("tid")), "")[:30]}/{e.get("tid")}',
                    "name": str(e.get("name", ""))[:100]} for e in host]
    return out


def busiest_kernels(events: list[dict], top: int = 15) -> list[dict[str, Any]]:
    """A device trace's kernels by the time they took in all (names cut to 80 characters), the
    `top` longest: name, calls, total and mean us."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(str(e.get("name", ""))[:80], []).append(float(e.get("dur", 0.0)))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"name": name, "calls": len(durs), "us": round(sum(durs), 1), "mean_us": round(sum(durs) / len(durs), 2)}
            for name, durs in ranked]


def idle_gaps_by_device(events: list[dict], **kw: Any) -> dict[str, Any]:
    """`idle_gaps` of each device's events (a trace's process per device: one device's work
    would hide another's idle time); one device's report as it is."""
    by_pid: dict[Any, list[dict]] = {}
    for e in events:
        by_pid.setdefault(e.get("pid"), []).append(e)
    if len(by_pid) <= 1:
        return idle_gaps(events, **kw)
    return {"per_device": {str(pid): idle_gaps(evs, **kw) for pid, evs in sorted(by_pid.items(), key=lambda kv: str(kv[0]))}}
