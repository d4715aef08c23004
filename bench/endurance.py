"""Endurance: a long mixed workload through the engine, watching memory for leaks.

    python bench/endurance.py --model PATH [--requests 400] [--concurrency 12] [--out DIR]

Requests (engine direct, from an asyncio loop, at most --concurrency in flight) have random
prompt lengths (up to several prefill chunks), random max_tokens and a random kind: plain
sampling, greedy, penalties with top-k/top-p/min-p, logprobs with alternatives, stop strings,
cancelled after some tokens, or cancelled right after submit. Every --sample-every finished
requests the process RSS and the device memory in use are sampled. The first half is the
warm-up; over the second half a least-squares slope says whether memory is flat. At the end
the engine must be idle (no slot, queue place or request left) and every request must have
reached its observer. Writes bench/results/endurance-<date>.json; exits 1 on request errors
or leftover engine state.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench import engine as bench_engine  # noqa: E402
from model.config import KV_DTYPES  # noqa: E402
from model.step_types import SamplingParams  # noqa: E402

log = logging.getLogger("bench.endurance")

KINDS = ("plain", "greedy", "penalties", "logprobs", "stop", "cancel", "cancel_early")
KIND_WEIGHTS = (0.30, 0.10, 0.10, 0.10, 0.15, 0.15, 0.10)


def plan_request(i: int, rng: np.random.Generator, vocab: int, max_context: int, max_prompt: int,
                 max_new: int) -> tuple[str, Any, int | None]:
    """(kind, GenerationRequest, cancel after n tokens / 0 = at once / None)."""
    kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
    max_tokens = int(rng.integers(1, max_new + 1))
    prompt_len = int(rng.integers(1, min(max_prompt, max_context - max_tokens) + 1))
    prompt = common.random_prompt(rng, prompt_len, vocab)
    seed = int(rng.integers(0, 2**31))
    sampling = SamplingParams(temperature=float(rng.uniform(0.5, 1.2)), seed=seed)
    stop: tuple[str, ...] = ()
    logprobs = False
    cancel_after = None
    if kind == "greedy":
        sampling = SamplingParams(temperature=0.0)
    elif kind == "penalties":
        sampling = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                                  presence_penalty=0.5, frequency_penalty=0.3, seed=seed,
                                  logit_bias=((int(rng.integers(vocab)), -5.0),))
    elif kind == "logprobs":
        sampling = SamplingParams(temperature=1.0, top_logprobs=int(rng.integers(0, 6)), seed=seed)
        logprobs = True
    elif kind == "stop":
        stop = ("e", "\n\n")
    elif kind == "cancel":
        cancel_after = int(rng.integers(1, max_tokens + 1))
    elif kind == "cancel_early":
        cancel_after = 0
    req = bench_engine.make_request(f"{kind}-{i}", prompt, max_tokens, seed, logprobs=logprobs, stop=stop,
                                    sampling=sampling, ignore_eos=bool(rng.random() < 0.5))
    return kind, req, cancel_after


def memory_sample(completed: int, t0: float) -> dict[str, Any]:
    dev = common.device_memory()
    return {
        "completed": completed,
        "t_s": round(time.perf_counter() - t0, 2),
        "rss_mib": round(common.rss_mib()["rss_mib"], 2),
        "device_mib": round(dev["mib_in_use"], 3) if dev and "mib_in_use" in dev else None,
    }


def slope_report(samples: list[dict[str, Any]], key: str, tolerance_mib: float) -> dict[str, Any] | None:
    """Least-squares slope of `key` over the second half of the samples (the first is warm-up)."""
    half = [s for s in samples[len(samples) // 2:] if s[key] is not None]
    if len(half) < 3:
        return None
    x = np.array([s["completed"] for s in half], np.float64)
    y = np.array([s[key] for s in half], np.float64)
    slope = float(np.polyfit(x, y, 1)[0])
    growth = float(slope * (x[-1] - x[0]))
    return {
        "mib_per_100_requests": round(slope * 100, 3),
        "growth_over_second_half_mib": round(growth, 3),
        "min_mib": round(float(y.min()), 2),
        "max_mib": round(float(y.max()), 2),
        "tolerance_mib": tolerance_mib,
        "is_flat": bool(growth < tolerance_mib),
    }


async def run_workload(engine, timings: bench_engine.TimingLog, args: argparse.Namespace,
                       max_context: int) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    vocab = engine.tokenizer.vocab_size
    max_prompt = min(args.max_prompt, max_context - 1)
    gate = asyncio.Semaphore(args.concurrency)
    samples: list[dict[str, Any]] = []
    kinds: collections.Counter[str] = collections.Counter()
    finishes: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    tokens = 0
    completed = 0
    t0 = time.perf_counter()
    samples.append(memory_sample(0, t0))

    async def one(i: int) -> None:
        nonlocal tokens, completed
        kind, req, cancel_after = plan_request(i, rng, vocab, max_context, max_prompt, args.max_new_tokens)
        kinds[kind] += 1
        async with gate:
            stream, record = bench_engine.submit(engine, req)
            if stream is None:
                errors.append(f"{req.request_id}: queue full")
                return
            if cancel_after == 0:
                stream.cancel()
                cancel_after = None
            await bench_engine.consume(stream, record, cancel_after=cancel_after)
        finishes[record.finish_reason or "none"] += 1
        if record.error is not None:
            errors.append(f"{req.request_id}: {record.error}")
        tokens += record.num_tokens
        completed += 1
        if completed % args.sample_every == 0:
            samples.append(memory_sample(completed, t0))
            log.info("%d/%d requests, %s", completed, args.requests, samples[-1])

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    if samples[-1]["completed"] != completed:
        samples.append(memory_sample(completed, t0))
    await timings.wait_for("", args.requests)

    # The engine frees slots as it processes cancels and finishes: wait for it to be idle.
    deadline = time.monotonic() + 30
    while True:
        stats = engine.stats()
        idle = stats.slots_busy == 0 and stats.requests_running == 0 and stats.requests_waiting == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    return {
        "wall_s": round(wall, 2),
        "generated_tokens": tokens,
        "tok_s": round(tokens / wall, 1),
        "kinds": dict(kinds),
        "finish_reasons": dict(finishes),
        "errors": errors[:20],
        "num_errors": len(errors),
        "observed_requests": len(timings.items),
        "engine_idle_at_end": idle,
        "engine_stats_at_end": {"slots_busy": stats.slots_busy, "running": stats.requests_running,
                                "waiting": stats.requests_waiting},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="auto: f32 on the CPU (this bench runs native numerics), bf16 on a GPU")
    ap.add_argument("--concurrency", type=int, default=12, help="requests in flight (slots + a queue)")
    ap.add_argument("--max-prompt", type=int, default=1200, help="longest prompt (several prefill chunks)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sample-every", type=int, default=20, help="finished requests between memory samples")
    ap.add_argument("--rss-tolerance-mib", type=float, default=32.0, help="RSS growth over the second half still 'flat'")
    ap.add_argument("--device-tolerance-mib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stamp = common.timestamp()

    config = bench_engine.build_config(args.slots, args.max_context, args.kv_dtype, max_queue=max(64, args.concurrency))
    engine, startup = bench_engine.start_engine(args.model, config)
    timings = bench_engine.TimingLog()
    engine.add_observer(timings)
    engine_info = engine.info()
    max_context = int(engine_info["max_context"])
    try:
        run = asyncio.run(run_workload(engine, timings, args, max_context))
    finally:
        engine.shutdown(60)

    info = common.device_info()
    rss = slope_report(run["samples"], "rss_mib", args.rss_tolerance_mib)
    device = slope_report(run["samples"], "device_mib", args.device_tolerance_mib)
    is_clean = run["num_errors"] == 0 and run["engine_idle_at_end"] and run["observed_requests"] == args.requests
    result = {
        "kind": "endurance",
        "date": stamp,
        "git": common.git_rev(),
        "gpu": info["gpu"],
        "jax": info["jax"],
        "device": info,
        "model": common.model_facts(args.model),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "kv_dtype": engine_info.get("kv_dtype", args.kv_dtype),  # "auto" resolved
        "startup": startup,
        "rss_second_half": rss,
        "device_second_half": device,
        "is_memory_flat": all(r is None or r["is_flat"] for r in (rss, device)) and rss is not None,
        "is_clean": is_clean,
        **run,
    }
    path = common.result_path(args.out, "endurance", stamp)
    common.write_json(path, result)
    print(f"\n{args.requests} requests in {run['wall_s']} s ({run['tok_s']} tok/s generated); "
          f"finish reasons {run['finish_reasons']}; errors {run['num_errors']}")
    print(f"  RSS over the second half: {rss}")
    print(f"  device memory over the second half: {device}")
    print(f"  engine idle at the end: {run['engine_idle_at_end']} {run['engine_stats_at_end']}; "
          f"observer saw {run['observed_requests']}/{args.requests} requests")
    print(f"  memory flat: {result['is_memory_flat']}; clean: {is_clean}")
    print(f"wrote {path}")
    return 0 if is_clean else 1


if __name__ == "__main__":
    sys.exit(main())
