"""How much of a decode matmul's time is its weights' trip from HBM: the Mosaic GPU q4_0 kernel
timed on matrices it has not read (cold: the stack is far larger than the L2) against the same
call right after a first one on the same matrix (warm: what the L2 kept of it).

    python3 bench/l2_warm.py [--shapes 4096x4096,12288x4096,22016x4096,4096x11008] [--out DIR]

Each shape: one jitted program over a 16-deep stack of random q4_0 matrices that, per matrix,
calls the kernel twice in a chain (the second call's x depends on the first call's result, so
XLA keeps the order), traced with `jax.profiler`; the Mosaic kernels' durations alternate cold,
warm. Reports the median of each and the bytes of the matrix. A warm call much faster than a
cold one says the kernel waits on HBM latency or bandwidth, which prefetching the next
matrix's first blocks into the L2 while the kernels before it run could hide; a warm call as
slow as a cold one says the time is the kernel's own (launch, instruction issue, epilogue).
Writes `l2warm-<date>.json` to --out (default bench/results).
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import statistics  # noqa: E402

from bench import common  # noqa: E402

LAYERS = 16


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def measure(n: int, k: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.matmul_ablation import random_q4_0_stack
    from pallas_kernels import matmul_mgpu

    w = random_q4_0_stack(jax.random.key(n + k), LAYERS, n, k)
    x = jax.random.normal(jax.random.key(1), (8, k), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def chain(w, x):
        outs = []
        for layer in range(LAYERS):
            for _ in range(2):  # cold, then warm
                y = matmul_mgpu.qmatmul_mgpu(x, w, layer=layer)
                outs.append(y[:, :1])
                x = x + (y[:, :1] * 0).astype(x.dtype)  # the next call waits for this one
        return jnp.concatenate(outs, axis=1)

    jax.block_until_ready(chain(w, x))
    events = common.traced_device_events(lambda: chain(w, x), reps)
    kernels = sorted((e for e in events if "mosaic" in e["name"]), key=lambda e: e["ts"])
    durs = [float(e.get("dur", 0.0)) for e in kernels]
    if len(durs) != reps * LAYERS * 2:
        return {"n": n, "k": k, "error": f"{len(durs)} Mosaic kernels traced, expected {reps * LAYERS * 2}"}
    cold, warm = durs[0::2], durs[1::2]
    nbytes = n * k // 2 + n * k // 32 * 2
    return {"n": n, "k": k, "mb": nbytes / 1e6, "cold_us": statistics.median(cold), "warm_us": statistics.median(warm),
            "cold_gbps": nbytes / statistics.median(cold) / 1e3, "calls": len(cold)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("4096x4096,12288x4096,22016x4096,4096x11008"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        print("needs a Hopper GPU (the Mosaic GPU kernel)", file=sys.stderr)
        return 2
    copy = common.copy_bandwidth_gb_s(2 << 30)
    rows = [measure(n, k, args.reps) for n, k in args.shapes]
    path = common.result_path(args.out, "l2warm", common.timestamp())
    common.write_json(path, {"device": common.device_info(), "git": common.git_rev(), "copy_gbps": copy, "rows": rows})
    print(f"copy {copy:.0f} GB/s")
    for r in rows:
        if "error" in r:
            print(f"{r['n']}x{r['k']}: {r['error']}")
            continue
        print(f"{r['n']}x{r['k']} {r['mb']:.1f} MB: cold {r['cold_us']:.2f} us ({100 * r['cold_gbps'] / copy:.0f}% of copy), "
              f"warm {r['warm_us']:.2f} us")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
