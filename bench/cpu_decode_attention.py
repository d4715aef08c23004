"""The CPU's decode attention implementations on one model's attention shapes: a decode step's
layers (a `lax.scan` over the stacked f32 cache, as the forward pass reads it) at a few
contexts, each implementation timed on the same inputs, and their largest difference.

    python3 bench/cpu_decode_attention.py [--out DIR] [--slots 8] [--bucket 1024] [--contexts 100,500,1000]

Defaults are SmolLM2-135M's shape (30 layers, 9 query heads over 3 kv heads of 64) at the test
suite's 8 slots and 1,024-key bucket. Each busy slot's position is drawn from [context / 2,
context); `--busy N` leaves the other slots idle (position -1). Writes
`cpu-decode-attention-<date>.json` to --out (nothing without it) and prints a table.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--busy", type=int, default=None, help="busy slots (default: all)")
    ap.add_argument("--bucket", type=int, default=1024, help="the context bucket (keys attended)")
    ap.add_argument("--contexts", default="100,500,1000")
    ap.add_argument("--impls", default="reference,chunked")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from pallas_kernels import attention

    impls = {name: getattr(attention, f"attention_decode_{name}") for name in args.impls.split(",")}
    n_l, b, s, kh, d = args.layers, args.slots, args.bucket, args.kv_heads, args.head_dim
    busy = b if args.busy is None else args.busy
    rng = np.random.default_rng(0)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((n_l, b, s, kh, d), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, args.heads, d), np.float32))

    def step_of(fn):
        @jax.jit
        def step(q, k_cache, v_cache, positions):  # the caches as arguments, as the engine passes them
            def layer(x, i):  # each layer's query depends on the last layer's output, as in a model
                return x + fn(q + 1e-3 * x, k_cache, v_cache, positions, d ** -0.5, layer=i, span=s), None
            return jax.lax.scan(layer, jnp.zeros_like(q), jnp.arange(n_l))[0]
        return step

    steps = {name: step_of(fn) for name, fn in impls.items()}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        pos = np.full((b,), -1, np.int32)
        pos[:busy] = rng.integers(context // 2, context, busy)
        positions = jnp.asarray(pos)
        outs, row = {}, {"context": context, "positions": pos.tolist()}
        for name, step in steps.items():
            outs[name] = np.asarray(step(q, k_cache, v_cache, positions))  # compiles
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step(q, k_cache, v_cache, positions).block_until_ready()
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = round(statistics.median(times) * 1e3, 2)
        first = next(iter(outs.values()))
        row["max_abs_diff"] = max(float(np.abs(o[:busy] - first[:busy]).max()) for o in outs.values())
        rows.append(row)
        print(" ".join(f"{k} {v}" for k, v in row.items() if k != "positions"), flush=True)
    report = {**common.run_facts("synthetic attention inputs"), "layers": n_l, "heads": args.heads, "kv_heads": kh,
              "head_dim": d, "slots": b, "busy": busy, "bucket": s, "rows": rows}
    common.save_report(args.out, "cpu-decode-attention", report)


if __name__ == "__main__":
    main()
