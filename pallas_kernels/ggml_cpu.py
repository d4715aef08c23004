"""ggml's CPU arithmetic, rounding for rounding, in JAX: the `--numerics ggml` CPU path.

llama.cpp's CPU build rounds every matmul's activations to 8 bits, keeps an f16 cache and, in
one of its attention paths, an f16 accumulator. A float implementation that differs from it in a
single last bit moves some activation across an 8-bit rounding step, and greedy generations then
part within a few tokens (tests/fixtures/README.md). These ops reproduce the arithmetic of
llama.cpp's x86-64 CPU build made with `GGML_NATIVE=OFF` (AVX2, FMA, F16C; no AVX-512), the
build the fixtures record, so that greedy tokens match it: every rounding, in ggml's order.
`tests/fixtures/replay_ggml.py` is the same recipe in numpy, checked op by op against
llama.cpp's own tensors; the comments there say which ggml function each op follows.

How XLA on the CPU is made to round as ggml does (each checked by tests/pallas_kernels/
test_ggml_cpu.py, so that a jax whose code generation differs fails loudly):
- XLA contracts an f32 `a * b + c` (one product, one sum) into an FMA by itself: the hot
  loops are written so. Where a sum would have two f32 products and ggml fuses only one of
  them, the f64 form `fma(a, b, c)` says which: the product exact in f64, one rounding of the
  sum (then to f32: a second rounding that differs from a single one only in cases too rare to
  meet); `add`, `mul` and the like likewise keep XLA's algebraic simplifier from regrouping.
- An f32 `dot` is a chain of FMAs over the contraction in order (XLA's CPU dot for these
  sizes), which is what ggml's tiled attention computes.
- libm's expf (glibc's algorithm, in f64) where ggml calls expf, ggml's vector expf where it
  calls that; cos/sin tables from the C library itself, made once on the host.

Scope: Q4_1 and Q8_0 matrices (Q4_0's are repacked by that build into another order of sums;
other formats raise NotImplementedError), the llama arch's RMS norm, RoPE (adjacent pairs or
NeoX halves, no scaling), SwiGLU, and attention over an f16 cache. It is a CPU path for
correctness, far slower than the reference (every block's sum kept per lane, the f16
accumulator's chain of roundings stepped cell by cell).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import registry
from pallas_kernels.quant import QuantizedTensor, layer_of, row_major_planes

f32, f64 = jnp.float32, jnp.float64

# llama.cpp's thread count in the run being matched, unless the attention ops are given theirs: a
# decode step over 512 or more cache cells splits the cells between the threads (the fixtures
# record 2). Nothing else in its arithmetic depends on it (threads split rows, not sums).
GGML_THREADS = 2
# llama.cpp pads the cache cells a step attends to (n_kv) to a multiple of this (at least once).
KV_PAD = 256
# A ubatch of at least this many query rows takes ggml's tiled attention (its Q tile), and the
# tiles of keys are this long (its KV tile).
TILE = 64


def _x64(fn: Callable) -> Callable:
    """Runs fn with 64-bit types enabled (under jit too: what it traces may use f64)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.enable_x64(True):
            return fn(*args, **kwargs)

    return wrapped


def _up(x) -> jax.Array:
    """An f32 value in f64 (under `_x64`). XLA may compute the f32 op that made it in f64 instead
    (it moves the conversion before a multiply): rounding it to f32's precision again keeps it
    the f32 result."""
    return jax.lax.reduce_precision(jnp.asarray(x, f32).astype(f64), exponent_bits=8, mantissa_bits=23)


@_x64
def fma(a, b, c) -> jax.Array:
    """f32 fused multiply-add: round(a * b + c) once (the product is exact in f64)."""
    return (_up(a) * _up(b) + _up(c)).astype(f32)


# One f32 op, rounded once: taken in f64 on f32 values and rounded to f32, which is exactly the
# f32 op for +, -, * and / (f64 holds the exact product; for sums and quotients the second
# rounding is innocuous). Written so, XLA's simplifier cannot regroup it with its neighbours.
@_x64
def add(a, b) -> jax.Array:
    return (_up(a) + _up(b)).astype(f32)


@_x64
def sub(a, b) -> jax.Array:
    return (_up(a) - _up(b)).astype(f32)


@_x64
def mul(a, b) -> jax.Array:
    return (_up(a) * _up(b)).astype(f32)


@_x64
def div(a, b) -> jax.Array:
    return (_up(a) / _up(b)).astype(f32)


def f16_round(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float16).astype(f32)


# ---- expf --------------------------------------------------------------------------------------

# glibc's expf (the ARM optimized-routines algorithm): 2^(k/32) from a table, a cubic in f64.
_EXP_N = 32
_EXP_TABLE = np.array(
    [int(np.float64(2.0 ** (i / _EXP_N)).view(np.uint64)) - (i << (52 - 5)) for i in range(_EXP_N)], np.uint64)
_EXP_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXP_N
_EXP_SHIFT = float.fromhex("0x1.8p+52")
_EXP_POLY = (float.fromhex("0x1.c6af84b912394p-5") / _EXP_N ** 3, float.fromhex("0x1.ebfce50fac4f3p-3") / _EXP_N ** 2,
             float.fromhex("0x1.62e42ff0c52d6p-1") / _EXP_N)


@_x64
def libm_expf(x: jax.Array) -> jax.Array:
    """expf as glibc computes it (its FMA variant, which x86-64 machines with FMA run)."""
    x = jnp.asarray(x, f32)
    xd = _up(x)
    z = xd * _EXP_INVLN2N
    # glibc rounds z to an integer k by adding and subtracting 1.5 * 2^52 (ties to even); XLA's
    # simplifier would fold that pair away, so round() says the same thing
    kd = jnp.round(z)
    ki = kd.astype(jnp.int64).astype(jnp.uint64)
    r = z - kd
    t = jnp.asarray(_EXP_TABLE)[(ki % _EXP_N).astype(jnp.int32)] + (ki << np.uint64(52 - 5))
    s = jax.lax.bitcast_convert_type(t, f64)
    c0, c1, c2 = (jnp.asarray(c, f64) for c in _EXP_POLY)
    y = _fma64(_fma64(c0, r, c1), r * r, _fma64(c2, r, jnp.asarray(1.0, f64))) * s
    out = y.astype(f32)
    out = jnp.where(x > float.fromhex("0x1.62e42ep6"), jnp.inf, out)
    out = jnp.where(x < float.fromhex("-0x1.9fe368p6"), 0.0, out)  # also -inf
    return jnp.where(jnp.isnan(x), x, out)


def _fma64(a, b, c):
    """An f64 fused multiply-add, by XLA's contraction of `a * b + c` (checked by the tests
    against the C library's expf, which needs it)."""
    return a * b + c


_VEXP = {name: np.float32(float.fromhex(h)) for name, h in (
    ("shift", "0x1.8p23"), ("log2e", "0x1.715476p+0"), ("ln2_hi", "0x1.62e4p-1"), ("ln2_lo", "0x1.7f7d1cp-20"),
    ("c4", "0x1.0e4020p-7"), ("c3", "0x1.573e2ep-5"), ("c2", "0x1.555e66p-3"), ("c1", "0x1.fffdb6p-2"),
    ("c0", "0x1.ffffecp-1"))}


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(i):
    return jax.lax.bitcast_convert_type(i, f32)


def vector_expf(x: jax.Array) -> jax.Array:
    """ggml_v_expf (AVX2): ggml's own vector exp, used by its SwiGLU and softmax."""
    x = jnp.asarray(x, f32)
    c = _VEXP
    # z = fma(x, log2e, 1.5 * 2^23) holds n = round-half-even(x * log2e) in its low bits and
    # n = z - 1.5 * 2^23; XLA's simplifier would fold the add and subtract of the constant, so
    # n is rounded directly (the product exact in f64, as in the fma)
    with jax.enable_x64(True):
        n = jnp.round(_up(x) * np.float64(c["log2e"])).astype(f32)
    # Each of ggml's FMAs below is an f32 `a * b + c` whose addend is no product, which XLA
    # contracts into one FMA (test_xla_contracts_one_product_and_sum); the one addend that is a
    # product ggml rounds first, c0 * b, is `mul`, so that XLA cannot contract it instead. (The
    # f64 `fma` for every one of them made ggml's softmax 6x slower here, for the same bits.)
    b = -n * c["ln2_lo"] + (-n * c["ln2_hi"] + x)
    e = jnp.where(jnp.isfinite(n), n, 0).astype(jnp.int32) << 23
    k = _float(e + _bits(jnp.float32(1)))
    u = b * b
    j = ((c["c4"] * b + c["c3"]) * u + (c["c2"] * b + c["c1"])) * u + mul(c["c0"], b)
    normal = k * j + k
    g = jnp.where(n <= 0, jnp.int32(np.uint32(0x82000000).view(np.int32)), jnp.int32(0))
    s1 = _float(g + jnp.int32(0x7F000000))
    s2 = _float(e - g)
    wide = jnp.where(jnp.abs(n) > 192, s1 * s1, (s2 * j + s2) * s1)
    return jnp.where(jnp.abs(n) > 126, wide, normal)


# ---- matmul ------------------------------------------------------------------------------------

@_x64
def quantize_q8(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """quantize_row_q8_1 / q8_0 (AVX2) of x [..., K] -> per 32-block d (f16, as f32) [..., K/32],
    codes [..., K/32, 32] (f32 integers) and s = f16(d * sum(codes)) with the unrounded d.
    Each f32 op is taken in f64 and rounded once (so exactly the f32 op): XLA would otherwise
    regroup amax / 127 * sum."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32).astype(f32)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    d = (_up(amax) / 127.0).astype(f32)
    safe = jnp.where(amax == 0, f32(1), amax)
    inv = jnp.where(amax != 0, (127.0 / _up(safe)).astype(f32), f32(0))
    q = jnp.round((_up(xb) * _up(inv)[..., None]).astype(f32))  # ties to even, as _mm256_round_ps
    s = f16_round((_up(d) * _up(jnp.sum(q, axis=-1))).astype(f32))
    return f16_round(d), q, s


def _codes(w: QuantizedTensor) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(d [N, B], codes [N, B, 32] int8 in element order, m [N, B] or None) of Q8_0 or Q4_1."""
    p = row_major_planes(w)
    n, k = w.shape
    nb = k // 32
    d = p["d"].astype(f32).reshape(n, nb)
    if w.fmt == "q8_0":
        return d, p["qs"].astype(jnp.int8).reshape(n, nb, 32), None
    qs = p["qs"].reshape(n, nb, 16)
    q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.int8)  # byte l: elements l, 16 + l
    return d, q, p["m"].astype(f32).reshape(n, nb)


def _hsum8(acc: jax.Array) -> jax.Array:
    """hsum_float_8: (lanes 4..7 + 0..3), then (0 + 2) + (1 + 3)."""
    r = add(acc[..., 4:8], acc[..., 0:4])
    return add(add(r[..., 0], r[..., 2]), add(r[..., 1], r[..., 3]))


def matmul(x: jax.Array, w: QuantizedTensor, *, layer=None, row_tile: int = 32, col_tile: int = 1024,
           **_) -> jax.Array:
    """x [..., K] @ w [N, K].T as ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0 (AVX2) compute each output:
    x rounded per 32-block to 8 bits; 8 f32 lanes, lane l the integer sum over elements
    4l..4l+3 of a block, accumulated block by block with fma(d_w * d_x, sum, lane); the lanes
    summed in hsum_float_8's tree; for Q4_1 plus the sum of m_w * s_x (by fma).

    The lane sums are small integers (|sum| < 2^17): a block's are one int8 dot, accumulated in
    int32 and so exact, of x's codes spread over the 8 lanes ([R, 8, 32], zero outside each
    lane's 4 elements) with the weights' codes, 8 times the multiplies of the matmul but in a
    GEMM of depth 32 (faster here than 8 dots of depth 4, and in int8 1.5x faster than in f32 on
    2 cores). The lane update is written `dd * lanes + acc` in f32, which XLA
    contracts into ggml's FMA (test_xla_contracts_one_product_and_sum); the sum starts as the
    loop's carry, so that no step adds two products (XLA would be free to fuse either). Rows run `row_tile` and columns
    `col_tile` at a time so that a block's [R, 8, N] sums stay in the cache."""
    if w.fmt not in ("q4_1", "q8_0"):
        raise NotImplementedError(f"ggml numerics: no {w.fmt} matmul (Q4_1 and Q8_0 are reproduced)")
    w = layer_of(w, layer)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(f32)
    m = x2.shape[0]
    nb = k // 32
    d_w, q_w, m_w = _codes(w)
    has_m = m_w is not None
    nt = col_tile if n % col_tile == 0 else n
    tiles = (jnp.moveaxis(q_w.reshape(n // nt, nt, nb, 32), 2, 1),  # [T, B, Nt, 32]
             jnp.moveaxis(d_w.reshape(n // nt, nt, nb), 2, 1),  # [T, B, Nt]
             jnp.moveaxis((m_w if has_m else d_w).reshape(n // nt, nt, nb), 2, 1))
    lane_of = jnp.repeat(jnp.eye(8, dtype=f32), 4, axis=1)  # [8, 32]: lane l, elements 4l..4l+3

    def rows(xr: jax.Array) -> jax.Array:  # [R, K] -> [R, N]
        r = xr.shape[0]
        d_x, q_x, s_x = quantize_q8(xr)
        x_lanes = jnp.moveaxis(q_x[:, :, None, :] * lane_of, 1, 0).astype(jnp.int8)  # [B, R, 8, 32]: |code| <= 127

        def col_tile_out(tile) -> jax.Array:  # -> [R, Nt]
            q_wt, d_wt, m_wt = tile

            def block(b, carry):
                acc, summs = carry
                lanes = jnp.einsum("rlk,nk->rln", x_lanes[b], q_wt[b], preferred_element_type=jnp.int32).astype(f32)
                dd = (d_wt[None, b] * d_x[:, b, None])[:, None, :]
                acc = dd * lanes + acc
                if has_m:
                    summs = fma(m_wt[None, b], s_x[:, b, None], summs)
                return acc, summs

            zeros = (jnp.zeros((r, 8, nt), f32), jnp.zeros((r, nt), f32))
            acc, summs = jax.lax.fori_loop(0, nb, block, zeros)
            out = _hsum8(jnp.moveaxis(acc, 1, -1))
            return add(out, summs) if has_m else out

        outs = jax.lax.map(col_tile_out, tiles)  # [T, R, Nt]
        return jnp.moveaxis(outs, 0, 1).reshape(r, n)

    if m <= row_tile:
        return rows(x2).reshape(*lead, n)
    pad = -m % row_tile
    xp = jnp.pad(x2, ((0, pad), (0, 0)))
    out = jax.lax.map(rows, xp.reshape(-1, row_tile, k)).reshape(-1, n)[:m]
    return out.reshape(*lead, n)


# ---- norm, rope, activation -------------------------------------------------------------------

@_x64
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """ggml_compute_forward_rms_norm_f32, then the weight: the f32 squares summed in double."""
    x = x.astype(f32)
    total = jnp.sum(_up(x * x), axis=-1, keepdims=True)
    mean = (total / x.shape[-1]).astype(f32)
    # 1.0f / sqrtf(mean + eps), each op rounded once (XLA would turn 1 / sqrt into its rsqrt);
    # sqrtf in f64 rounded to f32 is the correctly rounded f32 root
    root = jnp.sqrt(_up(add(mean, f32(eps)))).astype(f32)
    scale = div(f32(1), root)
    return mul(mul(x, scale), w)


def _libm() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name in ("cosf", "sinf", "powf"):
        getattr(lib, name).restype = ctypes.c_float
        getattr(lib, name).argtypes = [ctypes.c_float] * (2 if name == "powf" else 1)
    return lib


def rope_tables(base: float, n_dims: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, n_dims / 2] as ggml_rope_cache_init makes them (no scaling): theta =
    pos * theta_scale^i multiplied up in f32, theta_scale = powf(base, -2 / n_dims), the C
    library's cosf and sinf."""
    lib = _libm()
    theta_scale = np.float32(lib.powf(np.float32(base), np.float32(-2.0) / np.float32(n_dims)))
    cos = np.empty((positions, n_dims // 2), np.float32)
    sin = np.empty_like(cos)
    for p in range(positions):
        theta = np.float32(p)
        for i in range(n_dims // 2):
            cos[p, i], sin[p, i] = lib.cosf(theta), lib.sinf(theta)
            theta = np.float32(theta * theta_scale)
    return cos, sin


def make_rope(cos: np.ndarray, sin: np.ndarray, neox: bool) -> Callable:
    """rope(x [..., N, D], pos [...]) as ggml's rotate_pairs: fma(x0, cos, -(x1 * sin)) and
    fma(x0, sin, x1 * cos)."""
    cos_t, sin_t = jnp.asarray(cos), jnp.asarray(sin)
    half = cos.shape[1]

    def rope(x: jax.Array, pos: jax.Array) -> jax.Array:
        c = jnp.take(cos_t, pos, axis=0)[..., None, :]
        s = jnp.take(sin_t, pos, axis=0)[..., None, :]
        rot, rest = x[..., : 2 * half], x[..., 2 * half:]
        if neox:
            x0, x1 = rot[..., :half], rot[..., half:]
        else:
            pairs = rot.reshape(*rot.shape[:-1], half, 2)
            x0, x1 = pairs[..., 0], pairs[..., 1]
        y0 = fma(x0, c, -(x1 * s))
        y1 = fma(x0, s, x1 * c)
        out = jnp.concatenate([y0, y1], -1) if neox else jnp.stack([y0, y1], -1).reshape(rot.shape)
        return jnp.concatenate([out, rest], -1) if rest.shape[-1] else out

    return rope


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """ggml_vec_swiglu_f32 (AVX2): silu by ggml's vector expf, x / (1 + exp(-x)), times up."""
    gate = gate.astype(f32)
    return mul(div(gate, add(f32(1), vector_expf(-gate))), up)


# ---- attention ---------------------------------------------------------------------------------

def _dot_f16(q16: jax.Array, k: jax.Array) -> jax.Array:
    """ggml_vec_dot_f16 (AVX2, F16C) of q [..., D] with k [..., D] (f16 values): 4 accumulators
    of 8 lanes over steps of 32, then its reduction tree."""
    d = q16.shape[-1]
    qs = q16.reshape(*q16.shape[:-1], d // 32, 4, 8)
    ks = k.reshape(*k.shape[:-1], d // 32, 4, 8)
    # Every product of two f16 values is exact in f32 (11-bit significands), so an FMA and a
    # product then a sum round alike: the first step's fma onto zero is a plain product, each
    # later step one product and one sum, however XLA contracts them. The sums after are plain
    # f32 adds, which XLA neither regroups nor (their operands being no products) contracts;
    # written so rather than as the f64 `add`, the decode attention ran 4x faster on 2 cores.
    acc = ks[..., 0, :, :] * qs[..., 0, :, :]
    for i in range(1, d // 32):
        acc = ks[..., i, :, :] * qs[..., i, :, :] + acc
    a0 = acc[..., 0, :] + acc[..., 2, :]
    a1 = acc[..., 1, :] + acc[..., 3, :]
    a0 = a0 + a1
    t = a0[..., :4] + a0[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def _online_chunks(q16, cache, starts, ends, scale, block: int = 128):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk over key ranges, all rows at once.

    q16 [R, H, D] (f16 values); cache (keys, values, lead, rows): caches [*L, B, S, K, D] read at
    the leading indices `lead` (say the layer of a stacked cache) and, for query row r, at cache
    row rows[r] ([R] int32), or [*L, S, K, D] (one slot's) for every row when `rows` is None;
    each block's cells are gathered from them, so no layer or slot is copied whole. kv head
    h // G serves query head h. starts/ends [R, C] int32: chunk c of row r covers cells
    [start, end), in order. Per cell the score (ggml_vec_dot_f16, scaled), libm's expf, and a new maximum
    rescaling the f16 accumulator. -> (M, S, VKQ) [R, C, H], [R, C, H], [R, C, H, D].

    Cells run `block` at a time: a block's scores, running maxima (a cumulative max, which is
    the sequential `s > M` test's M) and exps at once; only the f16 accumulator and the sum, a
    chain of roundings, step cell by cell.
    """
    keys, values, lead, cache_rows = cache
    r, h, d = q16.shape
    kv_heads = keys.shape[-2]
    g = h // kv_heads
    c = starts.shape[1]
    at = tuple(lead) if cache_rows is None else (*lead, cache_rows[:, None, None])
    qg = q16.reshape(r, 1, 1, kv_heads, g, d)
    n_blocks = (jnp.max(ends - starts) + block - 1) // block

    def block_step(b, carry):
        top, total, acc = carry  # [R, C, H], [R, C, H], [R, C, K, G, D]
        key = starts[..., None] + b * block + jnp.arange(block)  # [R, C, Bk]
        live = key < ends[..., None]
        idx = jnp.where(live, key, 0)
        k = keys[(*at, idx)].astype(f32)  # [R, C, Bk, K, D]
        v = values[(*at, idx)].astype(f32)
        s = mul(_dot_f16(qg, k[..., None, :]).reshape(r, c, block, h), f32(scale))
        s = jnp.where(live[..., None], s, -jnp.inf)
        seen = jnp.maximum(top[:, :, None], jax.lax.cummax(s, axis=2))  # M after each cell
        prev = jnp.concatenate([top[:, :, None], seen[:, :, :-1]], axis=2)  # M before it
        new_max = s > prev
        ms = jnp.where(new_max, libm_expf(sub(prev, s)), f32(1))
        vs = jnp.where(new_max, f32(1), libm_expf(sub(s, prev)))
        shape = (r, c, block, kv_heads, g)
        new_max, ms, vs = (a.reshape(shape) for a in (new_max, ms, vs))

        def cell(i, carry):
            total, acc = carry
            nm, m_i, v_i, lv = new_max[:, :, i], ms[:, :, i], vs[:, :, i], live[:, :, i, None, None]
            # f32 ops, each one product and one sum where ggml has an FMA: XLA fuses it (tests)
            scaled = jnp.where(nm[..., None], f16_round(acc * m_i[..., None]), acc)
            upd_acc = f16_round(v[:, :, i, :, None] * v_i[..., None] + scaled)
            upd_total = total * m_i + v_i
            return jnp.where(lv, upd_total, total), jnp.where(lv[..., None], upd_acc, acc)

        total, acc = jax.lax.fori_loop(0, block, cell, (total.reshape(r, c, kv_heads, g), acc))
        return seen[:, :, -1], total.reshape(r, c, h), acc

    init = (jnp.full((r, c, h), -jnp.inf, f32), jnp.zeros((r, c, h), f32), jnp.zeros((r, c, kv_heads, g, d), f32))
    top, total, acc = jax.lax.fori_loop(0, n_blocks, block_step, init)
    return top, total, acc.reshape(r, c, h, d)


@_x64
def _scale_by_inverse(acc, total, if_zero: float):
    """acc * (1.0f / total), as ggml_vec_scale_f32 after the division (`if_zero` the factor for a
    total of 0). Both ops in f64 and rounded to f32 (each then exactly the f32 op), since XLA
    would otherwise turn the multiplication by a reciprocal into a division."""
    inv = (1.0 / _up(jnp.where(total == 0, f32(1), total))).astype(f32)
    inv = jnp.where(total == 0, f32(if_zero), inv)
    return (_up(acc) * _up(inv)[..., None]).astype(f32)


def _finish(acc, total):
    return _scale_by_inverse(acc, total, 0.0)


def _reduce_partials(top, total, acc):
    """ggml_flash_attn_ext_reduce_partials over chunks [R, C, H(, D)] -> [R, H, D]."""
    m_f = jnp.full(top.shape[:1] + top.shape[2:], -jnp.inf, f32)
    s_f = jnp.zeros_like(m_f)
    v_f = jnp.zeros(acc.shape[:1] + acc.shape[2:], f32)
    for c in range(top.shape[1]):
        m_c, s_c, v_c = top[:, c], total[:, c], acc[:, c]
        m_new = jnp.maximum(m_f, m_c)
        old, new = libm_expf(sub(m_f, m_new)), libm_expf(sub(m_c, m_new))
        take = s_c != 0
        # VKQ_final * scale_old + VKQ_chunk * scale_new: GCC fuses the first product
        v_n = fma(v_f, old[..., None], mul(v_c, new[..., None]))
        s_n = fma(s_f, old, mul(s_c, new))
        v_f = jnp.where(take[..., None], v_n, v_f)
        s_f = jnp.where(take, s_n, s_f)
        m_f = jnp.where(take, m_new, m_f)
    return _scale_by_inverse(v_f, s_f, 1.0)


def n_kv(used: jax.Array, cells: int) -> jax.Array:
    """llama.cpp's cache cells a step attends to: `used` padded to KV_PAD (at least KV_PAD), at
    most the cache's `cells`."""
    padded = (used + KV_PAD - 1) // KV_PAD * KV_PAD
    return jnp.minimum(cells, jnp.maximum(KV_PAD, padded))


def _rows_one_chunk(q, cache, positions, scale, cells, split: bool, threads: int = GGML_THREADS):
    """Query rows q [R, H, D] at `positions` [R] over cells 0..pos (cache as in
    `_online_chunks`): ggml's one-chunk path, or, with `split` (each row a lone decode row), for
    rows over n_kv >= 512 cells its split of the cells between `threads` threads (ceil(n_kv /
    threads) each) and their merge."""
    q16 = f16_round(q.astype(f32))
    ends = positions + 1
    if not split:
        top, total, acc = _online_chunks(q16, cache, jnp.zeros_like(ends)[:, None], ends[:, None], scale)
        return _finish(acc[:, 0], total[:, 0])
    cells_r = n_kv(ends, cells)
    splits = cells_r >= 2 * KV_PAD
    size = (cells_r + threads - 1) // threads
    c = jnp.arange(threads)[None, :]
    starts = jnp.where(splits[:, None], c * size[:, None], jnp.where(c == 0, 0, ends[:, None]))
    stops = jnp.where(splits[:, None], jnp.minimum((c + 1) * size[:, None], ends[:, None]), ends[:, None])
    stops = jnp.maximum(stops, starts)

    def split_rows(_):
        top, total, acc = _online_chunks(q16, cache, starts, stops, scale)
        merged = _reduce_partials(top, total, acc)
        return jnp.where(splits[:, None, None], merged, _finish(acc[:, 0], total[:, 0]))

    def whole_rows(_):  # no row splits: one chunk each (the same numbers, half the work)
        top, total, acc = _online_chunks(q16, cache, starts[:, :1], stops[:, :1], scale)
        return _finish(acc[:, 0], total[:, 0])

    return jax.lax.cond(jnp.any(splits), split_rows, whole_rows, None)


def _expand_heads(cache_rows: jax.Array, groups: int) -> jax.Array:
    """[..., S, K, D] -> [..., S, K * G, D]: query head h reads kv head h // G."""
    return jnp.repeat(cache_rows, groups, axis=-2)


def attention_decode(q, k_cache, v_cache, positions, scale, window=0, *, layer=None, span=None,
                     threads: int = GGML_THREADS, slots=None, **_):
    """One query per slot, q [B, H, D], over its f16 cache (positions 0..pos): ggml's decode
    path for each row as llama.cpp would run it alone. `slots` [B]: each row's cache row (None:
    row b's is b)."""
    if not isinstance(window, int) or window:
        raise NotImplementedError("ggml numerics: no sliding window")
    if k_cache.dtype != jnp.float16:
        raise NotImplementedError("ggml numerics: the cache must be f16 (llama.cpp's)")
    cells = k_cache.shape[-3]
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    rows = jnp.arange(q.shape[0], dtype=jnp.int32) if slots is None else jnp.asarray(slots, jnp.int32)
    pos = jnp.maximum(positions, 0)
    return _rows_one_chunk(q, (k_cache, v_cache, lead, rows), pos, scale, cells, split=True,
                           threads=threads)


def _tiled(q, keys, values, positions, scale, num_tiles):
    """ggml_compute_forward_flash_attn_ext_tiled for rows q [T, H, D] (f32) at `positions` [T]
    over keys/values [S, H, D] (f16 values): tiles of TILE cells from cell 0.

    A tile's scores and probabilities are kept [H, TILE, T], the rows last: the sums over a
    tile's cells then run on whole rows of T values. (With the cells last, XLA fused the
    probabilities' vector expf into the sums of its 4-wide groups, recomputed and barely
    vectorized: 3.7x the tile's time on 2 cores.)"""
    t, h, d = q.shape
    qh = jnp.moveaxis(q.astype(f32), 1, 0)  # [H, T, D]

    def tile(i, carry):
        top, total, acc = carry  # [H, T], [H, T], [H, T, D]
        k = jax.lax.dynamic_slice_in_dim(keys, i * TILE, TILE, 0)  # [TILE, H, D]
        v = jax.lax.dynamic_slice_in_dim(values, i * TILE, TILE, 0)
        cell = i * TILE + jnp.arange(TILE)
        # simd_gemm: per score a chain of fmas over D (an f32 dot, see the module docstring)
        s = jnp.stack([jnp.dot(k[:, j], qh[j].T) for j in range(h)])  # [H, TILE, T]
        s = mul(s, f32(scale))
        visible = cell[None, :, None] <= positions[None, None, :]
        s = jnp.where(visible, s, -jnp.inf)  # + the mask's 0
        tile_max = jnp.max(s, axis=1)  # [H, T]
        new_top = jnp.maximum(top, tile_max)
        grow = new_top > top
        ms = libm_expf(sub(top, new_top))
        acc = jnp.where(grow[..., None], mul(acc, ms[..., None]), acc)
        total = jnp.where(grow, mul(total, ms), total)
        skip = tile_max == -jnp.inf
        p = jnp.where(skip[:, None], f32(0), vector_expf(sub(s, new_top[:, None])))  # [H, TILE, T]
        with jax.enable_x64(True):
            tile_sum = jnp.zeros(total.shape, f64)
            for j in range(TILE // 8):  # ggml_vec_soft_max_f32: 8 lanes a group, hsum_float_8's tree
                g = [p[:, 8 * j + c] for c in range(8)]
                g4 = [add(g[4 + c], g[c]) for c in range(4)]
                g1 = add(add(g4[0], g4[2]), add(g4[1], g4[3]))
                tile_sum = tile_sum + _up(g1)  # the groups added in double, in order
            new_total = (_up(total) + tile_sum).astype(f32)  # S += (a double)
        total = jnp.where(skip, total, new_total)
        top = jnp.where(skip, top, new_top)
        vh = jnp.moveaxis(v, 1, 0)  # [H, TILE, D]

        def cell_step(j, acc):  # simd_gemm: VKQ += p * V, one fma per cell, in order
            pj = jax.lax.dynamic_index_in_dim(p, j, 1, keepdims=False)[..., None]  # [H, T, 1]
            vj = jax.lax.dynamic_index_in_dim(vh, j, 1, keepdims=True)  # [H, 1, D]
            return acc + pj * vj  # one product and one sum: XLA fuses them into an FMA (tests)

        acc = jax.lax.fori_loop(0, TILE, cell_step, acc)
        return top, total, acc

    init = (jnp.full((h, t), -jnp.inf, f32), jnp.zeros((h, t), f32), jnp.zeros((h, t, d), f32))
    top, total, acc = jax.lax.fori_loop(0, num_tiles, tile, init)
    return jnp.moveaxis(_finish(acc, total), 0, 1)


def attention_prefill(q, k_cache, v_cache, start_pos, scale, window=0, *, layer=None, slot=None, span=None,
                      num_valid=None, threads: int = GGML_THREADS, **_):
    """A chunk of one slot's queries q [T, H, D] (the ubatch llama.cpp would run: its rows
    `num_valid`) over the slot's f16 cache: the tiled path for 64 rows or more, the one-chunk
    path for fewer, a lone row as a decode step."""
    if not isinstance(window, int) or window:
        raise NotImplementedError("ggml numerics: no sliding window")
    if k_cache.dtype != jnp.float16:
        raise NotImplementedError("ggml numerics: the cache must be f16 (llama.cpp's)")
    cells = k_cache.shape[-3]
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32), jnp.asarray(slot, jnp.int32))
    t, h, d = q.shape
    groups = h // k_cache.shape[-2]
    valid = jnp.int32(t) if num_valid is None else num_valid
    last = jnp.minimum(start_pos + jnp.arange(t), start_pos + valid - 1)  # padding rows: the last row

    def one_chunk(lone: bool):
        # a ubatch of one row runs as a decode step (it may split its cells)
        return lambda _: _rows_one_chunk(q, (k_cache, v_cache, lead, None), last, scale, cells, split=lone,
                                         threads=threads)

    if t < TILE:
        return jax.lax.cond(valid == 1, one_chunk(True), one_chunk(False), None)

    def tiled(_):
        keys, values = k_cache, v_cache
        for i in lead:
            keys = jax.lax.dynamic_index_in_dim(keys, i, 0, False)
            values = jax.lax.dynamic_index_in_dim(values, i, 0, False)
        if span is not None:
            keys, values = keys[:span], values[:span]
        pad = -keys.shape[0] % TILE
        keys, values = (jnp.pad(_expand_heads(a.astype(f32), groups), ((0, pad), (0, 0), (0, 0)))
                        for a in (keys, values))
        return _tiled(q, keys, values, last, scale, (start_pos + valid + TILE - 1) // TILE)

    return jax.lax.cond(valid >= TILE, tiled,
                        lambda _: jax.lax.cond(valid == 1, one_chunk(True), one_chunk(False), None), None)


attention_prefill.takes_num_valid = True


def _cpu_only() -> bool:
    return jax.default_backend() == "cpu"


# Never chosen by default (below the reference): `--numerics ggml` forces them.
registry.register("matmul", "ggml_cpu", matmul, is_available=_cpu_only, priority=-100)
attention_decode.takes_slots = True  # (model/forward.py's speculative decode)
registry.register("attention_decode", "ggml_cpu", attention_decode, is_available=_cpu_only, priority=-100)
registry.register("attention_prefill", "ggml_cpu", attention_prefill, is_available=_cpu_only, priority=-100)

