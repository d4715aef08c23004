"""The decode step's fused residual add + RMS norm (pallas_kernels/norm.py) against XLA's own
kernels for the same work (the reference op jitted: the split-K sum with the residual add, then
the norm with the permutation), kernel time per call from a profiler trace.

    python3 bench/add_norm.py [--rows 8] [--embed 4096] [--parts 1,4,5] [--warps 1,2,4,8,16] [--out DIR]

Each variant runs in one jitted program 32 times on distinct input arrays (so XLA neither merges
nor caches the calls, and hands each call its own buffers); us = the sum of the program's kernel
durations / 32. (The first version sliced one stacked input per call, and the Triton kernel's
figures in `addnorm-20261130-040119.json` include those slices' copy kernels: 3 kernels a call.) Writes
`addnorm-<date>.json` to --out (default bench/results).
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import functools  # noqa: E402
import tempfile  # noqa: E402

from bench import common  # noqa: E402

CALLS = 32


def device_us(fn, args, reps: int = 5) -> tuple[float, float]:
    """(kernel microseconds per op call, kernels per op call) of fn(*args), a program of CALLS calls."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        events = common.device_trace_events(d) or []
    n = reps * CALLS
    return sum(float(e.get("dur", 0.0)) for e in events) / n, len(events) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ints = lambda v: [int(t) for t in v.split(",")]  # noqa: E731
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--parts", type=ints, default=[1, 4, 5])
    ap.add_argument("--warps", type=ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from pallas_kernels import norm

    if jax.default_backend() != "gpu":
        print("needs a GPU", file=sys.stderr)
        return 2
    m, e = args.rows, args.embed
    key = jax.random.key(0)
    rows = []
    for p in args.parts:
        # one array per call: a slice of a larger array handed to the Pallas call would be a
        # copy kernel of its own (the weights stay one [CALLS, E] stack read at a layer, as the
        # engine's norm weights are)
        xs = [jax.random.normal(jax.random.fold_in(key, 10 + i), (m, e), jnp.float32) for i in range(CALLS)]
        parts = [jax.random.normal(jax.random.fold_in(key, 100 + i), (p, m, e), jnp.float32) for i in range(CALLS)]
        w = jax.random.normal(jax.random.fold_in(key, 2), (CALLS, e), jnp.float32)
        variants = {"xla": norm.add_norm_reference}
        variants |= {f"triton-w{n}": functools.partial(norm.add_norm_triton, num_warps=n) for n in args.warps}
        for name, op in variants.items():
            for order in norm.ORDERS:
                fn = jax.jit(lambda xs, ps, ws, op=op, order=order: [op(xs[i], ps[i], ws, 1e-5, order, layer=i)
                                                                     for i in range(CALLS)])
                try:
                    us, kernels = device_us(fn, (xs, parts, w))
                except Exception as ex:  # noqa: BLE001 - a failed variant is a result row
                    rows.append({"variant": name, "order": order, "parts": p, "error": str(ex)[:300]})
                    continue
                rows.append({"variant": name, "order": order, "parts": p, "us": us, "kernels_per_call": kernels})
                print(f"P={p} {order:8} {name:10} {us:6.2f} us, {kernels:.1f} kernels per call", flush=True)
    path = common.result_path(args.out, "addnorm", common.timestamp())
    common.write_json(path, {"device": common.device_info(), "git": common.git_rev(), "rows": args.rows,
                             "embed": args.embed, "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
