"""Prompt logprobs (PrefillChunk.score) on whatever backend runs them (the GPU's kernels
included, which the CPU tests cannot reach): what a scored prompt costs against a plain one, and
whether its scores are what a plain prefill of each prefix samples from.

One runner prefills random prompts of `--prompt-len` tokens, scored and plain, in chunks of the
largest compiled size, each whole in one dispatch, `--repeats` times each (alternated), and
reports prefill tok/s for both. Then for cut points around the chunk boundaries it prefills the
prompt's first c tokens plainly (greedy, every top logprob) and compares the first token's top
alternatives there with the scored chunk's row c - 1: same best token (or a near tie), and the
largest |logprob difference| over the top ones (a plain prefill of c tokens runs the smallest
chunk that holds its last piece, so its arithmetic differs a little).

    python3 bench/prompt_logprobs.py --model /tmp/m.gguf [--prompt-len 1000] [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan  # noqa: E402
from scheduler.loader import load_resolved  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402

NEAR_TIE = 0.05  # logprob gap under which two runs may pick different best tokens


def prefill(runner, prompt: np.ndarray, slot: int, score: bool, sp: SamplingParams):
    """The prompt prefilled in chunks of the largest size (scored or not), one dispatch; its output."""
    size = runner.prefill_chunks[-1]
    chunks = []
    for start in range(0, len(prompt), size):
        end = min(start + size, len(prompt))
        extra = dict(score=True, next_token=int(prompt[end]) if end < len(prompt) else -1) if score else {}
        chunks.append(PrefillChunk(slot, prompt[start:end], start, end == len(prompt), **extra))
    return runner.dispatch(StepPlan(setups=(SlotSetup(slot, sp),), prefills=tuple(chunks))).result()


def timed(runner, prompts: list[np.ndarray], score: bool, sp: SamplingParams) -> float:
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        prefill(runner, prompt, i % runner.num_slots, score, sp)
    return sum(len(p) for p in prompts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    add_engine_arguments(ap, numerics="native")
    ap.set_defaults(max_context=2048, kv_dtype="auto")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cache_dir:
        common.enable_compilation_cache(args.cache_dir)
    t0 = time.perf_counter()
    loaded, cfg = load_resolved(args.model, engine_config_from_args(args))
    runner = loaded.make_runner(cfg)
    runner.warmup()
    print(f"loaded and compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    vocab, size = runner.vocab_size, runner.prefill_chunks[-1]
    if args.prompt_len >= runner.max_context:
        ap.error(f"--prompt-len must be below the context, {runner.max_context}")
    greedy = SamplingParams(temperature=0.0, top_logprobs=runner.max_top_logprobs)
    prompts = [rng.integers(0, vocab, args.prompt_len, dtype=np.int32) for _ in range(args.prompts)]
    timed(runner, prompts[:1], True, greedy), timed(runner, prompts[:1], False, greedy)  # first runs
    rates: dict[str, list[float]] = {"plain": [], "scored": []}
    for _ in range(args.repeats):
        rates["plain"].append(timed(runner, prompts, False, greedy))
        rates["scored"].append(timed(runner, prompts, True, greedy))
    prompt = prompts[0]
    out = prefill(runner, prompt, 0, True, greedy)
    top_ids = np.concatenate([s.top_ids for s in out.scores])
    top_lps = np.concatenate([s.top_logprobs for s in out.scores])
    cuts = sorted({c for c in (1, 2, size - 1, size, size + 1, args.prompt_len - 1) if 1 <= c < args.prompt_len})
    checks, ok = [], True
    for c in cuts:
        plain = prefill(runner, prompt[:c], 1, False, greedy)
        row = c - 1  # scores the token at position c
        same = int(plain.top_ids[1][0]) == int(top_ids[row][0])
        tie = float(top_lps[row][0] - top_lps[row][1]) < NEAR_TIE
        diff = float(np.abs(plain.top_logprobs[1][:5] - top_lps[row][:5]).max()) if same else None
        ok &= same or tie
        checks.append({"cut": c, "same_best": same, "near_tie": tie, "max_top5_diff": diff})
        print(f"cut {c}: best token {'same' if same else 'differs'}{' (near tie)' if tie else ''}, "
              f"top-5 |diff| {diff}", flush=True)
    best = {k: max(v) for k, v in rates.items()}
    report = {**common.run_facts(args.model), "prompt_len": args.prompt_len, "prompts": args.prompts,
              "chunk": size, "prefill_tok_s": rates, "scored_over_plain": best["scored"] / best["plain"],
              "checks": checks, "ok": ok}
    print(f"prefill tok/s plain {rates['plain']}, scored {rates['scored']} "
          f"(best scored / best plain {report['scored_over_plain']:.3f})", flush=True)
    common.save_report(args.out, "prompt-logprobs", report)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
