"""Calls the Mosaic GPU decode matmul on a stack of random q4_0 matrices, for a profiler to
attach to (Nsight Compute's `ncu`): no timing of its own.

    ncu --kernel-name regex:mosaic --launch-skip 3 --launch-count 1 --section SpeedOfLight ... \\
        python3 bench/profile_matmul.py 22016x4096 [fold_scales=1] [row_tiles=2] [tile_k=128]

Each `key=value` is a field of `pallas_kernels.matmul_mgpu.MosaicMatmulTuning` (ints; 0/1 for
the booleans). Six calls on distinct matrices of a 16-deep stack (the first one compiles: the
layer index is traced).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # bench/http.py would shadow the standard library's http
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.matmul_ablation import random_q4_0_stack  # noqa: E402
from pallas_kernels import matmul_mgpu  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    n, k = (int(v) for v in argv[0].split("x"))
    fields = {f.name: f.type for f in dataclasses.fields(matmul_mgpu.MosaicMatmulTuning)}
    changes = {}
    for item in argv[1:]:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown tuning field {key!r}; have {sorted(fields)}")
        changes[key] = bool(int(value)) if fields[key] in (bool, "bool") else int(value)
    tuning = matmul_mgpu.MosaicMatmulTuning(**changes)
    w = random_q4_0_stack(jax.random.key(0), 16, n, k)
    x = jax.random.normal(jax.random.key(3), (8, k), jnp.float32).astype(jnp.bfloat16)
    for layer in range(6):
        y = matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=layer)
    jax.block_until_ready(y)
    print(f"{n}x{k} {tuning}: done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
