"""The prompt cache's prefix copy (`model.runner._copy_prefix`) alone: its temporary memory,
device time and whether its launch blocks the host, per layers-per-iteration and context bucket.

    python3 bench/prefix_copy.py [--shape llama2-7b] [--slots 8] [--max-context 4096] [--out DIR]
    python3 bench/prefix_copy.py --tiny        # CPU smoke test

A cache of the shape's layers, kv heads and head dim (bf16 on a GPU, `--slots` x
`--max-context` positions, zeros) is copied from slot 0 to slot 1 over each context bucket's
positions with each `--layers` setting (0: all layers in one slice). Per setting: the compiled
program's temporary bytes (`memory_analysis`), the median wall time of a copy run alone and
synced (the device's work plus one dispatch), the GB/s that makes of the bytes read and
written, and `launch_ms`: how long the call takes to return while the device is still busy
with a long program queued before it; near 0 unless the program makes the host wait for the
device (a loop whose condition the host reads).

Writes `prefix-copy-<date>.json` ({"meta": ..., "rows": [...]}) to --out (default
bench/results) and prints a table.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import common  # noqa: E402

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128), "tiny": (4, 2, 16)}  # layers, kv heads, head dim


def buckets(max_context: int) -> list[int]:
    """The engine's default context buckets (EngineConfig.attention_buckets)."""
    from model.config import EngineConfig

    return list(EngineConfig(max_context=max_context).attention_buckets)


def run(shape: str, slots: int, max_context: int, layer_settings: list[int], repeats: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model.forward import KVCache
    from model.runner import SlotState, _copy_prefix

    num_layers, kv_heads, head_dim = SHAPES[shape]
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    dims = (num_layers, slots, max_context, kv_heads, head_dim)
    cache = KVCache(jnp.zeros(dims, dtype), jnp.zeros(dims, dtype))
    state = SlotState.create(slots, 1024, max_context)
    args = jnp.asarray(np.array([0, 1], np.int32))
    busy = jax.jit(lambda x: jnp.tanh(x @ x) @ x)  # a long program to queue the copy behind
    n = 16384 if jax.default_backend() == "gpu" else 512  # about 25 ms on an H200
    work = jnp.ones((n, n), dtype)
    busy(work).block_until_ready()
    rows = []
    for span in buckets(max_context):
        for layers in layer_settings:
            per_iter = min(layers or num_layers, num_layers)
            fn = jax.jit(functools.partial(_copy_prefix, span, per_iter), donate_argnums=(1, 2))
            compiled = fn.lower(None, cache, state, args).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            cache, state = compiled(None, cache, state, args)
            jax.block_until_ready(cache)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                cache, state = compiled(None, cache, state, args)
                jax.block_until_ready(cache)
                times.append(time.perf_counter() - t0)
            launches = []
            for _ in range(3):
                pending = busy(work)
                t0 = time.perf_counter()
                cache, state = compiled(None, cache, state, args)
                launches.append(time.perf_counter() - t0)
                jax.block_until_ready((pending, cache))
            wall = statistics.median(times)
            moved = 2 * 2 * num_layers * span * kv_heads * head_dim * jnp.dtype(dtype).itemsize  # k, v; read, write
            rows.append({"shape": shape, "span": span, "layers_per_iteration": per_iter, "temp_mib": temp / 2**20,
                         "ms": wall * 1e3, "gbps": moved / wall / 1e9, "launch_ms": statistics.median(launches) * 1e3})
            print(f"{shape} span {span:6d} layers/iter {per_iter:3d}: temp {temp / 2**20:9.1f} MiB, "
                  f"{wall * 1e3:7.3f} ms ({moved / wall / 1e9:7.1f} GB/s), launch {rows[-1]['launch_ms']:.3f} ms",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--layers", default="1,4,8,0", help="layers per iteration to try (0: all in one slice)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a small cache (CPU smoke test)")
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.slots, args.max_context, args.repeats = "tiny", 2, 1024, 2
    import jax

    layer_settings = [int(x) for x in args.layers.split(",")]
    stamp = common.timestamp()
    rows = run(args.shape, args.slots, args.max_context, layer_settings, args.repeats)
    meta = {"device": common.device_info(), "git": common.git_rev(), "stamp": stamp, "argv": sys.argv[1:],
            "slots": args.slots, "max_context": args.max_context, "backend": jax.default_backend()}
    path = common.result_path(args.out, "prefix-copy", stamp)
    common.write_json(path, {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
