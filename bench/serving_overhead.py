"""What the HTTP layer costs per token, without a GPU: the real engine and the real server with a
stand-in for the device, so that host-side changes can be measured on any machine.

    python bench/serving_overhead.py --model PATH.gguf [--step-ms 3.3] [--host-ms 0.3]
        [--users 1,8] [--max-tokens 256] [--repeats 3] [--out DIR]

The stand-in (`DeviceQueueModel`) replaces the model runner only: like a GPU stream, each
dispatched step starts when the previous one ends and takes `--step-ms` (plus
`--prefill-us-per-token` per prompt token); `results()` sleeps until its step ends, releasing
the GIL as a device wait does; dispatching holds the GIL for `--host-ms` of busy work (the JAX
dispatch of the real runner). Tokens are random ids of the GGUF's vocabulary (no special
tokens), so detokenization and SSE frames carry real text. The tokenizer comes from the GGUF;
no weights are loaded and JAX is never used.

Both sides run in child processes, one at a time, and alternate `--repeats` times (server,
engine, server, ...), since machine noise between runs is as large as what is measured:

  * http: `python bench/serving_overhead.py --serve` — the app of `python -m server`
    (server.app.create_app) under uvicorn, built on this stand-in; the clients are bench/http.py's
    (streaming POST /v1/completions, `logprobs: 0` so that each token is its own SSE frame);
  * engine: the same requests through `Engine.submit` (bench/http.py's engine-direct workload).

With a device step of 3.3 ms (a 7B Q4_0 decode step on the H200 with 8 slots), the engine alone
gives at most 8 / 3.3 ms = 2,424 tok/s at 8 users; the gap between the two is the serving cost.
Writes bench/results/serving-<date>.json.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: bench/http.py would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench import http as bench_http  # noqa: E402
from model.step_types import StepOutput, StepPlan  # noqa: E402

log = logging.getLogger("bench.serving_overhead")


class _Pending:
    def __init__(self, out: StepOutput, done_at: float) -> None:
        self._out, self._done_at = out, done_at

    def results(self) -> list[StepOutput]:
        delay = self._done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, as waiting on the device does
        return [self._out]

    def result(self) -> StepOutput:
        return self.results()[0]


class DeviceQueueModel:
    """A StepModel whose steps take fixed device time in a queue (module docstring)."""

    decode_steps = (1,)

    def __init__(self, *, num_slots: int, max_context: int, prefill_chunks: tuple[int, ...], max_top_logprobs: int,
                 step_s: float, prefill_s_per_token: float, host_s: float, token_ids: np.ndarray, seed: int = 0):
        self.num_slots = num_slots
        self.max_context = max_context
        self.prefill_chunks = prefill_chunks
        self.max_top_logprobs = max_top_logprobs
        self._step_s, self._prefill_s, self._host_s = step_s, prefill_s_per_token, host_s
        self._token_ids = token_ids
        self._rng = np.random.default_rng(seed)
        self._busy_until = 0.0  # when the last dispatched step ends (only the engine thread dispatches)

    def warmup(self) -> None:
        pass

    def dispatch(self, plan: StepPlan) -> _Pending:
        spin_until = time.perf_counter() + self._host_s
        while time.perf_counter() < spin_until:  # holds the GIL, like the runner's dispatch
            pass
        out = StepOutput.empty(self.num_slots, self.max_top_logprobs)
        rows = list(plan.decode_slots) + [c.slot for c in plan.prefills if c.is_last]
        out.valid[rows] = True
        out.tokens[rows] = self._rng.choice(self._token_ids, size=len(rows))
        out.logprobs[rows] = -1.0
        cost = self._step_s + self._prefill_s * sum(len(c.tokens) for c in plan.prefills)
        self._busy_until = max(time.perf_counter(), self._busy_until) + cost
        return _Pending(out, self._busy_until)


def engine_config(args: argparse.Namespace):
    """bench/engine.py's config for this script's flags."""
    from bench import engine as bench_engine

    return bench_engine.build_config(args.slots, args.max_context, "float32", args.prefill_budget, args.max_queue)


def build_engine(args: argparse.Namespace, config: Any = None):
    """The scheduler's Engine on the stand-in, with the GGUF's tokenizer and `config` (by default
    `engine_config(args)`)."""
    from model.gguf_file import GGUFFile
    from model.tokenizer import Tokenizer
    from scheduler.engine import Engine

    meta = GGUFFile(args.model).metadata
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    config = config if config is not None else engine_config(args)
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(tokenizer.vocab_size)))
    ids = np.flatnonzero(types == 1).astype(np.int32)  # normal tokens: text, never special or end-of-generation

    def factory() -> DeviceQueueModel:
        return DeviceQueueModel(num_slots=config.num_slots, max_context=config.max_context,
                                prefill_chunks=config.prefill_chunks, max_top_logprobs=config.max_top_logprobs,
                                step_s=args.step_ms / 1e3, prefill_s_per_token=args.prefill_us_per_token / 1e6,
                                host_s=args.host_ms / 1e3, token_ids=ids, seed=args.seed)

    return Engine(factory, tokenizer, config, model_name="stand-in")


def build_from_spec(model_path: str, config: Any):
    """`EngineSpec.builder` with --engine-process: the stand-in engine in the engine process;
    `model_path` is the JSON of this script's arguments."""
    options = json.loads(model_path)
    return build_engine(argparse.Namespace(**{**options, "model": pathlib.Path(options["model"])}), config)


def _engine_process(args: argparse.Namespace):
    """With --engine-process: the stand-in engine in a process of its own, as `python -m server`
    runs the real one (scheduler/engine_process.py)."""
    from scheduler.engine_process import EngineSpec, open_engine_process

    options = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    spec = EngineSpec(model_path=json.dumps(options), engine_config=engine_config(args), log_level="warning",
                      builder="bench.serving_overhead:build_from_spec")
    return open_engine_process(spec, gguf_path=args.model)


def serve(args: argparse.Namespace) -> int:
    """Child process: `python -m server`'s app on the stand-in engine (in a process of its own
    with --engine-process, else on a thread of this one)."""
    import uvicorn

    from server.app import EngineHolder, create_app
    from server.config import ServerConfig

    logging.basicConfig(level=logging.WARNING)
    config = ServerConfig(model_name="stand-in", log_level="warning")
    factory = (lambda: _engine_process(args)) if args.engine_process else (lambda: build_engine(args))
    app = create_app(config, EngineHolder(), engine_factory=factory)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


def engine_side(args: argparse.Namespace) -> int:
    """Child process: the same requests through Engine.submit."""
    from bench import engine as bench_engine

    engine = build_engine(args)
    engine.start()
    if not engine.wait_ready():
        raise RuntimeError(f"the engine did not become ready: {engine.stats().error}")
    vocab = engine.tokenizer.vocab_size

    async def workload() -> dict[str, Any]:
        out = {}
        warm = bench_http.prompts_for(args.seed + 1, 1, 64, vocab)[0]
        await bench_engine.run_batch(engine, [bench_engine.make_request("warmup", warm, 8, 0, logprobs=True)])
        for users in args.users:
            prompts = bench_http.prompts_for(args.seed, users, args.prompt_len, vocab)
            reqs = [bench_engine.make_request(f"engine-{users}-{i}", p, args.max_tokens, i, logprobs=True)
                    for i, p in enumerate(prompts)]
            out[str(users)] = bench_http.level_summary(await bench_engine.run_batch(engine, reqs))
        return out

    try:
        levels = asyncio.run(workload())
    finally:
        engine.shutdown(30)
    common.write_json(args.json_out, {"levels": levels})
    return 0


def _child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--model", str(args.model), "--slots", str(args.slots), "--max-queue", str(args.max_queue),
        "--max-context", str(args.max_context), "--prefill-budget", str(args.prefill_budget),
        "--step-ms", str(args.step_ms), "--host-ms", str(args.host_ms),
        "--prefill-us-per-token", str(args.prefill_us_per_token), "--seed", str(args.seed),
        "--users", ",".join(map(str, args.users)), "--prompt-len", str(args.prompt_len),
        "--max-tokens", str(args.max_tokens), *(["--engine-process"] if args.engine_process else []),
    ]


def run_http_once(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--serve", "--port", "{port}",
           *_child_args(args)]
    server = bench_http.ServerProcess(args, command=cmd)
    try:
        server.wait_healthy(120)
        return asyncio.run(bench_http.run_http(server.url, args, vocab, repeats=1))  # --repeats alternates runs
    finally:
        server.stop()


def run_engine_once(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "engine.json"
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--engine-side", "--json-out", str(out),
               *_child_args(args)]
        subprocess.run(cmd, check=True, cwd=common.ROOT)
        return json.loads(out.read_text())["levels"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, required=True, help="GGUF file: its tokenizer (no weights are read)")
    ap.add_argument("--step-ms", type=float, default=3.3, help="device time of a decode step")
    ap.add_argument("--prefill-us-per-token", type=float, default=65.0, help="device time per prompt token")
    ap.add_argument("--host-ms", type=float, default=0.3, help="GIL-holding host work per dispatch")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--users", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="server / engine runs, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-process", action="store_true",
                    help="the server's engine in a process of its own, as `python -m server` runs it by default "
                         "(without: on a thread of the server's process, as --no-engine-process)")
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)
    if args.engine_side:
        return engine_side(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    vocab = bench_http.vocab_size_of(args.model)
    runs: dict[str, list[dict[str, Any]]] = {"http": [], "engine": []}
    for i in range(args.repeats):
        runs["http"].append(run_http_once(args, vocab))
        runs["engine"].append(run_engine_once(args))
        log.info("repeat %d: http %s / engine %s tok/s", i,
                 {u: runs["http"][-1][u]["steady_tok_s"] for u in runs["http"][-1]},
                 {u: runs["engine"][-1][u]["steady_tok_s"] for u in runs["engine"][-1]})
    summary = {}
    for users in map(str, args.users):
        row = {}
        for side in ("http", "engine"):
            # medians over the runs; None where no run had such a span (no steady state: every
            # token in one burst)
            median = bench_http.combine_runs([r[users] for r in runs[side]])
            for key in ("tok_s", "steady_tok_s", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50"):
                row[f"{side}_{key}"] = median[key]
        # as bench/http.py: over the wall time (first submit to last token, TTFT included) and in the steady state
        for cost, key in (("cost_pct", "tok_s"), ("steady_cost_pct", "steady_tok_s")):
            http, engine = row[f"http_{key}"], row[f"engine_{key}"]
            row[cost] = round(100 * (1 - http / engine), 2) if http and engine else None
        summary[users] = row
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {
        "kind": "serving_overhead", "date": stamp, "git": common.git_rev(), "model": common.model_facts(args.model),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                     if k not in ("serve", "port", "engine_side", "json_out", "out")},
        "host": {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "runs": runs, "median": summary,
    }
    path = common.result_path(args.out, "serving", stamp)
    common.write_json(path, result)
    print("users  http/engine tok/s  cost %  steady http/engine tok/s  cost %  TTFT http/engine  ITL p50 http/engine"
          "  (medians)")
    def fmt(value, spec: str) -> str:
        return format(value, spec) if value is not None else format("-", spec.split(".")[0])  # width kept

    for users, row in summary.items():
        print(f"{users:>5}  {fmt(row['http_tok_s'], '>8.1f')}/{fmt(row['engine_tok_s'], '<8.1f')}"
              f" {fmt(row['cost_pct'], '>6.2f')}"
              f"  {fmt(row['http_steady_tok_s'], '>11.1f')}/{fmt(row['engine_steady_tok_s'], '<11.1f')}"
              f" {fmt(row['steady_cost_pct'], '>6.2f')}"
              f"  {fmt(row['http_ttft_ms_p50'], '>7.1f')}/{fmt(row['engine_ttft_ms_p50'], '<7.1f')}"
              f"  {fmt(row['http_itl_ms_p50'], '>8.2f')}/{fmt(row['engine_itl_ms_p50'], '<8.2f')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
