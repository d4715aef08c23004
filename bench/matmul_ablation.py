"""Where the q4_0 decode matmul's time goes: the production kernel against cut-down twins.

Each variant has the production Triton kernel's grid, tiling and loads (pallas_kernels/
matmul_triton.py, default tuning for the shape at M rows of x) and leaves out or changes one
thing, so the gaps between them say what costs:

  * `full`: the production kernel (qmatmul_triton).
  * `load`: only the loads of the weight planes (codes and scales), summed as integers: the
    bandwidth the loop's loads reach with no decoding and no tensor cores.
  * `decode`: loads and dequantization (codes to floats, one FMA per weight), summed without a dot.
  * `mma`: the production kernel's loop, restated here (so that it can take the tiled layout).
  * `mmabf`: `mma` with the dequantized tile narrowed to bf16 before its [BN, S, 16] -> [BN, S*16]
    reshape rather than after.
  * `prefetch`: the production kernel with each step's planes loaded one step ahead (carried in
    registers through the loop), in case the loads are not pipelined by Triton.
  * `mgpu_mma`: the Mosaic GPU decode kernel (pallas_kernels/matmul_mgpu.py): `block_k` sets its
    K step in elements (twice the variant's value: 128 -> 256), `num_stages` its steps in flight,
    `ctas` its target grid (`target_ctas`), `upcast=0` loads the codes in the wgmma layout
    rather than 32 bits per thread (`upcast_loads`), `words=0` converts the codes after moving them
    to the wgmma layout rather than word by word in place (`word_unpack`), `fold=1` scales each
    block's bf16 codes before the wgmmas rather than its f32 result after them (`fold_scales`),
    `tiles` sets the 64-row tiles per warpgroup (`row_tiles`), `i8=1` rounds x to int8 per 32-block
    and runs int8 wgmmas (`int8_x`), `rowsout=0` writes the partial sums as [split, N, M] rather
    than [split, M, N] (`rows_out`; either way the timed call returns [M, N]), `mtile` sets the
    rows of x per CTA beyond 64 rows (`m_tile`, with `fold=1`: the prefill regime). Cut-down
    twins, for timing only (wrong results): `noxor=1` (with `words=0`) converts the q4_0 codes
    without centring them, `noscale=1` sums the blocks' results unscaled (no scale loads),
    `noconv=1` feeds constant codes to the wgmmas (the codes still arrive in shared memory,
    unread). The runs of 2026-11-29 14:17 and
    14:19 used its first cut, written here, which read int4 codes and transposed scales
    repacked for it and took the layer as a compile-time constant.
  * `dense`: XLA's dot of x with a bf16 weight of the shape (one matrix, dequantized once,
    outside the timing): the bar for prefill rows (its kernel is the call's longest).
  * `mgpu_stream`: the planes streamed by TMA into shared memory by a Mosaic GPU kernel
    (`block_n` rows per CTA, `num_stages` steps in flight), nothing computed: the bar for `load`.

Times are the GPU kernels' own durations from a `jax.profiler` trace (CUPTI), over a stack of
`--layers` distinct matrices per shape (well past the 60 MB L2), read in place by layer index as
the engine does. `@tiled` reads the planes in a tile-major layout made for the test (each step's
[BN, S, 16] codes and [BN, S] scales contiguous).

    python3 bench/matmul_ablation.py --out "$OUT"
        [--shapes 22016x4096,12288x4096,4096x11008,4096x4096] [--m 8] [--layers 16]
        [--variants "full;load;load@tiled;mma:num_warps=2"]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from bench import common  # noqa: E402
from pallas_kernels import matmul_triton as mt  # noqa: E402
from pallas_kernels import quant  # noqa: E402
from pallas_kernels.matmul import qmatmul_reference  # noqa: E402

VARIANTS = ("full", "load", "decode", "mma", "mmabf", "prefetch", "mgpu_stream", "mgpu_mma", "dense")


def random_q4_0_stack(key, layers: int, n: int, k: int) -> quant.QuantizedTensor:
    qs = jax.random.randint(key, (layers, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    d = jax.random.uniform(jax.random.fold_in(key, 1), (layers, k // 32, n), jnp.float32, 1e-3, 0.05)  # transposed
    return quant.QuantizedTensor({"qs": qs, "d": d.astype(jnp.float16)}, "q4_0", (n, k))


def _ablation_kernel(x_ref, layer_ref, qs_ref, d_ref, out_ref, *, mode: str, s: int, steps: int, use_asm: bool,
                     x_rows: int, evict: bool):
    """q4_0 only. x_ref [2, BM, K/2] bf16 (parts split out, as the production kernel takes it),
    qs_ref [L, BN, K/32, 16] uint8, d_ref [L, BN, K/32] f16, out_ref [BM, BN] f32."""
    layer = layer_ref[0]
    codes = mt._Codes(use_asm)
    block_m, block_n = out_ref.shape
    base = pl.program_id(2) * steps  # this split's first step
    first = base * s
    tiled = qs_ref.ndim == 5  # [L, T, BN, S, 16]: each step's tile is one contiguous run

    def get(ref):
        return plt.load(ref, eviction_policy="evict_first") if evict else ref[...]

    def load(i):
        if tiled:
            t = base + i
            return get(qs_ref.at[layer, t, :, :, :]), get(d_ref.at[layer, t, :, :])
        g0 = pl.multiple_of(first + i * s, s)
        return get(qs_ref.at[layer, :, pl.ds(g0, s), :]), get(d_ref.at[layer, :, pl.ds(g0, s)])

    row_ok = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0) < x_rows if x_rows else None

    def weights(qs, d):  # the production kernel's dequantization: w = a f + b per part
        scale = d.astype(jnp.float32)
        a, b = 8.0 * scale, -24.0 * scale
        return [(h, codes.code(qs, 4 * h) * a[:, :, None] + b[:, :, None]) for h in range(2)]

    def dot(i, qs, d, acc):
        g0 = pl.multiple_of(first + i * s, s)
        for h, w in weights(qs, d):
            if row_ok is None:
                xp = x_ref[h, :, pl.ds(g0 * 16, s * 16)]
            else:  # padding rows of x are not fetched
                xp = plt.load(x_ref.at[jnp.int32(h), :, pl.ds(g0 * 16, s * 16)], mask=row_ok, other=0.0)
            if mode == "mmabf":  # narrow before the reshape
                wb = w.astype(x_ref.dtype).reshape(block_n, s * 16)
            else:
                wb = w.reshape(block_n, s * 16).astype(x_ref.dtype)
            acc = lax.dot_general(wb, xp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) + acc
        return acc

    if mode == "load":
        def step(i, carry):
            aq, ad = carry
            qs, d = load(i)
            return aq + qs.astype(jnp.int32), ad + d.astype(jnp.float32)

        aq, ad = lax.fori_loop(0, steps, step, (jnp.zeros((block_n, s, 16), jnp.int32),
                                                jnp.zeros((block_n, s), jnp.float32)))
        total = jnp.sum(jnp.sum(aq, axis=2).astype(jnp.float32) + ad, axis=1)  # [BN]
        out_ref[...] = jnp.broadcast_to(total[None, :], (block_m, block_n))
    elif mode == "decode":
        def step(i, acc):
            qs, d = load(i)
            for _, w in weights(qs, d):
                acc = acc + w
            return acc

        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_n, s, 16), jnp.float32))
        total = jnp.sum(jnp.sum(acc, axis=2), axis=1)
        out_ref[...] = jnp.broadcast_to(total[None, :], (block_m, block_n))
    elif mode in ("mma", "mmabf"):
        acc = lax.fori_loop(0, steps, lambda i, acc: dot(i, *load(i), acc),
                            jnp.zeros((block_n, block_m), jnp.float32))
        out_ref[...] = acc.T
    elif mode == "prefetch":
        def step(i, carry):
            acc, qs, d = carry
            nxt = load(jnp.minimum(i + 1, steps - 1))
            return (dot(i, qs, d, acc), *nxt)

        acc, _, _ = lax.fori_loop(0, steps, step, (jnp.zeros((block_n, block_m), jnp.float32), *load(0)))
        out_ref[...] = acc.T
    else:
        raise ValueError(mode)


@functools.partial(jax.jit, static_argnames=("mode", "tuning", "interpret", "tiled", "x_mask", "evict"))
def ablation_matmul(x2, w: quant.QuantizedTensor, layer_arr, *, mode: str, tuning: mt.TritonMatmulTuning,
                    interpret: bool = False, tiled: bool = False, x_mask: bool = False, evict: bool = False):
    n, k = w.shape
    m = x2.shape[0]
    bm, s = tuning.block_m, tuning.block_k // 32
    steps = (k // 32) // (s * tuning.split_k)
    m_pad = -(-m // bm) * bm
    xp = jnp.transpose(jnp.reshape(x2, (m, k // 32, 2, 16)), (2, 0, 1, 3)).reshape(2, m, k // 2)
    xp = jnp.pad(xp, ((0, 0), (0, m_pad - m), (0, 0)))
    views = mt._plane_views(w, mt.SPECS["q4_0"])
    if tiled:  # [L, N, K/32, 16] -> [L, N/BN, K/(32 S), BN, S, 16] (a copy; the layout under test)
        bn, layers = tuning.block_n, views["qs"].shape[0]
        qs = views["qs"].reshape(layers, n // bn, bn, k // 32 // s, s, 16).transpose(0, 1, 3, 2, 4, 5)
        d = views["d"].reshape(layers, n // bn, bn, k // 32 // s, s).transpose(0, 1, 3, 2, 4)
        views = {"qs": qs, "d": d}
        specs = [pl.BlockSpec((layers, None, *qs.shape[2:]), lambda i, j, s_: (0, i, 0, 0, 0, 0)),
                 pl.BlockSpec((layers, None, *d.shape[2:]), lambda i, j, s_: (0, i, 0, 0, 0))]
    else:
        specs = [mt._row_spec(v, tuning.block_n, 3) for v in views.values()]
    kernel = functools.partial(_ablation_kernel, mode=mode, s=s, steps=steps, use_asm=not interpret,
                               x_rows=m if x_mask and m_pad != m else 0, evict=evict)
    partial = pl.pallas_call(
        kernel,
        grid=(n // tuning.block_n, m_pad // bm, tuning.split_k),
        in_specs=[
            pl.BlockSpec((2, bm, k // 2), lambda i, j, s_: (0, j, 0)),
            pl.BlockSpec((1,), lambda i, j, s_: (0,)),
            *specs,
        ],
        out_specs=pl.BlockSpec((None, bm, tuning.block_n), lambda i, j, s_: (s_, j, i)),
        out_shape=jax.ShapeDtypeStruct((tuning.split_k, m_pad, n), jnp.float32),
        compiler_params=mt._TRITON_PARAMS(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=f"ablation_{mode}",
    )(xp, layer_arr, *views.values())[:, :m]
    return jnp.sum(partial, axis=0)


def mgpu_stream(qs2: jax.Array, d2: jax.Array, *, layer: int, n: int, block_n: int = 64, stages: int = 4):
    """Mosaic GPU: TMA-streams one layer's q4_0 planes (qs2 [L*N, K/2] uint8, d2 [L*N, K/32] f16,
    the stack's free 2-D views) through shared memory, `stages` steps in flight per CTA, one CTA
    per `block_n` rows, and computes nothing: the rate at which this backend's copy engine brings
    the planes on chip, for comparison with the Triton `load` variant."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # imports absl; only where it runs

    row_bytes = qs2.shape[1]
    step = next(b for b in (256, 128, 64, 32) if row_bytes % b == 0)  # bytes of codes per row per step

    def kernel(q_gmem, d_gmem, o_gmem):
        r0 = layer * n + lax.axis_index("rows") * block_n

        def body(idx, q_smem, d_smem):
            del idx, q_smem, d_smem

        plgpu.emit_pipeline(
            body, grid=(row_bytes // step,),
            in_specs=[plgpu.BlockSpec((block_n, step), lambda j: (0, j)),
                      plgpu.BlockSpec((block_n, step // 8), lambda j: (0, j))],
            max_concurrent_steps=stages,
        )(q_gmem.at[pl.ds(r0, block_n)], d_gmem.at[pl.ds(r0, block_n)])

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(n // block_n,),
                        grid_names=("rows",))(qs2, d2)


def parse_variant(spec: str, tuning: mt.TritonMatmulTuning):
    """`mode[@tiled][:key=value,...]` with keys of TritonMatmulTuning (block_n, block_k, split_k,
    num_warps, num_stages), `x_mask=1` (padding rows of x masked out of the loads, not fetched)
    and `evict=1` (weight loads marked evict-first in L2: streamed once)."""
    head, _, opts = spec.partition(":")
    mode, _, layout = head.partition("@")
    if mode not in VARIANTS:
        raise ValueError(f"unknown variant {mode!r}; have {VARIANTS}")
    if layout not in ("", "tiled"):
        raise ValueError(f"unknown layout {layout!r}")
    changes = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in opts.split(",") if kv}
    extra = {key: bool(changes.pop(key)) for key in ("x_mask", "evict") if key in changes}
    for key in ("ctas", "upcast", "words", "fold", "tiles", "i8", "rowsout", "mtile", "noxor", "noscale", "noconv"):  # mgpu_mma: see the module docstring
        if key in changes:
            extra[key] = changes.pop(key)
    if (extra.get("upcast") == 0 or extra.get("noxor")) and extra.get("words", 1):
        raise ValueError(f"{spec}: upcast=0 and noxor=1 are variants of the shuffle path: add words=0")
    if extra.get("noscale") and extra.get("fold"):
        raise ValueError(f"{spec}: noscale=1 cuts the scaling of the unfolded kernel; it cannot take fold=1")
    return mode, layout == "tiled", dataclasses.replace(tuning, **changes), extra


_MGPU_HELPERS = {}


def _ablate_mgpu(matmul_mgpu, *, noxor: bool, noscale: bool, noconv: bool) -> None:
    """Swap the Mosaic kernel's step helpers for cut-down ones (wrong results, timing only), or
    restore them; clears JAX's caches so that the next call traces the kernel again."""
    if not _MGPU_HELPERS:
        _MGPU_HELPERS.update(codes=matmul_mgpu._codes_bf16, scale=matmul_mgpu._scale_and_sum)
    plgpu = matmul_mgpu._plgpu()

    def codes_noxor(c_smem, fmt, *_):
        layout = plgpu.Layout.WGMMA_UPCAST_4X if matmul_mgpu.CODE_BITS[fmt] == 4 else plgpu.Layout.WGMMA_UPCAST_2X
        codes = plgpu.layout_cast(plgpu.load(c_smem, (), layout=layout), plgpu.Layout.WGMMA)
        return codes.astype(jnp.bfloat16)

    def codes_const(c_smem, fmt, *_):  # the codes still arrive by TMA, unread
        return plgpu.layout_cast(jnp.full(c_smem.shape, 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)

    def scale_none(acc, parts, d_smem):
        for part in parts:
            acc = acc + part
        return acc

    codes = codes_const if noconv else codes_noxor if noxor else _MGPU_HELPERS["codes"]
    scale = scale_none if noscale else _MGPU_HELPERS["scale"]
    if (codes, scale) != (matmul_mgpu._codes_bf16, matmul_mgpu._scale_and_sum):
        matmul_mgpu._codes_bf16, matmul_mgpu._scale_and_sum = codes, scale
        jax.clear_caches()


def run_variant(mode, tiled, extra, x, w, tuning):
    if mode == "mgpu_mma":
        from pallas_kernels import matmul_mgpu

        _ablate_mgpu(matmul_mgpu, noxor=bool(extra.get("noxor")), noscale=bool(extra.get("noscale")),
                     noconv=bool(extra.get("noconv")))

        mosaic = matmul_mgpu.MosaicMatmulTuning(tile_k=tuning.block_k * 2, stages=tuning.num_stages,
                                                target_ctas=extra.get("ctas", matmul_mgpu.DEFAULT_TUNING.target_ctas),
                                                upcast_loads=bool(extra.get("upcast", matmul_mgpu.DEFAULT_TUNING.upcast_loads)),
                                                word_unpack=bool(extra.get("words", matmul_mgpu.DEFAULT_TUNING.word_unpack)),
                                                fold_scales=bool(extra.get("fold", matmul_mgpu.DEFAULT_TUNING.fold_scales)),
                                                row_tiles=extra.get("tiles", matmul_mgpu.DEFAULT_TUNING.row_tiles),
                                                int8_x=bool(extra.get("i8", matmul_mgpu.DEFAULT_TUNING.int8_x)),
                                                rows_out=bool(extra.get("rowsout", matmul_mgpu.DEFAULT_TUNING.rows_out)),
                                                m_tile=extra.get("mtile", matmul_mgpu.DEFAULT_TUNING.m_tile))
        return lambda l: matmul_mgpu.qmatmul_mgpu(x, w, mosaic, layer=l)
    if mode == "mgpu_stream":
        layers, n, half = w.planes["qs"].shape
        qs2 = jnp.reshape(w.planes["qs"], (layers * n, half))
        d2 = jnp.reshape(quant.row_major_planes(w)["d"], (layers * n, -1))  # the bytes of the scales
        fn = jax.jit(mgpu_stream, static_argnames=("layer", "n", "block_n", "stages"))
        return lambda l: fn(qs2, d2, layer=l, n=n, block_n=tuning.block_n, stages=tuning.num_stages)
    if mode == "full":
        return lambda l: mt.qmatmul_triton(x, w, tuning, layer=l)
    if mode == "dense":  # one bf16 matrix per layer, like the stacks the others read, past L2
        layers = next(iter(w.planes.values())).shape[0]
        wds = [jax.block_until_ready(quant.dequantize_reference(
            quant.QuantizedTensor({p: v[l] for p, v in w.planes.items()}, w.fmt, w.shape)).astype(jnp.bfloat16))
            for l in range(layers)]  # [N, K] each
        dot = jax.jit(lambda x, wd: jnp.dot(x, wd.T, preferred_element_type=jnp.float32))
        return lambda l: dot(x, wds[l])
    return lambda l: ablation_matmul(x, w, jnp.reshape(jnp.asarray(l, jnp.int32), (1,)), mode=mode, tuning=tuning,
                                     tiled=tiled, **extra)


def kernel_times(log_dir: str) -> dict[str, list[float]]:
    """Microseconds of each device kernel call in the trace, by kernel name."""
    out = collections.defaultdict(list)
    for e in common.device_trace_events(log_dir) or []:
        out[e["name"]].append(float(e.get("dur", 0.0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="22016x4096,12288x4096,4096x11008,4096x4096")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="';'-separated mode[@tiled][:block_n=..,block_k=..,split_k=..,num_warps=..,num_stages=..]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy = common.copy_bandwidth_gb_s(4 << 30)
    print(f"{common.device_info()}  copy {copy:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = random_q4_0_stack(jax.random.key(n + k), args.layers, n, k)
        x = jax.random.normal(jax.random.key(3), (args.m, k), jnp.float32).astype(jnp.bfloat16)
        default = mt.default_tuning("q4_0", args.m, n, k, jnp.bfloat16)
        wbytes = quant.num_bytes(w) / args.layers
        ref = qmatmul_reference(x, quant.QuantizedTensor({p: v[1] for p, v in w.planes.items()}, "q4_0", (n, k)))
        for spec in args.variants.split(";"):
            mode, tiled, tuning, extra = parse_variant(spec, default)
            try:
                mt.check_tiling("q4_0", n, k, tuning)
            except ValueError as e:
                print(f"{shape} {spec}: skipped ({e})", flush=True)
                continue
            fn = run_variant(mode, tiled, extra, x, w, tuning)
            try:
                y = jax.block_until_ready(fn(1))
            except Exception as e:  # noqa: BLE001 - report the variant, go on
                print(f"{shape} {spec}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                rows.append({"n": n, "k": k, "variant": spec, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) if mode in ("full", "mma", "mmabf", "prefetch", "mgpu_mma", "dense") else None
            for rep in range(2):  # warm
                jax.block_until_ready([fn(l) for l in range(args.layers)])
            with tempfile.TemporaryDirectory() as d:
                jax.profiler.start_trace(d)
                for _ in range(args.repeats):
                    jax.block_until_ready([fn(l) for l in range(args.layers)])
                jax.profiler.stop_trace()
                times = kernel_times(d)
            if mode.startswith("mgpu"):
                print("  kernels in the trace:", {nm[:60]: len(v) for nm, v in times.items()}, flush=True)
            pattern = {"full": "qmatmul_mma", "mgpu_stream": "mosaic_gpu", "mgpu_mma": "mosaic_gpu"}.get(
                mode, "ablation_" + mode)
            key = next((nm for nm in times if pattern in nm), None)
            if mode == "dense" and times:  # XLA's GEMM kernel (cuBLAS or its own): the longest
                key = max(times, key=lambda nm: sum(times[nm]))
            if key is None:
                print(f"{shape} {spec}: kernel not found in {list(times)[:8]}", flush=True)
                continue
            us = sorted(times[key])
            med = us[len(us) // 2]
            read = 2 * n * k if mode == "dense" else wbytes  # the dense dot reads bf16 weights
            gbps = read / (med * 1e-6) / 1e9
            # the call's other kernels (x's permutation or int8 rounding, the split-K sum), per call
            other = sum(sum(v) for nm, v in times.items() if nm != key) / len(us)
            row = {"n": n, "k": k, "m": args.m, "variant": spec, "kernel": key[:80], "us_median": med,
                   "us_other_per_call": other,
                   "us_min": us[0], "calls": len(us), "gbps": gbps, "pct_copy": 100 * gbps / copy, "rel_err": err,
                   "tflops": 2 * args.m * n * k / (med * 1e-6) / 1e12,
                   "tuning": str(tuning)}
            rows.append(row)
            print(f"{shape:>11} {spec:>24}: {med:7.1f} us (min {us[0]:.1f}, {len(us)} calls) {gbps:6.0f} GB/s "
                  f"{row['pct_copy']:5.1f}% of copy {row['tflops']:6.1f} TFLOP/s  other {other:.1f} us  err {err}",
                  flush=True)
    if args.out:
        path = common.result_path(args.out, "ablation", common.timestamp())
        common.write_json(path, {**common.device_info(), "copy_gbps": copy, "args": vars(args), "rows": rows})
        print("wrote", path)


if __name__ == "__main__":
    main()
