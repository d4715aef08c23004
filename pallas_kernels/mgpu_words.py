"""The Mosaic GPU matmul's code conversions (pallas_kernels/matmul_mgpu.py): a step's codes,
loaded from shared memory 32 bits per thread (Mosaic's WGMMA_UPCAST_4X layout: per 32 int4
columns and row, thread c = lane % 4 holds bytes 4c..4c+3), turned in registers into the wgmma
operand with no data exchanged between threads: Q4_0's as bf16 q - 8 (`q4_0_words_to_bf16`, x
permuted to match) or as s8 q (`q4_0_words_to_s8`, the `int8_x` variant), and the 6-bit codes of
"q6_k_split6" as bf16 q - 32 from their two planes (`q6_words_to_bf16`, x in natural order).
Mosaic GPU code, run inside `inline_mgpu` (`words_op`, `words6_op`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mgpu_store import load, pallas_mgpu

# `q4_0_words_to_bf16` / `ptx_pair`: pair j of a 32-bit word of codes is (word >> 4 j) &
# NIBBLE_PAIR_MASK, OR BF16_128_PAIR (two bf16 128 + q, exact), minus BF16_136_PAIR (two bf16
# 136): q - 8.
NIBBLE_PAIR_MASK = 0x000F000F
BF16_128_PAIR = 0x43004300
BF16_136_PAIR = 0x43084308


def registers_for(codes, layout, per_block: int, fallback: str) -> np.ndarray:
    """An empty register array of `layout` (Mosaic's WGMMA_LAYOUT or WGMMA_LAYOUT_8BIT) for the
    operand made from `codes` (WGMMA_UPCAST_4X), each 32-block's word giving `per_block` registers.
    The register indexing the word unpackings use is Mosaic's (private): this checks what they
    rely on (both register arrays alike but for axis 1, which counts 32-column blocks in one and
    `32 / per_block`-column tiles in the other) rather than place registers wrongly."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    blocks = codes.shape[1] // 32
    have, want = codes.registers.shape, layout.registers_shape(codes.shape)
    if (codes.layout != fa.WGMMA_LAYOUT_UPCAST_4X or len(have) != len(want) or len(have) < 2
            or (have[1], want[1]) != (blocks, per_block * blocks) or have[:1] + have[2:] != want[:1] + want[2:]):
        raise NotImplementedError("this jax's Mosaic GPU register layouts differ from the ones the q4_0 word "
                                  f"unpacking was written for; use {fallback}")
    return np.empty(want, dtype=object)


def ptx_pair(nibbles):
    """Mosaic GPU code: the bf16 pair (q_lo - 8, q_hi - 8) of the nibbles at bits 0-3 and 16-19 of
    the i32 `nibbles`, as one lop3 ((w & mask) | exponent) and one bf16x2 subtraction, written as
    PTX. The same steps through MLIR's arith ops (and, or, a bf16 vector subf) made the decode
    kernel 6-11% slower on the H200 (7B shapes at M = 8, bench/results, sixteenth session): the
    conversion's share of gate/up's time went from 3.9 to 2.1 us."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [nibbles],
        f"{{ .reg .b32 t, c; lop3.b32 t, $1, {NIBBLE_PAIR_MASK:#010x}, {BF16_128_PAIR:#010x}, 0xEA; "
        f"mov.b32 c, {BF16_136_PAIR:#010x}; sub.bf16x2 $0, t, c; }}",
        "=r,r",
    )


def q4_0_words_to_bf16(codes):
    """Mosaic GPU code (inside `inline_mgpu`): q4_0 codes [64, tile_k] loaded in the
    WGMMA_UPCAST_4X layout (each thread holds, per 32-block and row, one 32-bit word: bytes 4c..4c+3
    of the block, c = lane % 4, i.e. weights 4c..4c+3 in the low nibbles and 4c+16..4c+19 in the
    high ones) -> the wgmma operand [64, tile_k] bf16 in the WGMMA layout, q - 8 exactly.

    No data moves between threads: the thread's pair j (0..3) of the block, at wgmma columns
    8 j + 2 c and 8 j + 2 c + 1, is nibbles j and j + 4 of its word, i.e. (w >> 4 j) & 0x000F000F
    (one nibble in each 16-bit half), made bf16 by OR-ing in the exponent of 128 (0x4300: 128 + q,
    exact) and subtracting 136 (128 + 8), in PTX (`ptx_pair`). That puts weight
    16 (j % 2) + 4 c + 2 h + j // 2 of the block at wgmma column 8 j + 2 c + h: the even weights, in
    order, then the odd ones, which is the order `permute_x_words` gives x."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    shifts = [None] + [arith.constant(i32, 4 * j) for j in range(1, 4)]
    out = registers_for(codes, fa.WGMMA_LAYOUT, 4, "MosaicMatmulTuning(word_unpack=False)")
    # register index (0, b, 0, 0, row half, 0...) of UPCAST_4X is block b's word; (0, t, ...) of
    # WGMMA is the pair of columns 8 t + 2 c, so block b's pair j is at t = 4 b + j
    for idx, reg in np.ndenumerate(codes.registers):
        word = mgpu_utils.bitcast(reg, i32)
        for j in range(4):
            nibbles = word if j == 0 else arith.shrui(word, shifts[j])
            out[(idx[0], 4 * idx[1] + j, *idx[2:])] = mgpu_utils.bitcast(ptx_pair(nibbles), pair)
    assert all(r is not None for r in out.flat)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


# `q4_0_words_to_s8`: a word's low nibbles (word & NIBBLE_BYTES_MASK) are weights 4c..4c+3 of the
# block, its high ones ((word >> 4) & NIBBLE_BYTES_MASK) weights 4c+16..4c+19, one per byte.
NIBBLE_BYTES_MASK = 0x0F0F0F0F

def q4_0_words_to_s8(codes):
    """Mosaic GPU code (inside `inline_mgpu`): q4_0 codes [64, tile_k] loaded in the
    WGMMA_UPCAST_4X layout (per 32-block and row a thread holds bytes 4c..4c+3, c = lane % 4) ->
    the codes q (0..15, not centred) as s8 [64, tile_k] in WGMMA_LAYOUT_8BIT, in natural column
    order. That layout gives the thread columns 4c..4c+3 of each 16-column tile, four to a
    register: for block b, tile 2b is the word's low nibbles (weights 4c..4c+3) and tile 2b + 1 its
    high ones (weights 4c+16..4c+19), each a mask (and a shift) away, with no data exchanged
    between threads."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    quad = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
    mask = arith.constant(i32, NIBBLE_BYTES_MASK)
    four = arith.constant(i32, 4)
    out = registers_for(codes, fa.WGMMA_LAYOUT_8BIT, 2, "MosaicMatmulTuning(int8_x=False)")
    for idx, reg in np.ndenumerate(codes.registers):
        word = mgpu_utils.bitcast(reg, i32)
        out[(idx[0], 2 * idx[1], *idx[2:])] = mgpu_utils.bitcast(arith.andi(word, mask), quad)
        out[(idx[0], 2 * idx[1] + 1, *idx[2:])] = mgpu_utils.bitcast(arith.andi(arith.shrui(word, four), mask), quad)
    assert all(r is not None for r in out.flat)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=True)


def words_op(c_smem, convert, dtype, layout: str) -> jax.Array:
    """A step's q4_0 codes loaded from shared memory 32 bits per thread (WGMMA_UPCAST_4X) and turned
    into the wgmma operand by `convert` (`q4_0_words_to_bf16` or `q4_0_words_to_s8`, Mosaic GPU
    code inside `inline_mgpu`): `dtype` in Layout `layout`."""
    plgpu = pallas_mgpu()
    codes = load(c_smem, plgpu.Layout.WGMMA_UPCAST_4X)
    return plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, dtype, getattr(plgpu.Layout, layout)),
    )(lambda ctx, words: convert(words))(codes)


# `q6_words_to_bf16` / `ptx_pair6`: pair j of 32-block b (of a 64-block) is the low nibbles
# (word >> 4 j) & NIBBLE_PAIR_MASK and the high two bits of the `qh` word at bits 2 (4 b + j)
# and 16 + 2 (4 b + j), moved to bits 4-5 and 20-21 and masked with CRUMB_PAIR_MASK, OR
# BF16_128_PAIR (two bf16 128 + q, q < 64: exact), minus BF16_160_PAIR (two bf16 160): q - 32.
CRUMB_PAIR_MASK = 0x00300030
BF16_160_PAIR = 0x43204320


def pair6_shifts(block: int, j: int) -> tuple[int, int]:
    """Right shifts (negative: left) that bring pair j of 32-block `block` of a 64-block to where
    `ptx_pair6` reads it: the low nibbles of the `qs` word to bits 0-3 and 16-19, the high two
    bits of the `qh` word, at 2 p and 16 + 2 p (p = 4 (block % 2) + j), to bits 4-5 and 20-21."""
    p = 4 * (block % 2) + j
    return 4 * j, 2 * p - 4


def ptx_pair6(nibbles, crumbs):
    """Mosaic GPU code: the bf16 pair (q_lo - 32, q_hi - 32) of 6-bit codes whose low nibbles sit at
    bits 0-3 and 16-19 of the i32 `nibbles` and high two bits at bits 4-5 and 20-21 of the i32
    `crumbs` (other bits of either ignored), as two lop3 and one bf16x2 subtraction in PTX."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [nibbles, crumbs],
        f"{{ .reg .b32 t, u, c; lop3.b32 u, $2, {CRUMB_PAIR_MASK:#010x}, {BF16_128_PAIR:#010x}, 0xEA; "
        f"lop3.b32 t, $1, {NIBBLE_PAIR_MASK:#010x}, u, 0xEA; mov.b32 c, {BF16_160_PAIR:#010x}; "
        "sub.bf16x2 $0, t, c; }",
        "=r,r,r",
    )


def q6_words_to_bf16(codes, highs):
    """Mosaic GPU code (inside `inline_mgpu`): a "q6_k_split6" step's low nibbles [64, tile_k] and
    high bits [64, tile_k / 2] (both int4 views of the planes, WGMMA_UPCAST_4X: per 32-block and row
    a thread's word of `qs`, per 64-block and row its word of `qh`) -> the wgmma operand [64,
    tile_k] bf16 (WGMMA layout), q - 32 exactly, in natural column order: the split placed column
    8 j + 2 c + h's bits where thread c's pair j finds them (pallas_kernels/q6_k_split.py)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    out = registers_for(codes, fa.WGMMA_LAYOUT, 4, "the 8-bit q6_k_split (--q6-k-split-bits 8)")
    have, want = highs.registers.shape, codes.registers.shape
    if highs.layout != fa.WGMMA_LAYOUT_UPCAST_4X or have != (want[0], want[1] // 2, *want[2:]):
        raise NotImplementedError("this jax's Mosaic GPU register layouts differ from the ones the 6-bit "
                                  "unpacking was written for; use the 8-bit q6_k_split")
    consts = {}

    def shifted(word, bits: int):  # word >> bits (a left shift where bits < 0)
        if bits == 0:
            return word
        if bits not in consts:
            consts[bits] = arith.constant(i32, abs(bits))
        return arith.shrui(word, consts[bits]) if bits > 0 else arith.shli(word, consts[bits])

    for idx, reg in np.ndenumerate(codes.registers):
        word = mgpu_utils.bitcast(reg, i32)
        high = mgpu_utils.bitcast(highs.registers[(idx[0], idx[1] // 2, *idx[2:])], i32)
        for j in range(4):
            low_shift, high_shift = pair6_shifts(idx[1], j)
            out[(idx[0], 4 * idx[1] + j, *idx[2:])] = mgpu_utils.bitcast(
                ptx_pair6(shifted(word, low_shift), shifted(high, high_shift)), pair)
    assert all(r is not None for r in out.flat)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def words6_op(c_smem, h_smem) -> jax.Array:
    """A "q6_k_split6" step's two code planes loaded from shared memory 32 bits per thread and
    turned into the bf16 wgmma operand [64, tile_k] (`q6_words_to_bf16`)."""
    plgpu = pallas_mgpu()
    codes = load(c_smem, plgpu.Layout.WGMMA_UPCAST_4X)
    highs = load(h_smem, plgpu.Layout.WGMMA_UPCAST_4X)
    return plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.Layout.WGMMA_UPCAST_4X),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, plgpu.Layout.WGMMA),
    )(lambda ctx, c, h: q6_words_to_bf16(c, h))(codes, highs)
