"""Q4_K weights split into a Q4_0 tensor and an offset plane, so that Q4_0's kernels (the Mosaic
GPU one reached 2.5x the Triton Q4_K kernel's share of copy bandwidth on a 7B's q/k/v and
gate/up matrices, bench/results, thirteenth session) can serve Q4_K files.

A Q4_K super-block of 256 weights holds per 32-weight sub-block b the codes q (0..15), a 6-bit
scale sc_b and a 6-bit min m_b, and per super-block f16 d and dmin: w = d sc_b q - dmin m_b
(llama.cpp). That is Q4_0's form plus one offset per block and row:

    w' = s_b (q - 8) + c_b,   s_b = bf16(f16(d sc_b)),   c_b = bf16(f16(8 f16(d sc_b) - dmin m_b))

so x @ w'.T = q4_0_matmul(x, codes, s) + xsum @ C, with xsum [M, K/32] the sums of x over each
32-block and C [K/32, N] the offsets (transposed like Q4_0's scales). The planes hold s and C in
bf16: the values the folded Mosaic kernel (the GPU default in decode and prefill) multiplies and
adds in its bf16 weights, which it made from f16 planes by the same two roundings until the
thirty-sixth session; held so, its conversions from f16 are gone (on the H200 the Q4_K_M 7B
decode shapes' calls took 4-6% less: 11008 x 4096 12.2 against 12.7 us at M = 8, 4096 x 11008
11.6 against 12.2, 22016 x 4096 21.9 against 23.2; bench/results, thirty-sixth session) and its
products are unchanged bit for bit. w' differs from w = d sc_b q - dmin m_b by at most about
2^-8 of d sc_b times q (the scale's rounding: 2^-11 for f16, 2^-8 for bf16's 8-bit significand)
and 2^-8 of c_b more (2^-25 absolute below f16's normal range), the folded kernel's own
rounding; the other paths (Triton, the unfolded Mosaic kernel, the reference) read the same
planes, so their products move by that much as well (1.8e-3 in relative norm on random weights,
against under 5e-4 with the f16 planes before; the offsets were f32 until the seventeenth
session). |8 s_b| must stay within f16's range (65504), as s_b itself must: scales that large
are not found in real files (a Q4_K weight of that scale would reach 10^5). The codes keep their
bits; they move from Q4_K's nibble order (per 64 weights, 32 bytes: low nibbles weights 0..31,
high nibbles 32..63) to Q4_0's (per 32 weights, 16 bytes: low nibbles 0..15, high 16..31).

Bytes per weight: 0.5 (codes) + 2/32 (s) + 2/32 (C) = 0.625, against Q4_K's 0.5625. (Q4_K's own
6-bit scales and mins, packed as an int16 per block beside per-super-block f16 d and dmin, would
take 0.578; the kernel making each block's scale and offset from them ran 4-10% slower on the
H200, its steps bound by their arithmetic, not their bytes: branch experiment/q4k-packed,
bench/results, thirty-sixth session.)

The split is a weight format of its own, "q4_k_split" (`quant.DERIVED_FORMATS`: plane `qs` as
Q4_0's, `d` [K/32, N] bf16 where Q4_0's is f16, `c` [K/32, N] bf16), made at load with
`EngineConfig.split_q4_k` (`--split-q4-k`), so the forward pass is unchanged: the reference
dequantizes it (d (q - 8) + c); the Mosaic GPU matmul's kernels add the offsets to their bf16
weights (`fold_offsets`, the scales folded too: `folded_dequantize` gives those weights): in
prefill (a 7B Q4_K_M prefill chunk of 512 tokens took 20.2 ms against 23.3 with the offsets as an
XLA dot, bench/results, twenty-second session) and, since the thirty-fifth session, in decode
(`mgpu_tuning.OFFSET_DECODE_TUNING`: a 7B Q4_K_M decode step took 2.67 ms against 2.85 with the
offsets added by the unfolded kernel, which needs x's block sums from an XLA kernel before each
call, `fuse_offsets`; that took 4.22 ms against 4.65 with the XLA dot in the fourteenth session);
the Triton matmul, and the Mosaic kernel where a tuning turns both off, serve the format through
`matmul_via`: their Q4_0 kernel on `codes_and_scales`, plus `offset_term` (at tf32 beside the
Mosaic GPU kernel, `KERNEL_OFFSET_PRECISION`; f32 beside Triton's). (Triton takes the shapes and
GPUs Mosaic refuses: a row-parallel shard with K = 5504, a GPU before Hopper). `bench/kernels.py`
times it on the GPU as impl "mosaic_gpu:q4_k_split".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.mgpu_tuning import BLOCK_K  # weights per scale of the block formats the kernel reads
from pallas_kernels.quant import QK_K, QuantizedTensor, array_module, check_layer, dequantize_reference

BLOCK = 32  # weights per Q4_0 block and per Q4_K sub-block
CODE_OFFSET = 8  # Q4_0 weight = d (q - 8)


def split_q4_k(w: QuantizedTensor) -> QuantizedTensor:
    """Q4_K [*S, N, K] -> "q4_k_split" [*S, N, K] (see the module docstring). Numpy planes in
    (the loader, on the host) give numpy planes out; jax arrays give jax arrays."""
    if w.fmt != "q4_k":
        raise ValueError(f"split_q4_k takes q4_k, not {w.fmt}")
    xp = array_module(w)
    n, k = w.shape
    lead = tuple(w.stack_shape)
    supers, blocks = k // QK_K, k // BLOCK
    p = w.planes
    qs = xp.reshape(xp.asarray(p["qs"]), (*lead, n, supers, 4, 1, 32))  # 4 runs of 32 bytes per super-block
    codes = (qs >> xp.asarray([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [.., N, S, 4, 2, 32]
    codes = xp.reshape(codes, (*lead, n, blocks, BLOCK))  # sub-block 8 s + 2 run + nibble, in order
    qs40 = xp.reshape(codes[..., :16] | (codes[..., 16:] << 4), (*lead, n, k // 2)).astype(np.uint8)
    scales, offsets = block_scales_and_offsets(xp, p, CODE_OFFSET)
    return QuantizedTensor({"qs": qs40, "d": as_bf16(xp, scales), "c": as_bf16(xp, offsets)}, "q4_k_split", (n, k))


def block_scales_and_offsets(xp, planes, code_offset: int):
    """The s and C planes of a split K-quant with 6-bit scales and mins (Q4_K, Q5_K): s_b = f16(d
    sc_b) and c_b = f16(code_offset s_b - dmin m_b), each [.., K/32, N] (transposed, contiguous)."""

    def per_block(super_vals, sub_vals):  # f32 [.., N, K/32]: a super-block's f16 value times its 6-bit ints
        return xp.repeat(xp.asarray(super_vals).astype(np.float32), QK_K // BLOCK, axis=-1) * xp.asarray(
            sub_vals).astype(np.float32)

    scales = per_block(planes["d"], planes["sc"]).astype(np.float16)  # s_b
    offsets = (code_offset * scales.astype(np.float32) - per_block(planes["dmin"], planes["m"])).astype(np.float16)

    return transposed(xp, scales), transposed(xp, offsets)


def as_bf16(xp, a):
    """An f16 plane rounded to bf16 (through f32, as the folded Mosaic kernel rounded the f16
    planes it read until the thirty-sixth session): the scales and offsets of the splits read
    as Q4_0 codes (q4_k_split, q4_1_split), whose folded kernel is bound by its instructions.
    The splits read as int8 codes (q5_k_split, q5_1_split) keep f16: there the folded kernel
    is bound by its bytes, and bf16 planes took it no faster (bench/results, thirty-seventh session)."""
    return a.astype(ml_dtypes.bfloat16 if xp is np else jnp.bfloat16)


def transposed(xp, a):
    """[.., N, K/32] -> [.., K/32, N]: a per-block plane in the kernels' transposed layout
    (contiguous on the host)."""
    a = xp.swapaxes(a, -1, -2)
    return np.ascontiguousarray(a) if xp is np else a


# The formats made at load as a GGML block format's codes and scales plus an offset plane `c`
# (this module's form, pallas_kernels/q5_k_split.py's and pallas_kernels/legacy_split.py's) ->
# that block format, whose kernels serve them (`codes_and_scales`, `matmul_via`).
OFFSET_FORMS = {"q4_k_split": "q4_0", "q4_1_split": "q4_0", "q5_k_split": "q8_0", "q5_1_split": "q8_0"}


def codes_and_scales(w: QuantizedTensor) -> QuantizedTensor:
    """The block-format part of a tensor in an `OFFSET_FORMS` format (its codes and scales:
    views, stacked as `w` is)."""
    return QuantizedTensor({"qs": w.planes["qs"], "d": w.planes["d"]}, OFFSET_FORMS[w.fmt], w.shape)


def folded_dequantize(qt: QuantizedTensor) -> jax.Array:
    """f32 [*S, N, K] in natural order: the weights as the Mosaic GPU matmul's folded kernel
    (`MosaicMatmulTuning.fold_scales`, with `fold_offsets` for `OFFSET_FORMS`) hands them to its
    bf16 wgmmas: each code (q - 8, or the int8 code) times its block's scale rounded to bf16,
    plus, for the formats with offsets, the block's offset rounded to bf16, rounded to bf16 once
    (`matmul_mgpu._scaled_blocks`: its bf16 multiply and add compile to one fused multiply-add;
    on the H200 its products matched this to 2e-7, against 2e-3 for a rounding after the
    multiply as well, bench/results, thirty-fifth session). The exact weights are
    `quant.dequantize_reference`'s; this is what a check of the folded kernel, or a measure of
    what folding costs, compares with."""
    base = OFFSET_FORMS.get(qt.fmt, qt.fmt)
    if base not in BLOCK_K:
        raise NotImplementedError(f"the folded kernel does not read {qt.fmt}")
    blk = BLOCK_K[base]
    ones = jnp.ones(jnp.shape(qt.planes["d"]), jnp.float16)
    codes = dequantize_reference(QuantizedTensor({"qs": qt.planes["qs"], "d": ones}, base, qt.shape))  # exact

    def per_weight(plane):  # [*S, K/blk, N] -> [*S, N, K], each block's value repeated, as bf16 in f32
        v = jnp.repeat(jnp.swapaxes(jnp.asarray(plane).astype(jnp.float32), -1, -2), blk, axis=-1)
        return _bf16(v)

    w = per_weight(qt.planes["d"]) * codes  # exact in f32: a bf16 scale times a code of at most 8 bits
    if qt.fmt in OFFSET_FORMS:
        w = w + per_weight(qt.planes["c"])
    return _bf16(w)


def _bf16(v: jax.Array) -> jax.Array:
    return v.astype(jnp.bfloat16).astype(jnp.float32)


def block_sums(x: jax.Array) -> jax.Array:
    """x [..., K] -> [..., K/32] f32: the sum of x over each 32-block."""
    k = x.shape[-1]
    return jnp.sum(jnp.reshape(x.astype(jnp.float32), (*x.shape[:-1], k // BLOCK, BLOCK)), axis=-1)


def offset_term(x: jax.Array, w: QuantizedTensor, layer: jax.Array | int | None = None,
                precision: jax.lax.Precision = jax.lax.Precision.HIGHEST) -> jax.Array:
    """x [..., K] -> [..., N] f32: the offsets' share of x @ w.T, block_sums(x) @ c (matrix
    `layer` of a stack), in f32; `precision` HIGHEST by default (a GPU would otherwise use its
    tensor cores' reduced-precision passes; see `KERNEL_OFFSET_PRECISION`)."""
    check_layer(w, layer)
    c = w.planes["c"]
    if layer is not None:
        c = jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False)
    c = c.astype(jnp.float32)
    xs = block_sums(x)
    return jax.lax.dot_general(xs, c, (((xs.ndim - 1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


# The offsets' dot beside the Mosaic GPU kernels where they do not add the offsets themselves
# (the prefill kernel rounds the weights to bf16 itself): at HIGHEST the H200 ran it as f32 SIMT
# GEMMs, 4.3 ms of a 26.3 ms 7B Q4_K_M prefill chunk of 512 tokens; at HIGH, as tf32 tensor-core
# GEMMs (an 11-bit significand, against the kernel's 8-bit bf16 weights), the chunk took 22.8 ms
# (bench/results, fifteenth session).
KERNEL_OFFSET_PRECISION = jax.lax.Precision.HIGH


def matmul_via(base_matmul, x: jax.Array, w: QuantizedTensor, layer: jax.Array | int | None = None,
               offset_precision: jax.lax.Precision = jax.lax.Precision.HIGHEST, **kwargs) -> jax.Array:
    """x @ w.T for w in an `OFFSET_FORMS` format: `base_matmul(x, codes_and_scales(w),
    layer=layer, **kwargs)` (an implementation of op "matmul" that takes the block format) plus
    `offset_term` at `offset_precision`."""
    return base_matmul(x, codes_and_scales(w), layer=layer, **kwargs) + offset_term(x, w, layer, offset_precision)

