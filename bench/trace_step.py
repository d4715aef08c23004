"""Where a served decode step's device time goes, kernel by kernel.

Builds the engine's own decode program (model/runner.py, sampling included) on a GGUF, times it
at 1 and `--slots` active slots (and the host time spent inside each call of the compiled
program, `call_ms_*`: where it nears the step time, the host's launches are what bound the
loop), then records a few steps with `jax.profiler` and sums the GPU
kernels' durations by name (the trace's device tracks). It also counts, in the optimized HLO,
the copies XLA makes of weight or cache slices (dynamic-slice fusions feeding the kernels),
which are bytes a step moves beyond the weights and KV it must read.

    python3 bench/trace_step.py --model M.gguf [--slots 8] [--max-context 1024] [--position 200]
        [--out DIR]   # DIR gets decode_summary.json and decode_hlo.txt

The engine flags are the server's (`python -m server --help`), defaulting here to --max-context
1024, --kv-dtype bfloat16 and --decode-steps 1, and resolved as the server resolves them (the KV
dtype of "auto", the context capped at the model's, 0 decode steps the engine's own choice);
--max-queue, --timeout, --compile-threads and --no-gc-freeze change nothing here.

With few-rows attention (on unless `--no-few-rows-attention`), where the decode attention has a plan for few busy slots at that
position's context bucket (the Triton kernel from 1024 keys), one busy slot runs the program
built with it (the runner builds it for its steady-state program, the most decode steps per
dispatch; here for `--decode-steps`), and the program planned for all slots is timed at one busy
slot as well (`*_1_active_all_rows_plan`).

`--mosaic-decode-tuning FIELD=VALUE,...`, `--mosaic-offset-decode-tuning ...` (the decode tuning
of the formats with offsets: Q4_K, Q4_1, Q5_K, Q5_1 split) and `--mosaic-prefill-tuning ...` (also
bench/engine.py's) replace fields of the Mosaic GPU matmul's default tunings
(`pallas_kernels.mgpu_tuning`) in this process, for A/B runs of a tuning the engine does not use by default (`even_split=true`,
`fold_offsets=false`); the report records them.

`--decode-steps N` builds the engine's N-step decode program instead of the one-step one
(step_ms stays per decode step; call_ms and the trace's per-"step" figures are per call).

With `--draft-max N` (the server's flag) the speculative decode program is timed and traced
too, with 1, 2 and 4 busy slots and the rows laid out as the runner lays them.

`--prefill T[,T...]` traces the prefill program of a T-token chunk instead (one slot, starting at
`--position`, 0 for a fresh prompt: the engine's prefill step, sampling of the first token
included); DIR then gets prefill<T>_hlo.txt and one report per T in prefill_summary.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from model.runner import prefill_args  # noqa: E402
from model.weights import params_nbytes  # noqa: E402
from scheduler.loader import load_resolved  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402  (the server's flags)


def summarize(log_dir: str, steps: int, top: int = 40) -> dict:
    both = common.trace_events(log_dir)
    if both is None:
        return {"error": f"no trace.json.gz under {log_dir}"}
    events, host_calls = both
    if not events:
        return {"error": "the trace has no device events (no CUPTI?)"}
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(float(e.get("dur", 0.0)))
    host: dict[str, list[float]] = collections.defaultdict(list)
    for e in host_calls:
        host[e["name"]].append(float(e.get("dur", 0.0)))
    total = sum(sum(v) for v in by_name.values())
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e.get("dur", 0.0) for e in events)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    ordered = sorted(events, key=lambda e: e["ts"])
    return {
        "steps": steps,
        "device_busy_us_per_step": total / steps,
        "device_span_us_per_step": (t1 - t0) / steps,
        "kernels_per_step": len(events) / steps,
        "top": [
            {"name": n[:160], "us_per_step": sum(d) / steps, "calls_per_step": len(d) / steps,
             "share": sum(d) / total}
            for n, d in rows[:top]
        ],
        # The host's CUDA calls as the trace names them: graph launches (one per step when the
        # step is one CUDA graph) and host functions. Kernels launched one by one and copies do
        # not show here (the device events show the copies).
        "host_api": [
            {"name": n[:80], "calls_per_step": len(d) / steps, "us_per_step": sum(d) / steps}
            for n, d in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:15]
        ],
        # The first step's kernels in the order they ran, with their microseconds: what sits
        # between the big kernels (the candidates for fusing).
        "sequence": [[e["name"][:60], round(float(e.get("dur", 0.0)), 2)]
                     for e in ordered[: len(events) // steps]],
    }


def print_summary(summ: dict, unit: str) -> None:
    if "error" in summ:
        print("trace:", summ["error"], flush=True)
        return
    print(f"  device busy {summ['device_busy_us_per_step']:.0f} us/{unit} over a span of "
          f"{summ['device_span_us_per_step']:.0f}; {summ['kernels_per_step']:.0f} kernels/{unit}", flush=True)
    for r in summ["top"][:25]:
        print(f"  {r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x {100 * r['share']:5.1f}%  {r['name'][:110]}")
    print(f"  host CUDA calls per {unit}:", "; ".join(
        f"{r['name']} {r['calls_per_step']:.1f}x {r['us_per_step']:.0f} us" for r in summ["host_api"]), flush=True)


def time_and_trace(call, cache, state, steps: int, trace_steps: int):
    """Warms `call` ((cache, state) -> (cache, state, outputs)) up, times `steps` calls back to
    back and traces `trace_steps` more; returns (cache, state, wall seconds per call, host seconds
    inside each call, the trace's `summarize`)."""
    for _ in range(3):
        cache, state, o = call(cache, state)
    jax.block_until_ready(o)
    t, calls = time.perf_counter(), []  # host time inside each call: arguments, launches, any wait
    for _ in range(steps):
        c = time.perf_counter()
        cache, state, o = call(cache, state)
        calls.append(time.perf_counter() - c)
    jax.block_until_ready(o)
    per_call = (time.perf_counter() - t) / steps
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(trace_steps):
            cache, state, o = call(cache, state)
        jax.block_until_ready(o)
        jax.profiler.stop_trace()
        summ = summarize(d, trace_steps)
    return cache, state, per_call, calls, summ


def trace_prefill(args, t: int, m, runner, out) -> dict:
    attend = runner._bucket(args.position + t)
    t0 = time.perf_counter()
    example = runner._example_args("prefill", t)
    prog = runner._jitted("prefill", attend).lower(*example).compile()
    print(f"compiled prefill[{t}] attending {attend} in {time.perf_counter() - t0:.1f} s", flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"prefill{t}_hlo.txt").write_text(prog.as_text())
    rest = jnp.asarray(prefill_args(0, np.arange(t) % 1000, args.position, t, True, runner._samp_words,
                                    runner._free_row, runner._no_tokens))

    def call(cache, state):
        cache, state, _, o = prog(runner.params, cache, state, rest)
        return cache, state, o

    cache, state, per_call, calls, summ = time_and_trace(call, runner._cache, runner._state, args.steps, 3)
    ms = per_call * 1e3
    weights = params_nbytes(m.params)
    report = {"model": m.name, "weights_bytes": weights, "attend": attend, "prefill": t, "position": args.position,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "mosaic_tuning": args.mosaic_tuning,
              "attention_config": args.attention_config,
              "step_ms": ms, "tok_s": t / ms * 1e3,
              "call_ms": {"p50": 1e3 * float(np.median(calls)), "min": 1e3 * min(calls)}}
    print(f"prefill[{t}] at {args.position}: {ms:.2f} ms per chunk = {t / ms * 1e3:.0f} tok/s; host time in the "
          f"call p50 {1e3 * np.median(calls):.2f} ms", flush=True)
    report["trace"] = summ
    print_summary(summ, "chunk")
    runner._cache, runner._state = cache, state
    return report


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", required=True)
    add_engine_arguments(ap, numerics="native")  # the server's engine flags (server --help), with these defaults:
    ap.set_defaults(max_context=1024, kv_dtype="bfloat16", decode_steps=1)
    ap.add_argument("--position", type=int, default=200, help="cache length of the active slots")
    ap.add_argument("--lone-slot", type=int, default=0,
                    help="the busy slot where one is (the runner places a lone request in any free slot)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill", type=lambda v: [int(t) for t in v.split(",")], default=[],
                    help="trace the prefill programs of these chunk sizes (comma list) instead")
    ap.add_argument("--matmul-warps", type=int, default=None,
                    help="a variant: this many warps in the Triton decode matmuls (M <= 64) instead of the default")
    common.add_mosaic_tuning_arguments(ap)
    common.add_attention_config_arguments(ap)
    args = ap.parse_args()
    if not 0 <= args.lone_slot < args.slots:
        ap.error(f"--lone-slot must be a slot, 0 to {args.slots - 1}")
    try:
        args.mosaic_tuning = common.apply_mosaic_tuning_arguments(args)
        args.attention_config = common.apply_attention_config_arguments(args)
    except ValueError as e:
        ap.error(str(e))
    if args.matmul_warps:
        import dataclasses

        from pallas_kernels import matmul_triton

        default = matmul_triton.default_tuning

        def patched(fmt, m, n, k, x_dtype):
            t = default(fmt, m, n, k, x_dtype)
            return dataclasses.replace(t, num_warps=args.matmul_warps) if m <= 64 else t

        matmul_triton.default_tuning = patched
    out = pathlib.Path(args.out) if args.out else None

    # as the server resolves it: the KV dtype of "auto", the context capped at the model's
    m, ecfg = load_resolved(args.model, engine_config_from_args(args))
    args.decode_steps = ecfg.decode_steps()  # 0: the engine's auto choice
    runner = m.make_runner(ecfg)
    if args.prefill:
        reports = [trace_prefill(args, t, m, runner, out) for t in args.prefill]
        if out:
            (out / "prefill_summary.json").write_text(json.dumps(reports, indent=1))
        return
    attend = runner._bucket(args.position + 1)
    few_limit = runner.kernels.decode_few_rows_limit(attend)

    def build(few_rows: bool):
        t0 = time.perf_counter()
        prog = runner._jitted("decode", attend, args.decode_steps, few_rows).lower(
            *runner._example_args("decode", args.slots, args.decode_steps)).compile()
        print(f"compiled decode[{args.slots}] x{args.decode_steps} attending {attend}"
              f"{' for few busy rows' if few_rows else ''} in {time.perf_counter() - t0:.1f} s", flush=True)
        return prog

    prog = build(False)
    # the program the runner runs with few slots busy, where the attention has a plan for them
    few_prog = build(True) if few_limit else None
    hlo = prog.as_text()
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_hlo.txt").write_text(hlo)
    ds = [ln for ln in hlo.splitlines() if "dynamic-slice" in ln and "fusion" in ln and "=" in ln]
    # (XLA's command buffers, CUDA graphs, do not show in this text: the graph launches in the
    # trace's host CUDA calls below do)
    print(f"HLO: {len(ds)} lines with dynamic-slice fusions, {hlo.count('custom-call(')} custom calls; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    for ln in ds[:30]:
        print("   ", ln.strip()[:220])

    weights = params_nbytes(m.params)
    report = {"model": m.name, "weights_bytes": weights, "attend": attend, "slots": args.slots,
              "position": args.position, "decode_steps": args.decode_steps, "few_rows_limit": few_limit,
              "kv_write_in_attention": runner.kernels.decode_writes_cache, "lone_slot": args.lone_slot,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "mosaic_tuning": args.mosaic_tuning,
              "attention_config": args.attention_config}
    # (busy slots, the program, the report's key): the runner's choice at 1 and all slots busy;
    # where it runs the few-rows program for one, the all-rows program at one busy slot as well
    runs = [(n, few_prog if few_prog is not None and n <= few_limit else prog, f"{n}_active")
            for n in sorted({1, args.slots})]
    if few_prog is not None:
        runs.append((1, prog, "1_active_all_rows_plan"))
    for n_active, program, key in runs:
        active = np.zeros((args.slots,), bool)
        active[:n_active] = True
        if n_active == 1:
            active = np.arange(args.slots) == args.lone_slot
        runner._state.positions = jnp.full((args.slots,), args.position, jnp.int32)
        act = jnp.asarray(active)

        def call(cache, state, program=program):
            # a one-step program takes the allowed tokens too (constrained decoding): all free here
            extra = (runner._free_rows,) if args.decode_steps == 1 else ()
            return program(runner.params, cache, state, runner._samp, act, *extra)

        cache, state, per_call, calls, summ = time_and_trace(call, runner._cache, runner._state, args.steps, 5)
        ms = per_call / args.decode_steps * 1e3  # per decode step
        report[f"step_ms_{key}"] = ms
        report[f"call_ms_{key}"] = {"p50": 1e3 * float(np.median(calls)), "min": 1e3 * min(calls)}
        print(f"{key}: {ms:.2f} ms per step = {n_active / ms * 1e3:.0f} tok/s; weights alone at "
              f"3.5 TB/s: {weights / 3.5e9:.2f} ms; host time in the call ({args.decode_steps} steps) p50 "
              f"{1e3 * np.median(calls):.2f} ms",
              flush=True)
        report[f"trace_{key}"] = summ
        print_summary(summ, "step" if args.decode_steps == 1 else f"call ({args.decode_steps} steps)")
        runner._cache, runner._state = cache, state
    if ecfg.draft_max > 0:
        trace_speculative(args, ecfg.draft_max, runner, report)
    if out:
        (out / "decode_summary.json").write_text(json.dumps(report, indent=1))


def trace_speculative(args, draft_max: int, runner, report: dict) -> None:
    """The speculative decode program (`--draft-max`), timed with 1, 2 and 4 busy slots laid
    out as the runner lays them (each busy slot a row, the spare rows its drafts): a step's cost
    does not depend on how many drafts are kept (the program's shape is fixed), so the ratio to
    the plain step's time is the most a step may cost in exchange for its accepted tokens."""
    from model import speculative

    # the positions advance by up to every row per step: the bucket must hold all the calls'
    spread = args.slots * args.decode_steps * (args.steps + 10)
    attend = runner._bucket(args.position + spread)
    t0 = time.perf_counter()
    prog = runner._jitted("spec", attend, args.decode_steps).lower(*runner._example_args("spec", args.slots)).compile()
    print(f"compiled spec[{args.slots}] x{args.decode_steps} attending {attend} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    report["spec_attend"] = attend
    for n_busy in (1, 2, 4):
        if n_busy >= args.slots:
            continue
        layout = speculative.layout_rows(args.slots, tuple(range(n_busy)), (draft_max,) * n_busy)
        if layout is None:
            continue
        runner._state.positions = jnp.full((args.slots,), args.position, jnp.int32)
        dev = jnp.asarray(layout)

        def call(cache, state, dev=dev):
            return prog(runner.params, cache, state, runner._samp, dev)

        cache, state, per_call, calls, summ = time_and_trace(call, runner._cache, runner._state, args.steps, 5)
        ms = per_call / args.decode_steps * 1e3
        key = f"spec_{n_busy}_active"
        report[f"step_ms_{key}"] = ms
        report[f"rows_{key}"] = int(layout[2].sum())
        report[f"call_ms_{key}"] = {"p50": 1e3 * float(np.median(calls)), "min": 1e3 * min(calls)}
        print(f"{key} ({int(layout[2].sum())} rows, at most {draft_max} drafts each): {ms:.2f} ms per step; host "
              f"time in the call p50 {1e3 * np.median(calls):.2f} ms", flush=True)
        report[f"trace_{key}"] = summ
        print_summary(summ, "step" if args.decode_steps == 1 else f"call ({args.decode_steps} steps)")
        runner._cache, runner._state = cache, state


if __name__ == "__main__":
    main()
