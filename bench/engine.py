"""Engine-direct benchmark: the scheduler and model runner without HTTP.

    python bench/engine.py --model PATH [--slots 8] [--max-context 4096] [--out DIR]

Measures, on one engine built by `scheduler.loader.build_engine` and driven from an asyncio
loop (the way `server/` drives it):

- start-up (load + compile) with JAX's persistent compilation cache: a child process first
  starts the engine on an empty cache ("cold"), then this process starts it again ("warm");
- prefill tok/s of a 512-token prompt alone (prompt length / time to first token);
- decode tok/s with 1, 4, 8 (16, 32 when --slots allows) concurrent requests, in the steady
  state: between the last request's first token and the first request's last token;
- time to first token of a 128-token prompt joining 3 running streams;
- inter-token latency p50/p99 from the engine's RequestTiming observer;
- device memory (jax memory_stats) and process RSS; the device copy bandwidth and from it the
  weight-read floor: the decode rate at which one step reads every weight at that bandwidth;
- with --constrained, decode under constrained decoding (scheduler/grammar.py): 1 and 8 users
  each held to a regex, and 1 such user beside 7 free ones (each group's own figures), under
  each of CONSTRAINTS: `[a-z ]*`, whose masks llguidance's lexer mostly finds cached (about 11 us
  a mask on this CPU, SmolLM2's 49k vocabulary), and `[a-z ]{100000}`, whose counted repetition
  makes every position a new lexer state (about 700 us a mask): the usual cost and the worst
  seen. Neither ends a stream early: the second is longer than any run, and the first, which
  may end anywhere, loses its end-of-generation tokens to ignore_eos (the engine's
  `_allowed_row`); each run's `complete` says whether every stream gave all its tokens.

The engine flags are the server's own, with its defaults (`python -m server --help`; e.g.
--kv-dtype auto: bf16 on a GPU). Every request has ignore_eos and a fixed max_tokens, so lengths
are controlled. Writes
bench/results/engine-<date>.json and a PNG plot beside it (needs matplotlib).
`--plot-only RESULT.json [...]` redraws the plot from saved results (several runs, e.g. --slots
8 and --slots 32, become one figure).
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from model.config import EngineConfig, prefill_chunks_for  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402  (the server's flags)
from model.step_types import SamplingParams  # noqa: E402
from scheduler.types import Constraint, GenerationRequest, QueueFullError  # noqa: E402

log = logging.getLogger("bench.engine")

USER_COUNTS = (1, 4, 8, 16, 32)


# ---------------------------------------------------------------------------------------------
# engine set-up (also used by bench/http.py and bench/endurance.py)


def build_config(slots: int, max_context: int, kv_dtype: str = "auto", prefill_budget: int = 512,
                 max_queue: int = 64) -> EngineConfig:
    """An EngineConfig with the server's defaults but these, and native numerics (EngineConfig's
    default; bench/endurance.py and bench/serving_overhead.py; this script's own runs take every
    server flag, `config_of`)."""
    return EngineConfig(num_slots=slots, max_context=max_context, kv_dtype=kv_dtype, prefill_budget=prefill_budget,
                        prefill_chunks=prefill_chunks_for(prefill_budget, None), max_queue=max_queue)


def start_engine(model_path: str | os.PathLike[str], config: EngineConfig, profile: cProfile.Profile | None = None):
    """Builds, starts and waits for the engine; returns (engine, start-up seconds). With `profile`,
    the engine thread's loop runs under that profiler (host work per step, by function)."""
    from scheduler.loader import build_engine  # imports JAX

    t0 = time.perf_counter()
    engine = build_engine(model_path, config)
    t_load = time.perf_counter() - t0
    if profile is not None:
        loop = engine._run
        engine._run = lambda: profile.runcall(loop)
    engine.start()
    if not engine.wait_ready():
        raise RuntimeError(f"the engine did not become ready: {engine.stats().error}")
    total = time.perf_counter() - t0
    return engine, {"load_s": round(t_load, 2), "compile_s": round(total - t_load, 2), "total_s": round(total, 2)}


class TimingLog:
    """Engine observer: keeps every RequestTiming (list.append is atomic; called on the engine thread)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __call__(self, timing: Any) -> None:
        self.items.append(timing)

    def itl(self, prefix: str) -> list[float]:
        return [g for t in self.items if t.request_id.startswith(prefix) for g in t.itl_s]

    async def wait_for(self, prefix: str, count: int, timeout: float = 30.0) -> None:
        """The engine pushes a request's final event before it calls observers: wait for them."""
        deadline = time.monotonic() + timeout
        while sum(t.request_id.startswith(prefix) for t in self.items) < count:
            if time.monotonic() > deadline:
                log.warning("only some timings of %s* arrived", prefix)
                return
            await asyncio.sleep(0.001)


def make_request(
    label: str, prompt: tuple[int, ...], max_tokens: int, seed: int, *, logprobs: bool = False,
    stop: tuple[str, ...] = (), sampling: SamplingParams | None = None, ignore_eos: bool = True,
    cache_prompt: bool = True, prompt_logprobs: int | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=label, prompt_tokens=prompt, max_tokens=max_tokens,
        sampling=sampling or SamplingParams(temperature=1.0, seed=seed), stop=stop, ignore_eos=ignore_eos,
        logprobs=logprobs, cache_prompt=cache_prompt, prompt_logprobs=prompt_logprobs,
    )


def submit(engine, request: GenerationRequest):
    """Event-loop thread: (stream or None when the queue is full, its record)."""
    record = common.StreamRecord(request.request_id, time.perf_counter())
    try:
        return engine.submit(request), record
    except QueueFullError:
        record.rejected = True
        return None, record


async def consume(stream, record: common.StreamRecord, cancel_after: int | None = None,
                  progress: asyncio.Event | None = None) -> common.StreamRecord:
    """Reads a stream to its end, stamping token arrivals; cancels after `cancel_after` tokens."""
    if stream is None:
        return record
    async for event in stream:
        if event.token_ids:
            record.arrivals.append((time.perf_counter(), len(event.token_ids)))
            record.tokens.extend(event.token_ids)
            record.logprobs.extend(event.logprobs)
            if progress is not None:
                progress.set()
            if cancel_after is not None and record.num_tokens >= cancel_after:
                stream.cancel()
                cancel_after = None
        if event.finish_reason is not None:
            record.finish_reason = event.finish_reason
            record.cached_tokens = event.cached_tokens
            if event.finish_reason == "error":
                record.error = event.error or "error"
    return record


async def run_batch(engine, requests: Sequence[GenerationRequest]) -> list[common.StreamRecord]:
    """Submits all requests at once and reads every stream to its end."""
    pairs = [submit(engine, r) for r in requests]
    return list(await asyncio.gather(*(consume(s, rec) for s, rec in pairs)))


# ---------------------------------------------------------------------------------------------
# measurements


async def measure_decode(engine, timings: TimingLog, users: int, prompt_len: int, decode_tokens: int,
                         rng: np.random.Generator, label: str = "decode", prompt_logprobs: int | None = None,
                         first: SamplingParams | None = None) -> dict[str, Any]:
    """`users` streams decoding together; with `prompt_logprobs` their prompts were prefilled by
    the scoring programs (PrefillChunk.score), so the decode steps follow those programs; with
    `first`, the first stream samples with it (the others as the plain runs)."""
    vocab = engine.tokenizer.vocab_size
    reqs = [
        make_request(f"{label}-{users}-{i}", common.random_prompt(rng, prompt_len, vocab), decode_tokens, seed=i,
                     prompt_logprobs=prompt_logprobs, sampling=first if i == 0 else None)
        for i in range(users)
    ]
    records = await run_batch(engine, reqs)
    summary = common.summarize(records)
    await timings.wait_for(f"{label}-{users}-", users)
    itl = timings.itl(f"{label}-{users}-")
    summary["engine_itl_ms_p50"] = common.ms(common.percentile(itl, 50))
    summary["engine_itl_ms_p99"] = common.ms(common.percentile(itl, 99))
    # the time per output token: with several decode steps per dispatch, tokens reach a stream
    # that many at a time, so the gaps have two modes (about 0, and a dispatch) and the p50
    # falls between them, where it moves with small shifts of either
    summary["engine_itl_ms_mean"] = common.ms(float(np.mean(itl))) if itl else None
    return summary


# one of llama.cpp's samplers, which the lean decode program leaves out (model/runner.py's _decode_apart)
DRY_SAMPLING = SamplingParams(temperature=1.0, seed=0, dry_multiplier=0.8)

# (name, constraint); neither completes within a run (module docstring)
CONSTRAINTS = (("cached", Constraint("regex", "[a-z ]*", "bench")),
               ("counted", Constraint("regex", "[a-z ]{100000}", "bench")))


async def measure_constrained(engine, timings: TimingLog, users: int, constrained: int, prompt_len: int,
                              decode_tokens: int, rng: np.random.Generator, name: str,
                              constraint: Constraint) -> dict[str, Any]:
    """Decode of `users` streams, the first `constrained` of them held to `constraint`."""
    vocab = engine.tokenizer.vocab_size
    label = f"constrained-{name}-{constrained}of{users}"
    reqs = []
    for i in range(users):
        req = make_request(f"{label}-{i}", common.random_prompt(rng, prompt_len, vocab), decode_tokens, seed=i)
        reqs.append(dataclasses.replace(req, constraint=constraint) if i < constrained else req)
    records = await run_batch(engine, reqs)
    await timings.wait_for(f"{label}-", users)
    out = {"constrained": common.summarize(records[:constrained])}
    if constrained < users:
        out["free"] = common.summarize(records[constrained:])
    out["all"] = common.summarize(records)
    out["complete"] = out["all"].get("tokens") == users * decode_tokens  # no stream ended early
    if not out["complete"]:
        log.warning("%s: %s of %d tokens: a stream ended early, so fewer streams ran than the label says",
                    label, out["all"].get("tokens"), users * decode_tokens)
    return out


async def measure_prefill(engine, prompt_len: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """A prompt alone, max_tokens 1: prompt_len / TTFT. The first run is a warm-up."""
    vocab = engine.tokenizer.vocab_size
    ttfts = []
    for i in range(repeats + 1):
        req = make_request(f"prefill-{i}", common.random_prompt(rng, prompt_len, vocab), 1, seed=i)
        (record,) = await run_batch(engine, [req])
        if record.ttft is None:
            raise RuntimeError(f"prefill request ended without a token: {record.finish_reason} {record.error}")
        if i:
            ttfts.append(record.ttft)
    median = statistics.median(ttfts)
    return {
        "prompt_tokens": prompt_len,
        "tok_s": round(prompt_len / median, 1),
        "ttft_ms_p50": common.ms(median),
        "ttft_ms_min": common.ms(min(ttfts)),
        "repeats": repeats,
    }


async def measure_join(engine, background: int, prompt_len: int, repeats: int, rng: np.random.Generator,
                       max_context: int) -> dict[str, Any]:
    """TTFT of a prompt submitted while `background` streams decode."""
    vocab = engine.tokenizer.vocab_size
    progress = asyncio.Event()  # set by every background token
    records, tasks = [], []
    for i in range(background):
        req = make_request(f"bg-{i}", common.random_prompt(rng, prompt_len, vocab), max_context - prompt_len, seed=i)
        stream, rec = submit(engine, req)
        records.append((stream, rec))
        tasks.append(asyncio.create_task(consume(stream, rec, progress=progress)))

    async def decoding(min_tokens: int) -> None:
        """Waits until every background stream has `min_tokens` tokens."""
        while any(rec.num_tokens < min_tokens for _, rec in records):
            if any(t.done() for t in tasks):
                raise RuntimeError("a background stream ended early")
            progress.clear()
            await asyncio.wait_for(progress.wait(), timeout=600)

    ttfts = []
    await decoding(4)
    for j in range(repeats):
        req = make_request(f"join-{j}", common.random_prompt(rng, prompt_len, vocab), 1, seed=100 + j)
        (rec,) = await run_batch(engine, [req])
        if rec.ttft is None:
            raise RuntimeError(f"join request ended without a token: {rec.finish_reason} {rec.error}")
        ttfts.append(rec.ttft)
        await decoding(max(r.num_tokens for _, r in records) + 2)  # a few plain decode steps between joins
    for stream, _ in records:
        stream.cancel()
    await asyncio.gather(*tasks)
    return {
        "background_streams": background,
        "prompt_tokens": prompt_len,
        "ttft_ms_p50": common.ms(statistics.median(ttfts)),
        "ttft_ms_max": common.ms(max(ttfts)),
        "repeats": repeats,
    }


async def measure_chat_turn(engine, history_len: int, turn_len: int, repeats: int,
                            rng: np.random.Generator, *, shared: bool = False) -> dict[str, Any]:
    """A chat's next turn: a history of `history_len` tokens is sent (turn 1, max_tokens 1), then
    the history plus `turn_len` more (turn 2), alone, twice: with the prompt cache on (the
    history's whole chunks reused) and then off for the request (`cache_prompt`: the whole prompt
    prefilled; second, since what it prefills whole would be reused by a warm turn after it).
    TTFT of turn 2 each way, and whether the two first tokens agree with their logprobs and top 5
    alternatives bit for bit (a random-weight model's greedy token alone says little).
    `shared`: a shared system prompt instead; turn 1 keeps decoding in its slot while the two
    turn 2 requests run, so the warm one gets the history copied into another slot."""
    vocab = engine.tokenizer.vocab_size
    greedy = SamplingParams(temperature=0.0, top_logprobs=min(5, engine.info()["max_top_logprobs"]))
    cold, warm, cached, agree = [], [], [], 0
    for i in range(repeats + 1):  # the first round: a warm-up
        history = common.random_prompt(rng, history_len, vocab)
        turn2 = history + common.random_prompt(rng, turn_len, vocab)
        first = make_request(f"chat-{i}-1", history, engine.info()["max_context"] - history_len if shared else 1,
                             seed=i, sampling=greedy)
        stream, record = submit(engine, first)
        if stream is None:
            raise RuntimeError("the engine refused a chat's first turn (queue full)")
        running = asyncio.create_task(consume(stream, record))
        if shared:
            while record.num_tokens < 2:  # decoding: its prompt's chunks were dispatched steps ago
                await asyncio.sleep(0.001)
        else:
            await running
        firsts = {}
        for reuse in (True, False):
            req = make_request(f"chat-{i}-2-{'warm' if reuse else 'cold'}", turn2, 1, seed=i, sampling=greedy,
                               cache_prompt=reuse, logprobs=True)
            (rec,) = await run_batch(engine, [req])
            if rec.ttft is None:
                raise RuntimeError(f"chat turn ended without a token: {rec.finish_reason} {rec.error}")
            firsts[reuse] = rec
        if shared:
            stream.cancel()
        await running
        if i:
            cold.append(firsts[False].ttft)
            warm.append(firsts[True].ttft)
            cached.append(firsts[True].cached_tokens)
            agree += firsts[True].logprobs == firsts[False].logprobs != []
    return {
        "history_tokens": history_len,
        "turn_tokens": turn_len,
        "cached_tokens": sorted(set(cached)),
        "ttft_ms_cold_p50": common.ms(statistics.median(cold)),
        "ttft_ms_warm_p50": common.ms(statistics.median(warm)),
        "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
        "same_first_token": f"{agree}/{repeats}",  # with its logprob and top 5, bit for bit
        "repeats": repeats,
    }


async def run_suite(engine, timings: TimingLog, args: argparse.Namespace, max_context: int) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    # decode runs after each plain one: prompts through the scoring programs; one DRY stream
    variants = [(name, kwargs) for name, on, kwargs in (("scored", args.scored_decode, {"prompt_logprobs": 0}),
                                                        ("dry", args.dry_decode, {"first": DRY_SAMPLING})) if on]
    rngs = {name: np.random.default_rng(args.seed + i) for i, name in enumerate(("scored", "dry"), 1)}
    await run_batch(engine, [make_request("warmup", common.random_prompt(rng, 64, engine.tokenizer.vocab_size), 8, 0)])
    out: dict[str, Any] = {}
    if args.prefill_len + 1 <= max_context:
        out["prefill"] = await measure_prefill(engine, args.prefill_len, args.repeats, rng)
        log.info("prefill %d: %s", args.prefill_len, out["prefill"])
    users = [u for u in USER_COUNTS if u <= engine.info()["num_slots"]]
    out["decode"] = {}
    for u in users:
        out["decode"][str(u)] = await measure_decode(engine, timings, u, args.prompt_len, args.decode_tokens, rng)
        log.info("decode x%d: %s", u, out["decode"][str(u)])
        for name, kwargs in variants:  # alternated with the plain runs, prompts of their own (the others' unchanged)
            out.setdefault(f"decode_{name}", {})[str(u)] = await measure_decode(
                engine, timings, u, args.prompt_len, args.decode_tokens, rngs[name], label=name, **kwargs)
            log.info("decode x%d (%s): %s", u, name, out[f"decode_{name}"][str(u)])
    out["join"] = await measure_join(engine, 3, args.join_len, args.repeats, rng, max_context)
    log.info("join: %s", out["join"])
    if args.constrained:
        out["constrained"] = {}
        for name, constraint in CONSTRAINTS:
            runs = out["constrained"][name] = {"constraint": f"{constraint.kind} {constraint.source}"}
            for u, c in ((1, 1), (8, 8), (8, 1)):
                if u <= engine.info()["num_slots"]:
                    runs[f"{c}of{u}"] = await measure_constrained(
                        engine, timings, u, c, args.prompt_len, args.decode_tokens, rng, name, constraint)
                    log.info("constrained (%s) %d of %d: %s", name, c, u, runs[f"{c}of{u}"])
    history = args.chat_history_len or max_context // 2 + args.chat_turn_len
    if engine.info().get("prompt_cache") and history + args.chat_turn_len + 1 <= max_context:
        out["chat_turn"] = await measure_chat_turn(engine, history, args.chat_turn_len, args.repeats, rng)
        log.info("chat turn: %s", out["chat_turn"])
        out["shared_prompt"] = await measure_chat_turn(engine, history, args.chat_turn_len, args.repeats, rng,
                                                       shared=True)
        log.info("shared prompt: %s", out["shared_prompt"])
    trace_users = trace_user_counts(args, users)
    if trace_users:
        out["decode_traces"] = {}
        for u in trace_users:
            out["decode_traces"][str(u)] = await trace_decode(engine, timings, u, args, rng)
            log.info("decode trace x%d: %s", u, out["decode_traces"][str(u)])
        out["decode_trace"] = out["decode_traces"][str(trace_users[-1])]  # the most users' (earlier files' key)
    if args.trace_constrained:
        out["constrained_traces"] = {}
        for name, constraint in CONSTRAINTS:
            trace = {"constraint": name, **await trace_decode(engine, timings, 1, args, rng, constraint)}
            out["constrained_traces"][name] = trace
            log.info("constrained trace (%s) x1: %s", name, trace)
        out["constrained_trace"] = out["constrained_traces"][CONSTRAINTS[0][0]]  # earlier files' key
    if args.trace_prefill and "prefill" in out:
        out["prefill_trace"] = await trace_prefill(engine, args.prefill_len, args.repeats, rng)
        log.info("prefill trace: %s", json.dumps(out["prefill_trace"])[:4000])
    return out


def trace_user_counts(args: argparse.Namespace, users: list[int]) -> list[int]:
    """The user counts whose decode runs are traced: --trace-users, or the most users with
    --trace-decode alone, or none."""
    listed = getattr(args, "trace_users", None)
    if listed:
        return sorted({int(u) for u in listed.split(",")})  # each from 1 to --slots (checked in main)
    return [users[-1]] if getattr(args, "trace_decode", False) else []


async def trace_decode(engine, timings: TimingLog, users: int, args: argparse.Namespace,
                       rng: np.random.Generator, constraint: Constraint | None = None) -> dict[str, Any]:
    """One more decode run of `users` streams (prompts included; each held to `constraint` where
    given) under the JAX profiler, after the measured ones: how much of the device's span is idle
    between the engine's programs, and where (`common.idle_gaps`), and the kernels that kept it
    busy longest (`common.busiest_kernels`). The idle share is what the engine's host side leaves
    on the table."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            if constraint is None:
                summary = await measure_decode(engine, timings, users, args.prompt_len, args.decode_tokens, rng,
                                               label="traced")  # its own request ids: its own timings
            else:
                summary = (await measure_constrained(engine, timings, users, users, args.prompt_len,
                                                     args.decode_tokens, rng, "traced", constraint))["all"]
        finally:
            jax.profiler.stop_trace()
        events = common.device_trace_events(d)
    if not events:
        return {"users": users, "steady_tok_s_traced": summary.get("steady_tok_s"),
                "error": "no device events in the trace"}
    return {"users": users, "tokens": summary.get("tokens"), "steady_tok_s_traced": summary.get("steady_tok_s"),
            **common.idle_gaps_by_device(events), "busiest": common.busiest_kernels(events)}


async def trace_prefill(engine, prompt_len: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """`repeats` more lone prompts (max_tokens 1, as measure_prefill's) under the JAX profiler,
    each laid out on the trace's clock from its submit to its first token's arrival
    (`common.request_timeline`): where a prompt's TTFT goes beyond its programs' device time."""
    import jax

    vocab = engine.tokenizer.vocab_size
    marks = []  # (trace annotation name, perf_counter inside it, the request's record)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for i in range(repeats):
                req = make_request(f"traced-prefill-{i}", common.random_prompt(rng, prompt_len, vocab), 1, seed=i)
                name = f"bench.mark.{i}"
                with jax.profiler.TraceAnnotation(name):
                    mark = time.perf_counter()
                (record,) = await run_batch(engine, [req])
                marks.append((name, mark, record))
                await asyncio.sleep(0.02)  # the requests apart on the timeline
        finally:
            jax.profiler.stop_trace()
        trace = common.read_trace(d)
    if trace is None:
        return {"error": "no trace file"}
    at = {e["name"]: e["ts"] for e in trace["host"] if str(e.get("name", "")).startswith("bench.mark.")}
    runs = []
    for name, mark, record in marks:
        if name not in at or not record.arrivals:
            runs.append({"error": f"{name}: no mark in the trace or no token"})
            continue
        to_trace = at[name] - mark * 1e6  # perf_counter seconds -> the trace's microseconds
        runs.append(common.request_timeline(trace, record.submitted * 1e6 + to_trace,
                                            record.arrivals[0][0] * 1e6 + to_trace))
    return {"prompt_tokens": prompt_len, "runs": runs}


# ---------------------------------------------------------------------------------------------
# start-up in a child process (cold cache) and the main run


def config_of(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig `python -m server` builds from the same engine flags (they are the
    server's own, `add_engine_arguments`): the run and its cold-start child alike."""
    return engine_config_from_args(args)


def cold_start_argv(args: argparse.Namespace, cache_dir: str) -> list[str]:
    """The cold-start child's flags: this run's own (`args.argv`), then --startup-only into
    `cache_dir` (the last --cache-dir wins)."""
    return [*args.argv, "--startup-only", "--cache-dir", cache_dir]


def cold_start_in_child(args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """Start-up in a child process on `cache_dir` (`cold_start_argv`)."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *cold_start_argv(args, cache_dir)]
    log.info("cold start in a child process: %s", " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=common.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the cold-start child failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def startup_only(args: argparse.Namespace) -> int:
    common.enable_compilation_cache(args.cache_dir)
    entries = len(os.listdir(args.cache_dir))
    engine, startup = start_engine(args.model, config_of(args))
    startup["cache_entries_before"] = entries
    startup["cache_entries_after"] = len(os.listdir(args.cache_dir))
    engine.shutdown(60)
    print(json.dumps(startup))
    return 0


def decode_rates(runs: dict[str, Any]) -> dict[str, Any]:
    """tok/s per user count of decode runs (`measure_decode`): the steady window's, else the whole run's."""
    return {u: (d.get("steady_tok_s") or d.get("tok_s")) for u, d in runs.items()}


def main_run(args: argparse.Namespace) -> int:
    stamp = common.timestamp()
    cache_dir = str(args.cache_dir) if args.cache_dir else tempfile.mkdtemp(prefix="pallas-serve-jax-cache-")
    os.makedirs(cache_dir, exist_ok=True)
    try:
        cold = None if args.no_cold_start else cold_start_in_child(args, cache_dir)
        common.enable_compilation_cache(cache_dir)
        # counted before the copy test compiles its own program into the cache: a fresh cache
        # (--no-cold-start without --cache-dir) is a cold start of the engine, not a warm one
        entries = len(os.listdir(cache_dir))
        info = common.device_info()
        copy_bytes = (args.copy_mib or (4096 if info["platform"] != "cpu" else 256)) * 2**20
        bandwidth = common.copy_bandwidth_gb_s(copy_bytes)
        log.info("device %s, copy bandwidth %.1f GB/s", info["device_kind"], bandwidth)
        config = config_of(args)
        profile = cProfile.Profile() if getattr(args, "profile_engine", False) else None
        engine, startup = start_engine(args.model, config, profile)
        startup["cache_entries_before"] = entries
        timings = TimingLog()
        engine.add_observer(timings)
        engine_info = engine.info()
        memory_ready = {"device": common.device_memory(), **common.rss_mib()}
        gc_ready = common.full_collection()
        try:
            suite = asyncio.run(run_suite(engine, timings, args, int(engine_info["max_context"])))
        finally:
            memory_end = {"device": common.device_memory(), **common.rss_mib()}
            engine.shutdown(60)
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)

    weight_bytes = common.weight_bytes_per_decode(args.model, engine_info.get("split_formats", ()))
    floor = bandwidth * 1e9 / weight_bytes
    decode = suite["decode"]
    decode_tok_s = decode_rates(decode)
    itl_users = str(min(8, max(int(u) for u in decode)))
    if cold is not None:
        startup_s = {"cold": cold["total_s"], "warm": startup["total_s"]}
    else:
        startup_s = {"warm" if startup["cache_entries_before"] else "cold": startup["total_s"]}
    result = {
        "kind": "engine",
        "date": stamp,
        "git": common.git_rev(),
        "gpu": info["gpu"],
        "jax": info["jax"],
        "device": info,
        "model": {**common.model_facts(args.model), "arch": engine_info.get("arch"),
                  "engine_name": engine_info.get("model")},
        "engine_config": {"slots": config.num_slots, "max_context": int(engine_info["max_context"]),
                          "kv_dtype": engine_info.get("kv_dtype", config.kv_dtype),  # "auto" resolved
                          "prefill_budget": config.prefill_budget,
                          "prefill_chunks": list(config.prefill_chunks), "kernels": engine_info.get("kernels"),
                          "decode_steps": config.decode_steps(),
                          "dispatch_ahead": config.dispatch_ahead,
                          "unroll_decode_layers": config.unroll_decode_layers,
                          "compile_threads": config.compile_threads,  # 0: auto
                          "few_rows_attention": config.few_rows_attention, "prompt_cache": config.prompt_cache,
                          "separate_kv_write": config.separate_kv_write, "gather_x": config.gather_x,
                          "ordered_values": config.ordered_values,
                          "ordered_value_matrices": engine_info.get("ordered_values"),
                          "gated_ffn": config.gated_ffn, "gated_ffn_matrices": engine_info.get("gated_ffn"),
                          "reuse_kernel_lowering": config.reuse_kernel_lowering,
                          "prefill_cuda_graphs": config.prefill_cuda_graphs, "gc_freeze": config.gc_freeze,
                          "host_outputs": config.host_outputs,
                          "split_q4_k": config.split_q4_k, "split_q5_k": config.split_q5_k,
                          "split_q6_k": config.split_q6_k, "q6_k_split_bits": config.q6_k_split_bits,
                          "split_legacy": config.split_legacy,
                          "split_formats": engine_info.get("split_formats"),
                          "tensor_parallel": config.tensor_parallel,
                          "mosaic_tuning": args.mosaic_tuning, "attention_config": args.attention_config},
        "settings": {"prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
                     "prefill_len": args.prefill_len, "join_len": args.join_len, "repeats": args.repeats,
                     "sampling": "temperature 1.0, seeded; ignore_eos"},
        "decode_tok_s": decode_tok_s,
        "decode_scored_tok_s": decode_rates(suite.get("decode_scored", {})) or None,
        "decode_dry_tok_s": decode_rates(suite.get("decode_dry", {})) or None,
        "prefill_tok_s": {str(args.prefill_len): suite["prefill"]["tok_s"]} if "prefill" in suite else {},
        "ttft_ms_join3": suite["join"]["ttft_ms_p50"],
        "chat_turn": suite.get("chat_turn"),  # the prompt cache: a chat's next turn, cold and warm
        "shared_prompt": suite.get("shared_prompt"),  # the same with the history in a busy slot (copied)
        "itl_ms_p50": decode[itl_users]["engine_itl_ms_p50"],
        "itl_ms_p99": decode[itl_users]["engine_itl_ms_p99"],
        "itl_ms_mean": decode[itl_users].get("engine_itl_ms_mean"),
        "itl_users": int(itl_users),
        "hbm_floor_tok_s": round(floor, 1),
        "decode_1_fraction_of_floor": round(decode_tok_s["1"] / floor, 3) if decode_tok_s.get("1") else None,
        "copy_bandwidth_gb_s": round(bandwidth, 1),
        "weight_bytes_per_step": weight_bytes,
        "startup_s": startup_s,
        "startup": {"cold": cold, "this_process": startup},
        "memory": {"after_ready": memory_ready, "after_suite": memory_end},
        "gc_after_ready": gc_ready,
        "details": suite,
        "llama_cpp_h200": common.llama_cpp_anchor(engine_info.get("model")),
    }
    path = common.result_path(args.out, "engine", stamp)
    common.write_json(path, result)
    if profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        path.with_name(path.stem + "-profile.txt").write_text(text.getvalue())
    print_summary(result)
    print(f"wrote {path}")
    plot([result, *[json.loads(pathlib.Path(p).read_text()) for p in args.plot_with]], path.with_suffix(".png"))
    return 0


def print_summary(r: dict[str, Any]) -> None:
    print(f"\n{r['model']['name']} on {r['device']['device_kind']} (jax {r['jax']}), "
          f"{r['engine_config']['slots']} slots, context {r['engine_config']['max_context']}")
    print(f"  start-up s: {r['startup_s']}")
    print(f"  prefill tok/s: {r['prefill_tok_s']}")
    print("  decode tok/s: " + ", ".join(f"{u} users {v}" for u, v in r["decode_tok_s"].items()))
    for key, what in (("decode_scored_tok_s", "after scored prompts"), ("decode_dry_tok_s", "with one DRY stream")):
        if r.get(key):
            print(f"  decode tok/s {what}: " + ", ".join(f"{u} users {v}" for u, v in r[key].items()))
    print(f"  TTFT of a {r['settings']['join_len']}-token prompt joining 3 streams: {r['ttft_ms_join3']} ms")
    for key, what in (("chat_turn", "a chat's next turn"), ("shared_prompt", "a prompt sharing a busy slot's")):
        chat = r.get(key)
        if chat:
            print(f"  TTFT of {what} ({chat['history_tokens']} tokens of history, {chat['turn_tokens']} new): "
                  f"{chat['ttft_ms_warm_p50']} ms reusing {chat['cached_tokens']} against {chat['ttft_ms_cold_p50']} "
                  f"ms prefilled whole ({chat['speedup']}x; same first token {chat['same_first_token']})")
    for name, runs in (r.get("details", {}).get("constrained") or {}).items():
        if not isinstance(runs, dict) or "constraint" not in runs:
            continue  # the forty-ninth session's layout: one constraint, no name
        rates = []
        for key, run in runs.items():
            if isinstance(run, dict) and "constrained" in run:
                rate = f"{key} {run['constrained'].get('steady_tok_s')}"
                if "free" in run:
                    rate += f" (the free ones {run['free'].get('steady_tok_s')})"
                if run.get("complete") is False:
                    rate += " [a stream ended early]"
                rates.append(rate)
        print(f"  constrained decode tok/s ({name}: {runs['constraint']}): " + ", ".join(rates))
    print(f"  inter-token latency ({r['itl_users']} users): mean {r.get('itl_ms_mean')} ms, p50 {r['itl_ms_p50']} ms, "
          f"p99 {r['itl_ms_p99']} ms ({r['engine_config'].get('decode_steps')} decode steps per dispatch)")
    print(f"  copy bandwidth {r['copy_bandwidth_gb_s']} GB/s, weights {r['weight_bytes_per_step'] / 2**20:,.1f} MiB "
          f"per step -> weight-read floor {r['hbm_floor_tok_s']} steps/s")
    mem = r["memory"]["after_suite"]
    print(f"  memory: device {mem['device']}, RSS {mem['rss_mib']:.0f} MiB (peak {mem['peak_rss_mib']:.0f} MiB)")
    g = r["gc_after_ready"]
    print(f"  a full GC collection after warm-up: {g['ms']} ms over {g['tracked_objects']:,} tracked objects "
          f"({g['frozen_objects']:,} frozen)")


def plot(results: list[dict[str, Any]], path: pathlib.Path) -> None:
    """tok/s against concurrent users, beside llama.cpp's batched-bench on an H200."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is missing; no plot (redraw later with --plot-only RESULT.json)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # the llama.cpp figures the (first) run recorded for its model's shape (older files: the 7B's)
    ref = results[0].get("llama_cpp_h200") or common.LLAMA_CPP_H200
    batched = ref.get("batched_generation_tok_s")
    if batched:
        users = sorted(int(u) for u in batched)
        ax.plot(users, [batched[str(u)] for u in users], "s--", color="gray",
                label=f"llama.cpp batched-bench, H200 ({ref['model']})")
    else:  # llama-bench alone: its one-stream decode
        users = sorted({int(u) for r in results for u in r["decode_tok_s"]})
        ax.plot([1], [ref["tg128_tok_s"]], "s", color="gray", label=f"llama.cpp tg128, H200 ({ref['model']})")
    for r in results:
        xs = sorted(int(u) for u in r["decode_tok_s"] if r["decode_tok_s"][u])
        label = f"pallas-serve {r['engine_config']['slots']} slots ({r['model']['name']}, {r['device']['device_kind']})"
        ax.plot(xs, [r["decode_tok_s"][str(u)] for u in xs], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(users, [str(u) for u in users])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tok/s (steady state)")
    lines = [f"llama.cpp pp512 {ref['pp512_tok_s']:,} tok/s, tg128 {ref['tg128_tok_s']} tok/s"]
    for r in results:
        if r.get("prefill_tok_s"):
            lines.append(f"pallas-serve pp512 {next(iter(r['prefill_tok_s'].values())):,.0f} tok/s "
                         f"({r['engine_config']['slots']} slots)")
    ax.text(0.98, 0.02, "\n".join(lines), transform=ax.transAxes, va="bottom", ha="right", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, help="GGUF file")
    add_engine_arguments(ap, numerics="native")  # the server's engine flags and defaults (server --help)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=256, help="max_tokens of the decode runs")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--join-len", type=int, default=128)
    ap.add_argument("--chat-history-len", type=int, default=0,
                    help="a chat's history before its next turn, whose whole chunks the prompt cache reuses "
                         "(0: half the context plus --chat-turn-len)")
    ap.add_argument("--chat-turn-len", type=int, default=64, help="the new tokens of that next turn")
    ap.add_argument("--repeats", type=int, default=5, help="prefill and join measurements")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy-mib", type=int, default=0, help="copy-bandwidth buffer (0: 4096 on GPU, 256 on CPU)")
    ap.add_argument("--cache-dir", type=pathlib.Path, help="persistent compilation cache (default: a fresh temp dir)")
    ap.add_argument("--no-cold-start", action="store_true", help="skip the cold start-up in a child process")
    ap.add_argument("--profile-engine", action="store_true",
                    help="run the engine thread under cProfile; writes engine-<date>-profile.txt beside the JSON")
    ap.add_argument("--trace-decode", action="store_true",
                    help="after the measured runs, trace one more decode run of the most users and report the "
                         "device's idle gaps between programs (details.decode_trace)")
    ap.add_argument("--trace-users", metavar="N,N", help="trace a decode run of each of these user counts "
                    "(e.g. 1,8; details.decode_traces), as --trace-decode does for the most users")
    ap.add_argument("--trace-prefill", action="store_true",
                    help="after the measured runs, trace --repeats more lone prompts and lay each out from its "
                         "submit to its first token: device start, end, busy and gaps, the host's longest events "
                         "(details.prefill_trace)")
    ap.add_argument("--scored-decode", action="store_true",
                    help="after each decode run, one whose prompts were scored (prompt_logprobs 0): decode "
                         "after the scoring prefill programs, against decode after the plain ones")
    ap.add_argument("--dry-decode", action="store_true",
                    help="after each decode run, one whose first stream asks for DRY (llama.cpp's sampler, "
                         "DRY_SAMPLING): on a GPU those steps run the forward pass and the full sampler apart")
    ap.add_argument("--constrained", action="store_true",
                    help="also measure decode under constrained decoding (details.constrained)")
    ap.add_argument("--trace-constrained", action="store_true",
                    help="after the measured runs, trace one more decode of 1 user under each of "
                         "CONSTRAINTS, as --trace-users does a plain one (details.constrained_traces)")
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    ap.add_argument("--plot-with", nargs="*", default=[], help="earlier engine-*.json results to draw beside this run")
    ap.add_argument("--plot-only", nargs="+", type=pathlib.Path, help="draw these engine-*.json results and exit")
    ap.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    common.add_mosaic_tuning_arguments(ap)
    common.add_attention_config_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.plot_only:
        results = [json.loads(p.read_text()) for p in args.plot_only]
        plot(results, args.plot_only[0].with_suffix(".png"))
        return 0
    if args.model is None:
        ap.error("--model is required")
    if args.scored_decode and not args.prompt_logprobs:
        ap.error("--scored-decode needs the scoring programs, which --no-prompt-logprobs leaves out")
    if args.trace_users and not all(u.strip().isdigit() and 1 <= int(u) <= args.slots
                                    for u in args.trace_users.split(",")):
        ap.error(f"--trace-users takes user counts from 1 to --slots ({args.slots}) separated by commas, "
                 f"not {args.trace_users!r}")
    try:
        args.mosaic_tuning = common.apply_mosaic_tuning_arguments(args)  # the cold-start child's too (its argv)
        args.attention_config = common.apply_attention_config_arguments(args)
    except ValueError as e:
        ap.error(str(e))
    if args.startup_only:
        if args.cache_dir is None:
            ap.error("--startup-only needs --cache-dir")
        return startup_only(args)
    return main_run(args)


if __name__ == "__main__":
    sys.exit(main())
