"""Kernel benchmark: quantized matmul implementations against the device's own ceilings.

One command on the GPU machine measures (a) the copy bandwidth (a multi-GB device copy, bytes
read + written) and the bf16 matmul rate (8192^3), then (b) for every implementation x format x
shape x rows of x, the time of one matmul, with many distinct weight matrices per timed call
(well past the 60 MB L2, and enough bytes that the call's fixed cost is small), weights made at
random on the device. Each implementation is checked against `qmatmul_reference` before it is
timed; a wrong result is reported, never hidden. Results go to `<out>/kernels-<date>.json` and a
markdown table beside it; the table is printed last.

    python3 bench/kernels.py --out "$OUT"                       # GPU, all defaults
    python3 bench/kernels.py --formats q4_0,q4_k --ms 1,8 --sweep # fewer cases, tuning variants
    python3 bench/kernels.py --interpret --out /tmp/kb            # CPU smoke test, tiny shapes

JSON schema: {"gpu", "jax", "copy_gbps", "bf16_tflops", "call_overhead_us", "args", "rows": [{"op",
"format", "impl", "m", "n", "k", "us", "gbps", "pct_hbm", "tflops", "rel_err", "ok", "mats",
"tuning", "error"}]}. gbps counts the bytes of the weight planes + x + the f32 output once per
matmul; pct_hbm is gbps over the measured copy bandwidth.

`us` is wall clock per matmul by default: with the call's fixed cost subtracted, but with the
XLA work around each kernel (x's permutation, the split-K sum) and the launch gaps in it, which
for a decode matmul of a few microseconds is most of the figure (the H200, sixteenth session:
18.1 us for a 4096 x 4096 q4_0 matrix at M = 8 whose kernel took 6.4). `--device-time` takes
the times from a profiler trace of the same calls instead: `us` is then the matmul's longest
kernel (the kernel itself; its name in "kernel"), "us_device" all of its kernels, "us_wall" the
wall-clock figure, and gbps, pct_hbm and tflops follow `us`; "pct_hbm_device" and
"tflops_device" follow "us_device" (the table's note gives them where they differ by over 5%:
where part of the work, such as q4_k_split's offsets beside Q4_0's kernel, runs in another
kernel, `us` alone can exceed the copy rate).

Q4_K also runs split for Q4_0's kernels (`pallas_kernels/q4_k_split.py`): impl
"mosaic_gpu:q4_k_split" with `--impls mosaic_gpu` on a GPU, "reference:q4_k_split" with
`reference`; the split is made before timing, and gbps counts its planes (0.625 bytes per
weight). Q5_K likewise for Q8_0's ("mosaic_gpu:q5_k_split", `pallas_kernels/q5_k_split.py`,
1.125 bytes per weight), and Q4_1, Q5_1 and Q5_0 in the forms of `pallas_kernels/legacy_split.py`
("mosaic_gpu:q4_1_split", "mosaic_gpu:q5_1_split", "mosaic_gpu:q5_0_as_q8_0").

`--impls jax_triton` times the hand-written Triton kernels called through jax-triton
(`pallas_kernels/matmul_jax_triton.py`; needs the `jax_triton` and `triton` packages) on Q4_0,
Q8_0 and the same split forms ("jax_triton:q4_k_split", ..., "jax_triton:q6_k_split").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import pathlib
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Run as a file, Python puts bench/ first on sys.path, where bench/http.py would shadow the
# standard library's http (which jax imports): put the repository root there instead.
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from pallas_kernels import matmul_jax_triton, matmul_triton, quant  # noqa: E402
from pallas_kernels.matmul import qmatmul_reference  # noqa: E402

SHAPE_SETS = {  # (N, K) = (out_features, in_features)
    "llama2-7b": [(4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096)],
    "llama3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)],
}
TINY_SHAPES = [(64, 256), (32, 512)]  # --interpret
L2_BYTES = 60 << 20


# ---------------------------------------------------------------------------------------------
# inputs, made on the device


def random_weight(key: jax.Array, fmt: str, n: int, k: int) -> quant.QuantizedTensor:
    """Random planes with sane fields: f16 scales in [1e-3, 0.05] (mins of q4_1/q5_1 negative),
    K-quant 6-bit scales and mins in [0, 64), Q6_K scales in [-32, 32), codes uniform."""
    fmt_obj = quant.FORMATS[fmt]
    shapes, dtypes = fmt_obj.plane_shapes(n, k), fmt_obj.plane_dtypes()
    planes = {}
    for i, name in enumerate(fmt_obj.planes):
        sub = jax.random.fold_in(key, i)
        shape, dtype = shapes[name], dtypes[name]
        if dtype == np.float16:
            lo, hi = (-0.05, 0.0) if (name == "m" and fmt in ("q4_1", "q5_1")) else (1e-3, 0.05)
            planes[name] = jax.random.uniform(sub, shape, jnp.float32, lo, hi).astype(jnp.float16)
        elif dtype == np.uint8:
            hi = 64 if (name in ("sc", "m") and fmt in ("q4_k", "q5_k")) else 256
            planes[name] = jax.random.randint(sub, shape, 0, hi, jnp.int32).astype(jnp.uint8)
        elif dtype == np.int8:
            lo, hi = (-32, 32) if name == "sc" else (-128, 128)
            planes[name] = jax.random.randint(sub, shape, lo, hi, jnp.int32).astype(jnp.int8)
        else:
            planes[name] = jax.random.normal(sub, shape, jnp.float32).astype(dtype)
    return quant.QuantizedTensor(planes, fmt, (n, k))


_random_weight = jax.jit(random_weight, static_argnums=(1, 2, 3))


def plane_bytes(w) -> int:
    if isinstance(w, quant.QuantizedTensor):
        return quant.num_bytes(w)
    return int(w.size) * w.dtype.itemsize


# ---------------------------------------------------------------------------------------------
# timing


def median_time(fn, *args, runs: int) -> float:
    """Median wall time of fn(*args) in seconds, each run synchronized; one warm-up run first
    (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def call_overhead(runs: int) -> float:
    """Dispatch + synchronization cost of one jitted call doing almost nothing (subtracted from
    the timed calls)."""
    f = jax.jit(lambda a: a + 1)
    a = jnp.zeros((16,), jnp.float32)
    return median_time(f, a, runs=max(runs, 20))


def copy_bandwidth(num_bytes: int, runs: int) -> float:
    """GB/s of y = x + 1 over an f32 array of num_bytes (bytes read + written)."""
    n = num_bytes // 4
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    t = median_time(f, x, runs=runs)
    return 2 * n * 4 / t / 1e9


def bf16_matmul_rate(size: int, runs: int) -> float:
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (size, size), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (size, size), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    t = median_time(f, a, b, runs=runs)
    return 2 * size**3 / t / 1e12


# ---------------------------------------------------------------------------------------------
# implementations


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str  # "triton", "triton:<variant>", "mosaic_gpu", "reference", "dense_bf16"
    fn: object  # (x, w) -> [M, N] f32
    tuning: str = ""
    # w -> what `fn` takes in place of w, made once per weight before anything is timed (and
    # what the achieved GB/s counts): e.g. a Q4_K matrix split for the Q4_0 kernels
    prepare: object = None


# formats the bench runs through a split at load (`offset_split_impls`; Q6_K: `q6_k_split_impls`)
OFFSET_SPLIT_FORMATS = ("q4_k", "q5_k", "q4_1", "q5_0", "q5_1")


def offset_split_impls(fmt: str, impl_names: list[str], interpret: bool, m: int, variants: str = "",
                       extras: bool = True) -> list[Impl]:
    """Q4_K (and Q4_1) through Q4_0's kernels (`pallas_kernels.q4_k_split`), Q5_K (and Q5_1)
    through Q8_0's (`pallas_kernels.q5_k_split`), Q5_0 as Q8_0 (`pallas_kernels.legacy_split`):
    the Mosaic GPU kernel on a GPU (the offsets folded into the kernel's bf16 weights by default,
    in decode (`OFFSET_DECODE_TUNING`) as in prefill; in decode, as "...:unfolded", added by the
    kernel to its f32 block results with x's block sums made before it (`DEFAULT_TUNING`), and, as
    "...:offsets_after", in an XLA dot after the unfolded kernel; in prefill, as
    "...:offsets_after", in a dot after the folded kernel; where a tuning leaves the prefill
    offsets to the dot, a "...:fold_offsets" row folds them; and as "...:<tag>" under each tuning
    of --mosaic-variants), the reference with --interpret (a CPU check of the plumbing).
    `extras` False: the default form alone (no ":unfolded", ":offsets_after", ":fold_offsets")."""
    from pallas_kernels import legacy_split, matmul_mgpu, q4_k_split, q5_k_split

    split, tag = {"q4_k": (q4_k_split.split_q4_k, "q4_0 codes + bf16 offsets"),
                  "q5_k": (q5_k_split.split_q5_k, "int8 codes + f16 offsets"),
                  "q4_1": (legacy_split.split_q4_1, "q4_0 codes + bf16 offsets"),
                  "q5_1": (legacy_split.split_q5_1, "int8 codes + f16 offsets"),
                  "q5_0": (legacy_split.q5_0_as_q8_0, "q8_0 (exact)")}[fmt]

    form = "q5_0_as_q8_0" if fmt == "q5_0" else f"{fmt}_split"  # Q5_0's form has no offsets
    out = []
    if "mosaic_gpu" in impl_names and not interpret:
        out.append(Impl(f"mosaic_gpu:{form}", matmul_mgpu.qmatmul_mgpu, tag, prepare=jax.jit(split)))
        out += split_variant_impls(form, m, variants, tag, split, offsets=fmt != "q5_0")
        tuning = matmul_mgpu.default_tuning(m)  # the tuning of the formats without offsets
        if extras and fmt != "q5_0" and matmul_mgpu.default_tuning(m, offsets=True) != tuning:
            out.append(Impl(f"mosaic_gpu:{form}:unfolded", lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, tuning), tag,
                            prepare=jax.jit(split)))
        if extras and matmul_mgpu.fuses_offsets(tuning) and fmt != "q5_0":
            after = dataclasses.replace(tuning, fuse_offsets=False, fold_offsets=False)
            out.append(Impl(f"mosaic_gpu:{form}:offsets_after",
                            lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, after), tag, prepare=jax.jit(split)))
        if extras and tuning.fold_scales and not tuning.fold_offsets and fmt != "q5_0":
            folded = dataclasses.replace(tuning, fold_offsets=True)
            out.append(Impl(f"mosaic_gpu:{form}:fold_offsets",
                            lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, folded), tag, prepare=jax.jit(split)))
    if "jax_triton" in impl_names and not interpret:
        out.append(Impl(f"jax_triton:{form}", matmul_jax_triton.qmatmul_jax_triton, tag, prepare=jax.jit(split)))
    if "reference" in impl_names:
        out.append(Impl(f"reference:{form}", qmatmul_reference, tag, prepare=jax.jit(split)))
    return out


def split_variant_impls(form: str, m: int, variants: str, tag: str, split, offsets: bool = False) -> list[Impl]:
    """The Mosaic GPU kernel on a split form ("mosaic_gpu:<form>:<tag>") under each tuning of
    --mosaic-variants (fields over the default tuning for m rows, and for `offsets`)."""
    from pallas_kernels import matmul_mgpu

    default = matmul_mgpu.default_tuning(m, offsets, form)
    return [Impl(f"mosaic_gpu:{form}:{vtag}", lambda x, w, t=dataclasses.replace(default, **fields):
                 matmul_mgpu.qmatmul_mgpu(x, w, t), f"{tag}; {vtag}", prepare=jax.jit(split))
            for vtag, fields in parse_variants(variants, default)]


def q6_k_split_impls(impl_names: list[str], interpret: bool, m: int = 8, variants: str = "") -> list[Impl]:
    """Q6_K through the Mosaic GPU kernel's 8-bit path (`pallas_kernels.q6_k_split`: int8 codes,
    an f16 scale per 16 weights) and its 6-bit one ("q6_k_split6": the codes' 6 bits in two
    planes), also under each tuning of --mosaic-variants; the reference with --interpret."""
    from pallas_kernels import matmul_mgpu, q6_k_split

    def impl(name, fn):
        return Impl(name, fn, "int8 codes + f16 scales per 16", prepare=jax.jit(q6_k_split.split_q6_k))

    out = []
    if "mosaic_gpu" in impl_names and not interpret:
        out.append(impl("mosaic_gpu:q6_k_split", matmul_mgpu.qmatmul_mgpu))
        out += split_variant_impls("q6_k_split", m, variants, "int8 codes + f16 scales per 16", q6_k_split.split_q6_k)
        tag6 = "6-bit codes in 2 planes + f16 scales per 16"
        out.append(Impl("mosaic_gpu:q6_k_split6", matmul_mgpu.qmatmul_mgpu, tag6,
                        prepare=jax.jit(q6_k_split.split_q6_k6)))
        out += split_variant_impls("q6_k_split6", m, variants, tag6, q6_k_split.split_q6_k6)
    if "jax_triton" in impl_names and not interpret:
        out.append(impl("jax_triton:q6_k_split", matmul_jax_triton.qmatmul_jax_triton))
    if "reference" in impl_names:
        out.append(impl("reference:q6_k_split", qmatmul_reference))
    return out


def triton_impls(fmt: str, m: int, n: int, k: int, x_dtype, interpret: bool, sweep: bool,
                 grid: bool = False) -> list[Impl]:
    base = matmul_triton.default_tuning(fmt, m, n, k, x_dtype)
    tunings = [("triton", base)]
    if sweep:
        tunings += [(f"triton:{tag}", t) for tag, t in sweep_variants(base, fmt, m, n, k)]
    if grid:
        tunings += [(f"triton:{tag}", t) for tag, t in grid_variants(base, fmt, m, n, k) if t != base]
    out = []
    for name, t in tunings:
        fn = (lambda t: lambda x, w: matmul_triton.qmatmul_triton(x, w, t, interpret=interpret))(t)
        out.append(Impl(name, fn, tuning_tag(t)))
    return out


def parse_variants(spec: str, base) -> list[tuple[str, dict]]:
    """--mosaic-variants 'tag:field=v,field=v;tag2:...' -> [(tag, fields)], each field read as
    `base`'s (bench.common.parse_tuning_fields)."""
    out = []
    for item in filter(None, (t.strip() for t in spec.split(";"))):
        tag, sep, fields = item.partition(":")
        if not sep or not tag.strip():
            raise ValueError(f"{item!r}: expected TAG:FIELD=VALUE,...")
        out.append((tag.strip(), common.parse_tuning_fields(fields, base)))
    return out


def mosaic_impls(sweep: bool, m: int, variants: str = "") -> list[Impl]:
    """The Mosaic GPU kernel at its default tuning for the rows of x (`default_tuning`: decode up
    to 64 rows, prefill beyond), with --sweep the decode tuning's neighbours (CTAs per SM (K
    split, and splits that divide the K steps evenly), steps in flight, K step, the code loads and
    the q4_0 unpacking), and the tunings named by --mosaic-variants (fields over the default
    tuning for these rows)."""
    from pallas_kernels import matmul_mgpu

    base = matmul_mgpu.DEFAULT_TUNING
    tunings = [("mosaic_gpu", None)]
    default = matmul_mgpu.default_tuning(m)
    for tag, fields in parse_variants(variants, default):
        tunings.append((f"mosaic_gpu:{tag}", dataclasses.replace(default, **fields)))
    if sweep and m <= matmul_mgpu.MAX_ROWS:  # the neighbours are decode tunings (unfolded scales)
        for tag, kw in [("ctas132", dict(target_ctas=132)), ("ctas192", dict(target_ctas=192)),
                        ("ctas264", dict(target_ctas=264)), ("ctas320", dict(target_ctas=320)),
                        ("ctas396", dict(target_ctas=396)),
                        ("ctas528", dict(target_ctas=528)), ("stages3", dict(stages=3)), ("stages6", dict(stages=6)),
                        ("tile512", dict(tile_k=512, stages=3)), ("wgmma_loads", dict(upcast_loads=False, word_unpack=False)),
                        ("shuffle_unpack", dict(word_unpack=False)), ("rows2", dict(row_tiles=2)),
                        ("rows2_split1", dict(row_tiles=2, target_ctas=1)), ("even_split", dict(even_split=True))]:
            tunings.append((f"mosaic_gpu:{tag}", dataclasses.replace(base, **kw)))
    return [Impl(name, lambda x, w, t=t: matmul_mgpu.qmatmul_mgpu(x, w, t), str(t or matmul_mgpu.default_tuning(m)))
            for name, t in tunings]


def jax_triton_impls(m: int, n: int, k: int, sweep: bool = False) -> list[Impl]:
    """The hand-written Triton kernels through jax-triton (`pallas_kernels.matmul_jax_triton`) at
    their default tuning for the shape, and with --sweep its neighbours that still tile it
    ("jax_triton:<change>": tile sizes, K split, warps, pipeline stages)."""
    base = matmul_jax_triton.default_tuning(m, n, k)
    tunings = [("jax_triton", base)]
    if sweep:
        halves_doubles = [(f"{tag}{op}", {field: max(1, v // 2) if op == "/2" else v * 2})
                          for field, tag in (("block_n", "bn"), ("block_k", "bk"), ("split_k", "sk"),
                                             ("num_warps", "w"), ("block_m", "bm"), ("num_stages", "st"))
                          for v in [getattr(base, field)] for op in ("/2", "*2")]
        for tag, kw in halves_doubles:
            try:
                t = dataclasses.replace(base, **kw)
                matmul_jax_triton.check_tiling(n, k, t)
            except ValueError:
                continue
            if all(t != c for _, c in tunings):
                tunings.append((f"jax_triton:{tag}", t))
    return [Impl(name, lambda x, w, t=t: matmul_jax_triton.qmatmul_jax_triton(x, w, t),
                 f"bm{t.block_m} bn{t.block_n} bk{t.block_k} sk{t.split_k} w{t.num_warps} s{t.num_stages}")
            for name, t in tunings]


def tuning_tag(t: matmul_triton.TritonMatmulTuning) -> str:
    tag = f"{t.kernel} bn{t.block_n} bk{t.block_k} sk{t.split_k} w{t.num_warps} s{t.num_stages}"
    if t.kernel == "mma":
        tag += f" bm{t.block_m}"
    return tag + ("" if t.use_asm else " noasm")


def sweep_variants(base, fmt, m, n, k):
    """Neighbours of the default tuning that still tile the shape (a small local search)."""
    unit = matmul_triton.SPECS[fmt].unit
    units = k // unit
    cands = []

    def add(tag, **kw):
        try:
            t = dataclasses.replace(base, **kw)
        except ValueError:
            return
        s = t.block_k // unit
        if t.block_k % unit or n % t.block_n or units % (s * t.split_k):
            return
        if t != base and all(t != c for _, c in cands):
            cands.append((tag, t))

    add("bn/2", block_n=base.block_n // 2)
    add("bn*2", block_n=base.block_n * 2)
    add("bk/2", block_k=base.block_k // 2)
    add("bk*2", block_k=base.block_k * 2)
    add("sk/2", split_k=max(1, base.split_k // 2))
    add("sk*2", split_k=base.split_k * 2)
    add("sk1", split_k=1)
    add("w/2", num_warps=max(1, base.num_warps // 2))
    add("w*2", num_warps=base.num_warps * 2)
    add("st*", num_stages=3 if base.num_stages == 1 else 1)
    add("noasm", use_asm=False)
    if m <= 64:
        other = "mma" if base.kernel == "fma" else "fma"
        add(other, kernel=other, block_m=max(16, base.block_m), num_stages=3 if other == "mma" else 1)
    else:
        add("bm/2", block_m=base.block_m // 2)
        add("bm*2", block_m=base.block_m * 2)
    return cands


def _divisors(v: int) -> list[int]:
    return [d for d in range(1, v + 1) if v % d == 0]


def grid_variants(base, fmt, m, n, k, sms: int = 132):
    """A wider search than `sweep_variants` for one kernel: block_n x block_k x num_stages, each
    with the split-K (any divisor of the K steps) nearest to 1, 2 and 4 programs per SM."""
    unit = matmul_triton.SPECS[fmt].unit
    units = k // unit
    out, seen = [], set()
    for bn in (32, 64, 128):
        for bk in (128, 256, 512, 1024):
            if n % bn or bk % unit or units % (bk // unit):
                continue
            steps = units // (bk // unit)
            for stages in (2, 4):
                for per_sm in (1, 2, 4):
                    split = min(_divisors(steps), key=lambda d: abs((n // bn) * d - per_sm * sms))
                    try:
                        t = dataclasses.replace(base, block_n=bn, block_k=bk, split_k=split, num_stages=stages)
                    except ValueError:
                        continue
                    if t not in seen:
                        seen.add(t)
                        out.append((f"bn{bn}-bk{bk}-sk{split}-s{stages}", t))
    return out


# ---------------------------------------------------------------------------------------------
# one case


def rel_error(y: jax.Array, ref: jax.Array) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(y).all():
        return float("nan")
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def calls_of(impl: Impl):
    """One jitted call of impl on every weight (distinct matrices, in order)."""
    return jax.jit(lambda x, ws: [impl.fn(x, w) for w in ws])


def time_impl(f, x, weights, runs: int, overhead: float) -> float:
    """Seconds per matmul of `calls_of(impl)` on `weights`, wall clock less the call's fixed cost."""
    t = median_time(f, x, weights, runs=runs)
    return max(t - overhead, 1e-9) / len(weights)


def device_times(f, x, weights, runs: int) -> dict:
    """Per matmul, from a profiler trace of `runs` calls of `calls_of(impl)`: "us_kernel", the
    device time of the call's longest kernel (by total; the matmul kernel, one per matrix, named
    in "kernel"), and "us_device", all of its kernels (launch gaps and the host excluded); {}
    when the trace has no device events (the CPU)."""
    jax.block_until_ready(f(x, weights))
    return per_matmul(common.traced_device_events(lambda: f(x, weights), runs), runs * len(weights))


def per_matmul(events: list[dict], matmuls: int) -> dict:
    """`device_times`' figures from a trace's device events covering `matmuls` matmuls."""
    if not events:
        return {}
    by_name: dict[str, float] = collections.defaultdict(float)
    for e in events:
        by_name[e["name"]] += float(e.get("dur", 0.0))
    main = max(by_name, key=by_name.__getitem__)
    return {"us_kernel": by_name[main] / matmuls, "us_device": sum(by_name.values()) / matmuls, "kernel": main[:80]}


def num_matrices(w_bytes: int, args) -> int:
    """Enough distinct matrices that one call reads >= args.call_bytes (and 3x the L2)."""
    want = max(args.call_bytes, 3 * L2_BYTES)
    return int(min(args.max_mats, max(args.mats, math.ceil(want / max(w_bytes, 1)))))


def run_case(fmt, n, k, ms, impl_names, args, ceilings, rows, deadline):
    key = jax.random.key(hash((fmt, n, k)) & 0x7FFFFFFF)
    probe = _random_weight(key, fmt, n, k)
    w_bytes = plane_bytes(probe)
    mats = num_matrices(w_bytes, args)
    weights = [probe] + [_random_weight(jax.random.fold_in(key, i), fmt, n, k) for i in range(1, mats)]
    dense = None
    x_dtype = jnp.float32 if args.x_dtype == "f32" else jnp.bfloat16
    tol = 1e-4 if args.x_dtype == "f32" else 2e-2
    # a split made before timing (`Impl.prepare`) rounds its scales and offsets (bf16 for the 4-bit
    # splits: 1.8e-3 in relative norm on these weights), which f32 x resolves
    split_tol = max(tol, 5e-3)
    for m in ms:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(x_dtype)
        ref = jax.jit(qmatmul_reference)(x, probe)
        impls = []
        # --defaults-only: no variant rows are made, nor the bare rows of the kernels that take
        # this format only split (each an error row)
        sweep, grid, variants = (False, False, "") if args.defaults_only else (args.sweep, args.grid,
                                                                             args.mosaic_variants)
        runs_split = fmt in OFFSET_SPLIT_FORMATS or fmt == "q6_k"
        for name in impl_names:
            if name == "triton":
                impls += triton_impls(fmt, m, n, k, x_dtype, args.interpret, sweep, grid)
            elif name == "mosaic_gpu" and not (args.defaults_only and runs_split):
                # q4_0/q8_0 (the splits below); other cases report its NotImplementedError
                impls += mosaic_impls(sweep, m, variants)
            elif name == "jax_triton" and not (args.defaults_only and runs_split):  # q4_0/q8_0 (the splits below)
                impls += jax_triton_impls(m, n, k, sweep)
            elif name == "reference":
                impls.append(Impl("reference", qmatmul_reference, "xla dequant + dot (HIGHEST)"))
            elif name == "dense_bf16":
                impls.append(Impl("dense_bf16", lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.T,
                                                                     preferred_element_type=jnp.float32),
                                  "bf16 weights, xla dot"))
        if fmt in OFFSET_SPLIT_FORMATS:
            impls += offset_split_impls(fmt, impl_names, args.interpret, m, variants, extras=not args.defaults_only)
        if fmt == "q6_k":
            impls += q6_k_split_impls(impl_names, args.interpret, m, variants)
        for impl in impls:
            if time.monotonic() > deadline:
                rows.append(dict(op="matmul", format=fmt, impl=impl.name, m=m, n=n, k=k, error="skipped: --budget-s"))
                continue
            row = dict(op="matmul", format=fmt if impl.name != "dense_bf16" else "bf16", impl=impl.name, m=m, n=n,
                       k=k, tuning=impl.tuning, mats=mats)
            try:
                if impl.name == "dense_bf16":
                    if dense is None:
                        dk = jax.random.fold_in(key, 999)
                        dense = [jax.random.normal(jax.random.fold_in(dk, i), (n, k), jnp.float32).astype(jnp.bfloat16)
                                 for i in range(num_matrices(n * k * 2, args))]
                    ws, row["rel_err"], row["ok"] = dense, None, None
                    row["mats"] = len(dense)
                else:
                    prepare = impl.prepare or (lambda w: w)
                    y = jax.jit(impl.fn)(x, prepare(probe))
                    err = rel_error(y, ref)
                    row["rel_err"], row["ok"] = err, bool(err <= (tol if impl.prepare is None else split_tol))
                    # the XLA reference is slow (tiled dequantize + dot): fewer matrices keep the
                    # run short, and its time is far above the launch cost anyway
                    ws = weights if not impl.name.startswith("reference") else weights[: args.ref_mats]
                    ws = [prepare(w) for w in ws]
                    row["mats"] = len(ws)
                f = calls_of(impl)
                t = time_impl(f, x, ws, args.runs, ceilings["call_overhead_s"])
                if args.device_time:
                    dev = device_times(f, x, ws, args.runs)
                    row["us_wall"] = t * 1e6
                    if dev:
                        row.update(us_device=dev["us_device"], kernel=dev["kernel"])
                        t = dev["us_kernel"] * 1e-6
                    else:
                        row["device_error"] = "no device events in the trace"
                moved = plane_bytes(ws[0]) + x.size * x.dtype.itemsize + m * n * 4
                row["us"] = t * 1e6
                row["gbps"] = moved / t / 1e9
                row["pct_hbm"] = 100 * row["gbps"] / ceilings["copy_gbps"]
                row["tflops"] = 2 * m * n * k / t / 1e12
                if "us_device" in row:  # the same bytes and flops over all of the call's kernels
                    row["pct_hbm_device"] = 100 * moved / row["us_device"] / 1e3 / ceilings["copy_gbps"]
                    row["tflops_device"] = 2 * m * n * k / row["us_device"] / 1e6
            except Exception as e:  # noqa: BLE001 - one failing kernel must not end the run
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc(limit=3)
            rows.append(row)
            print(fmt_row(row), flush=True)
            write_results(args, ceilings, rows)
    del weights, dense


# ---------------------------------------------------------------------------------------------
# output


COLUMNS = ["format", "impl", "m", "n", "k", "us", "gbps", "pct_hbm", "tflops", "rel_err", "note"]


def fmt_row(r: dict) -> str:
    def num(v, f):
        return "" if v is None else (f % v if isinstance(v, (int, float)) else str(v))

    note = r.get("error") or ("" if r.get("ok", True) in (True, None) else "WRONG")
    if r.get("impl", "").startswith(("triton", "jax_triton")) and r.get("tuning"):
        note = (note + " " if note else "") + r["tuning"]
    if r.get("us_device") and r.get("us") and r["us_device"] > 1.05 * r["us"]:
        # work outside the kernel (x's permutation, the split-K sum, q4_k_split's offsets as an
        # XLA dot): the kernel's own figures alone would flatter it
        note = (note + " " if note else "") + (f"all kernels {r['us_device']:.1f} us, {r['pct_hbm_device']:.1f}% "
                                               f"of copy, {r['tflops_device']:.2f} TFLOP/s")
    cells = [r.get("format", ""), r.get("impl", ""), str(r.get("m", "")), str(r.get("n", "")), str(r.get("k", "")),
             num(r.get("us"), "%.1f"), num(r.get("gbps"), "%.0f"), num(r.get("pct_hbm"), "%.1f"),
             num(r.get("tflops"), "%.2f"), num(r.get("rel_err"), "%.1e"), note]
    return "| " + " | ".join(cells) + " |"


def markdown(ceilings: dict, rows: list[dict]) -> str:
    timing = ("us: the matmul kernel's own time from a profiler trace" if any("us_device" in r for r in rows)
              else "us: wall clock per matmul")
    head = (f"GPU {ceilings['gpu']}, jax {ceilings['jax']}: copy {ceilings['copy_gbps']:.0f} GB/s, "
            f"bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s, call overhead "
            f"{ceilings['call_overhead_s'] * 1e6:.0f} us (subtracted from wall clock); {timing}\n\n")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return head + "\n".join(lines + [fmt_row(r) for r in rows]) + "\n"


def write_results(args, ceilings, rows):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": ceilings["gpu"], "jax": ceilings["jax"], "copy_gbps": ceilings["copy_gbps"],
           "bf16_tflops": ceilings["bf16_tflops"], "call_overhead_us": ceilings["call_overhead_s"] * 1e6,
           "args": vars(args), "rows": rows}
    (out / f"kernels-{args.stamp}.json").write_text(json.dumps(doc, indent=1))
    (out / f"kernels-{args.stamp}.md").write_text(markdown(ceilings, rows))


# ---------------------------------------------------------------------------------------------


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    for item in spec.split(","):
        if item in SHAPE_SETS:
            shapes += SHAPE_SETS[item]
        else:
            n, k = item.lower().split("x")
            shapes.append((int(n), int(k)))
    return list(dict.fromkeys(shapes))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--formats", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--shapes", default=None, help="comma list of NxK or set names: " + ", ".join(SHAPE_SETS))
    ap.add_argument("--ms", default=None, help="rows of x, comma list (default 1,8,512; --interpret 1,8,20)")
    ap.add_argument("--impls", default="triton,reference", help="triton, mosaic_gpu, jax_triton, reference, dense_bf16")
    ap.add_argument("--x-dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--device-time", action="store_true",
                    help="us from a profiler trace: the matmul's own kernel, not the wall clock (GPU)")
    ap.add_argument("--sweep", action="store_true", help="also time neighbours of the default triton, mosaic_gpu and jax_triton tunings")
    ap.add_argument("--mosaic-variants", default="",
                    help="more mosaic_gpu tunings to time: 'tag:field=value,...;tag2:...' over the default tuning")
    ap.add_argument("--grid", action="store_true", help="also time a grid of block sizes, stages and split-K")
    ap.add_argument("--defaults-only", action="store_true",
                    help="only each implementation's default form of a format (issue 5's table in one call): no "
                         "tuning variant rows, no bare rows of kernels that take the format only split")
    ap.add_argument("--mats", type=int, default=16, help="at least this many distinct weights per call")
    ap.add_argument("--max-mats", type=int, default=256)
    ap.add_argument("--ref-mats", type=int, default=16, help="matrices per call for the reference impl")
    ap.add_argument("--call-bytes", type=float, default=1.5e9, help="weight bytes read per timed call")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip the cases left after this long")
    ap.add_argument("--copy-gb", type=float, default=4.0, help="size of the copy test array")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test: Pallas interpret mode, tiny shapes")
    args = ap.parse_args(argv)
    if args.mosaic_variants:  # a typo fails here, not after the GPU's ceilings are measured
        from pallas_kernels import mgpu_tuning
        parse_variants(args.mosaic_variants, mgpu_tuning.DEFAULT_TUNING)
    args.stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    t_start = time.monotonic()
    if args.interpret:
        shapes = parse_shapes(args.shapes) if args.shapes else TINY_SHAPES
        ms = [int(v) for v in (args.ms or "1,8,20").split(",")]
        args.mats, args.max_mats, args.call_bytes, args.runs = 2, 2, 0, min(args.runs, 2)
        copy_bytes, mm_size = 1 << 20, 256
    else:
        shapes = parse_shapes(args.shapes or "llama2-7b,llama3-8b")
        ms = [int(v) for v in (args.ms or "1,8,512").split(",")]
        copy_bytes, mm_size = int(args.copy_gb * 1e9) // 2, 8192  # half read, half written
    formats = args.formats.split(",")
    impl_names = args.impls.split(",")
    for f in formats:
        if f not in matmul_triton.SUPPORTED_FORMATS:
            ap.error(f"unknown format {f}; triton takes {', '.join(matmul_triton.SUPPORTED_FORMATS)}")
    device = jax.devices()[0]
    print(f"device {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    ceilings = {"gpu": device.device_kind, "jax": jax.__version__}
    ceilings["call_overhead_s"] = call_overhead(args.runs)
    ceilings["copy_gbps"] = copy_bandwidth(copy_bytes, runs=max(args.runs, 20) if not args.interpret else 2)
    ceilings["bf16_tflops"] = bf16_matmul_rate(mm_size, runs=max(args.runs, 10) if not args.interpret else 2)
    print(f"copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['bf16_tflops']:.1f} TFLOP/s, "
          f"call overhead {ceilings['call_overhead_s'] * 1e6:.0f} us", flush=True)
    rows: list[dict] = []
    deadline = t_start + args.budget_s
    print("| " + " | ".join(COLUMNS) + " |", flush=True)
    for fmt in formats:
        for n, k in shapes:
            run_case(fmt, n, k, ms, impl_names, args, ceilings, rows, deadline)
    write_results(args, ceilings, rows)
    out = pathlib.Path(args.out)
    print(f"\nwrote {out / f'kernels-{args.stamp}.json'} ({time.monotonic() - t_start:.0f} s)\n")
    print(markdown(ceilings, rows))


if __name__ == "__main__":
    main()
