"""What each sampler costs in a decode step's sampling, on whatever backend runs it: the jitted
`model.sampling.sample_stateful` over [B, V] random logits and a [B, S] history (every row the
same settings), timed per call, beside a greedy baseline and a plain sampled one (temperature
only) measured in the same run.

The samplers other than the temperature run under conditionals, only in steps where some row
asks for them; the "greedy" and "greedy, dry context" rows measure what that costs the programs
where none does (the DRY conditional is the one added outside the draw).

    python3 bench/samplers.py [--rows 8] [--vocab 32000] [--context 4096] [--out DIR]
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

# (name, SamplingParams fields, whether the token history (DRY's, the penalty windows') is passed)
CASES = (
    ("greedy", dict(temperature=0.0), False),
    ("greedy, dry context", dict(temperature=0.0), True),
    ("temperature", dict(temperature=0.8), True),
    ("top_p 0.9", dict(temperature=0.8, top_p=0.9), True),
    ("typical_p 0.9", dict(temperature=0.8, typical_p=0.9), True),
    ("top_n_sigma 1.5", dict(temperature=0.8, top_n_sigma=1.5), True),
    ("xtc 0.5 / 0.1", dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1), True),
    ("dynatemp 0.5", dict(temperature=0.8, dynatemp_range=0.5), True),
    ("penalties, last 64", dict(temperature=0.8, repetition_penalty=1.1, penalty_last_n=64), True),
    ("dry 0.8", dict(temperature=0.8, dry_multiplier=0.8), True),
    ("mirostat 2", dict(temperature=0.8, mirostat=2), True),
    ("mirostat 1", dict(temperature=0.8, mirostat=1), True),
)


def time_case(fields: dict, with_dry: bool, rows: int, vocab: int, context: int, repeats: int) -> float:
    """Median seconds per call of the jitted sampler with these settings in every row."""
    import jax
    import jax.numpy as jnp

    from model import sampling
    from model.step_types import SamplingParams

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    params = [SamplingParams(seed=i, dry_breaker_ids=(1, 2, 3), **fields) for i in range(rows)]
    arrays = jax.device_put(sampling.pack_sampling(params, 4))
    history = jnp.asarray(rng.integers(0, 64, (rows, context)).astype(np.int32))  # a small alphabet: repeats
    last = jnp.full((rows,), context - 2, jnp.int32)
    recent = sampling.TokenHistory(history, jnp.arange(rows, dtype=jnp.int32), last, history[:, -2],
                              jnp.asarray(np.stack([sampling.token_bits((1, 2, 3), vocab)] * rows)))
    mask, counts = jnp.zeros((rows, vocab), bool), jnp.zeros((rows, vocab), jnp.int32)

    @jax.jit
    def step(logits, arrays, index, mu):
        return sampling.sample_stateful(logits, arrays, mask, counts, index, 0, mu, history=recent if with_dry else None)

    mu = 2 * arrays.mirostat_tau
    index = jnp.zeros((rows,), jnp.int32)
    jax.block_until_ready(step(logits, arrays, index, mu))  # compile
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(logits, arrays, index + i, mu))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=4096, help="S: the history's positions (DRY reads them all)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="directory for samplers-<date>.json")
    args = ap.parse_args(argv)
    results = []
    base = None
    time_case(CASES[0][1], CASES[0][2], args.rows, args.vocab, args.context, args.repeats)  # warm-up, not kept
    for name, fields, with_dry in CASES:
        seconds = time_case(fields, with_dry, args.rows, args.vocab, args.context, args.repeats)
        base = seconds if base is None else base
        results.append({"case": name, "us": round(seconds * 1e6, 1), "vs_greedy": round(seconds / base, 3)})
        print(f"{name:22s} {seconds * 1e6:10.1f} us  {seconds / base:6.2f}x greedy", flush=True)
    report = {**common.run_facts("random logits"), "rows": args.rows, "vocab": args.vocab, "context": args.context,
              "repeats": args.repeats, "results": results}
    common.save_report(args.out, "samplers", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
