"""Where a decode step's time goes: times the jitted forward.decode alone (no engine, no
sampling) on a GGUF with kernel variants swapped in, so differences between variants place
the time.

    python3 bench/decode_profile.py --model M.gguf [--slots 8] [--context 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import forward  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.loader import load_model  # noqa: E402
from pallas_kernels.attention import attention_decode_reference  # noqa: E402
from pallas_kernels.matmul import qmatmul_reference  # noqa: E402


def time_decode(m, kern, slots, context, kv_dtype, steps=20, unroll=False):
    params = m.params
    if unroll and params.is_stacked:
        n = m.config.num_layers
        params = dataclasses.replace(params, layers=[jax.tree_util.tree_map(lambda a: a[i], params.layers) for i in range(n)], is_stacked=False)
    cache = forward.KVCache.create(m.config, slots, context, jnp.dtype(kv_dtype))
    f = jax.jit(functools.partial(forward.decode, m.config, kern), donate_argnums=(1,), static_argnums=(4,))
    toks = jnp.arange(slots, dtype=jnp.int32)
    pos = jnp.full((slots,), 100, jnp.int32)
    logits, cache = f(params, cache, toks, pos, context)
    logits.block_until_ready()
    t = time.perf_counter()
    for i in range(steps):
        logits, cache = f(params, cache, toks, pos + i, context)
    logits.block_until_ready()
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-dtype", default="bfloat16")
    args = ap.parse_args()
    ecfg = EngineConfig(num_slots=args.slots, max_context=args.context, kv_dtype=args.kv_dtype)
    m = load_model(args.model, ecfg)
    k = m.kernels
    no_attn = lambda q, kc, vc, p, s, w: q.astype(jnp.float32)  # noqa: E731
    variants = {
        "chosen (" + ",".join(f"{a}={b}" for a, b in m.kernel_names.items()) + ")": k,
        "matmul=reference": dataclasses.replace(k, matmul=qmatmul_reference),
        "attention_decode=reference": dataclasses.replace(k, attention_decode=attention_decode_reference),
        "no attention": dataclasses.replace(k, attention_decode=no_attn),
    }
    for name, kern in variants.items():
        try:
            print(f"{time_decode(m, kern, args.slots, args.context, args.kv_dtype):8.2f} ms  {name}", flush=True)
        except Exception as e:  # a variant that fails is reported, the others still run
            print(f"  failed  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    try:
        print(f"{time_decode(m, k, args.slots, args.context, args.kv_dtype, unroll=True):8.2f} ms  chosen, layers unrolled (no scan)", flush=True)
    except Exception as e:
        print(f"  failed  unrolled: {type(e).__name__}: {str(e)[:300]}", flush=True)
    w = np.float64(sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(m.params)))
    print(f"weights {w / 2**20:.0f} MiB: at 3.5 TB/s the floor is {w / 3.5e12 * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
