"""Whether a deferred decode (StepPlan.deferred: the forward pass at dispatch, the sampling with
the allowed-token rows at `supply`, two programs) gives what the one-program decode gives with
the same rows known at dispatch, on whatever backend runs it (the GPU's kernels included, which
the CPU test `tests/model/test_runner.py` cannot reach).

Two runners over one loaded model (constrained_overlap off and on) run the same steps: two
prompts prefilled (slot 0 constrained to a random set of tokens, slot 1 free), then decode steps,
with a third prompt joining in the second; greedy, then sampled with a seed. It compares per
step the tokens, their logprobs and the top alternatives' ids and logprobs, and reports whether
they are bitwise equal and the largest logprob difference; it exits 1 where a token differs.

    python3 bench/deferred_check.py --model /tmp/m.gguf [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan, mask_words  # noqa: E402
from scheduler.loader import load_resolved  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402


def random_row(vocab: int, allowed: int, rng: np.random.Generator) -> np.ndarray:
    """An allowed-token row (bit t of word t // 32) of `allowed` random tokens."""
    row = np.zeros((mask_words(vocab),), np.uint32)
    for t in rng.choice(vocab, allowed, replace=False):
        row[t // 32] |= np.uint32(1 << (int(t) % 32))
    return row.view(np.int32)


def run_steps(runner, deferred: bool, sp: SamplingParams, prompts: list[np.ndarray], row: np.ndarray,
              steps: int) -> list:
    first = (SlotSetup(0, sp), SlotSetup(1, sp))
    chunks = tuple(PrefillChunk(s, prompts[s], 0, True) for s in (0, 1))
    late = PrefillChunk(2, prompts[2], 0, True)
    outs = [runner.dispatch(StepPlan(setups=first, prefills=chunks, allowed=((0, row),))).result()]
    for i in range(steps):
        extra = dict(setups=(SlotSetup(2, sp),), prefills=(late,)) if i == 1 else {}
        slots = (0, 1, 2) if i >= 2 else (0, 1)
        if deferred:
            pending = runner.dispatch(StepPlan(decode_slots=slots, deferred=(0,), **extra))
            pending.supply({0: row})
        else:
            pending = runner.dispatch(StepPlan(decode_slots=slots, allowed=((0, row),), **extra))
        outs.append(pending.result())
    return outs


def compare(one: list, split: list) -> dict:
    tokens_equal, bitwise, max_diff = True, True, 0.0
    for a, b in zip(one, split):
        v = a.valid
        if not np.array_equal(v, b.valid) or not np.array_equal(a.tokens[v], b.tokens[v]):
            tokens_equal = False
            continue
        for x, y in ((a.logprobs[v], b.logprobs[v]), (a.top_logprobs[v], b.top_logprobs[v])):
            bitwise &= bool(np.array_equal(x, y))
            finite = np.isfinite(x) & np.isfinite(y)
            if finite.any():
                max_diff = max(max_diff, float(np.abs(x[finite] - y[finite]).max()))
        bitwise &= bool(np.array_equal(a.top_ids[v], b.top_ids[v]))
    return {"tokens_equal": tokens_equal, "bitwise": bitwise, "max_logprob_diff": max_diff,
            "tokens_one_program": [o.tokens[o.valid].tolist() for o in one],
            "tokens_deferred": [o.tokens[o.valid].tolist() for o in split]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    add_engine_arguments(ap, numerics="native")
    ap.set_defaults(max_context=1024, kv_dtype="auto", prefill_chunks=(64,))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=60, help="tokens per prompt (one chunk)")
    ap.add_argument("--allowed", type=int, default=300, help="tokens in slot 0's allowed row")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cache_dir:
        common.enable_compilation_cache(args.cache_dir)
    cfg = engine_config_from_args(args)
    t0 = time.perf_counter()
    loaded, cfg = load_resolved(args.model, dataclasses.replace(cfg, constrained_overlap="off"))
    one = loaded.make_runner(cfg)
    split = loaded.make_runner(dataclasses.replace(cfg, constrained_overlap="on"))
    if not split.defers_allowed:
        ap.error("this configuration does not defer (tensor parallel?)")
    one.warmup()
    split.warmup()
    print(f"loaded and compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    vocab = one.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len, dtype=np.int32) for _ in range(3)]
    row = random_row(vocab, args.allowed, rng)
    report = {**common.run_facts(args.model), "steps": args.steps,
              "engine_config": {"kv_dtype": cfg.kv_dtype, "compute_dtype": cfg.compute_dtype}, "cases": {}}
    ok = True
    for name, sp in (("greedy", SamplingParams(temperature=0, top_logprobs=5)),
                     ("sampled", SamplingParams(temperature=1.0, seed=7, top_logprobs=5))):
        case = compare(run_steps(one, False, sp, prompts, row, args.steps),
                       run_steps(split, True, sp, prompts, row, args.steps))
        report["cases"][name] = case
        ok &= case["tokens_equal"]
        print(f"{name}: tokens equal {case['tokens_equal']}, logprobs bitwise {case['bitwise']}, "
              f"max |diff| {case['max_logprob_diff']:.3g}", flush=True)
    common.save_report(args.out, "deferred-check", report)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
