"""Quantized matmul as a Mosaic GPU kernel (Hopper: TMA, wgmma): implementation "mosaic_gpu" of op
"matmul", of Q4_0 and Q8_0 weights: the decode regime (up to 64 rows of x, `DEFAULT_TUNING`; for
the formats with offsets, `OFFSET_DECODE_TUNING`: folded scales, as in prefill) and the prefill
one (more rows, `PREFILL_TUNING`: folded scales, x in tiles of up to 256 rows on a grid axis, each
tile the wgmma's N).

It reads the planes `pallas_kernels.quant.repack` built, in place (no layout of its own):

  * codes, q4_0: the `qs` plane [N, K/2] uint8 (16 bytes per 32-block) seen as int4 [N, K] (a
    free bitcast), brought to registers 32 bits per thread (Mosaic's WGMMA_UPCAST_4X layout: a
    thread holds bytes 4c..4c+3 of a block's row, c = lane % 4). By default
    (`word_unpack`) each thread makes its own four bf16 pairs of the wgmma operand from that word
    with a shift, a mask-and-OR and one bf16 subtraction per pair (`mgpu_words.q4_0_words_to_bf16`, no data
    exchanged between threads); the weights land at wgmma columns in a fixed order within the
    block (even weights, then odd), and x is permuted the same way outside the kernel
    (`permute_x_words`), which leaves the dot product unchanged. The other way
    (`word_unpack=False`, 8-10% slower per call on the H200, bench/results/ablation-20261129-174950.json)
    moves the codes to the wgmma layout with two warp shuffles per word and converts them there
    with Mosaic's signed int4 conversion: JAX packs int4 low nibble first, so int4 element
    32 g + 2 l + h is weight 32 g + 16 h + l (x permuted by `permute_x`), and XOR with -8 turns the
    nibble's signed reading q - 16 [q >= 8] into q - 8, the centred Q4_0 value.
  * codes, q8_0: the int8 `qs` plane [N, K], in natural order.
  * scales: the `d` plane, which Q4_0 and Q8_0 hold transposed, [K/32, N] f16 ([K/16, N] for
    q6_k_split; bf16 for q4_k_split and q4_1_split) (pallas_kernels/quant.py), so that a block's 64 scales are
    contiguous: the kernel loads them as the row vector that scales the block's [64, M] result. Two
    other ways cost more on the H200 (7B shapes, M = 8): a transposed copy made per call (the first
    cut) cost about 0.8 ms per served decode step in XLA's copies
    (bench/results/trace-20261129-142730.json), and picking each column out of the row-major [64,
    tile_k/32] tile in registers (a masked sum along the row, since a column cannot be loaded in
    that layout) made the kernel 10-45% slower (bench/results/ablation-20261129-161337.json).

One warpgroup per 64 rows of the weight (the wgmma M dimension; `row_tiles` 64-row tiles), a
split of K and a tile of x's rows (all of them in decode; up to `m_tile` each beyond MAX_ROWS);
a TMA pipeline (`emit_pipeline`, up to `stages` steps in flight, fewer where shared memory runs
out) brings each step's x slice [m, tile_k], codes [rows, tile_k] and scales [tile_k/32, rows]
into shared memory. The codes become bf16 in registers (wgmma layout; q8_0, and
q4_0 without `word_unpack`, through Mosaic's int8 / int4 -> bf16 conversions), and each block (32
weights, 16 for q6_k_split: `BLOCK_K`) meets x in one 64 x m x 32 (or 16) wgmma (A from
registers, x as the transposed B operand); the step's
wgmmas are issued before one wait, and each block's [64, m] result is scaled by its scales and
summed in f32 (or, with `fold_scales`, the scales multiply the bf16 codes and every block adds
into one accumulator). Partial sums of the K splits [split, M, N] are added outside.

Where its time goes (bench/results/README.md, sixth session): the kernel is bound by instruction
issue, not memory. Nsight Compute on gate/up (22016 x 4096, M = 8) counts about 500 instructions
per warp per 256-wide K step, the code conversion about half of them; issue slots are 56% busy
at 2.5 warps per scheduler (122 registers and 55 KB of shared memory per CTA allow 4 CTAs per
SM). Sharing x over more rows (`row_tiles`) and folding the scales were both slower on the H200.
Cutting the conversion did not free it either (seventh session): with x rounded to int8 and int8
wgmmas (`int8_x`: a mask and a shift per 8 codes), the gate/up kernel ran 13% fewer instructions
(9.58 M) at 50% issue-slot use and 37% of cycles with no eligible warp, and was 2-9% faster per
call, but rounding x took separate XLA kernels (386 more per served step, +0.6 ms), so it is off.
With about 2.6 warpgroups per SM (N / 64 of them, and K splits cost pipeline refills), each warp
mostly waits: the latency of a step (TMA barrier, shared-memory loads, the wgmma wait) is what
more warps or a persistent grid would have to hide. Writing the q4_0 conversion as PTX
(`mgpu_words.ptx_pair`, sixteenth session) then took it from 3.9 to 2.1 us of gate/up's 21.0 us (19.2 us,
80% of copy bandwidth; 17.1 us with constant codes); a K step's PTX per thread is now, besides the
64 converted pairs, 48 shifts, 64 instructions of scaling (f16 scale loads, conversions, f32
FMAs), 32 zeroing the blocks' accumulators and 32 of wgmma fences, commits and waits
(`bench/kernel_mix.py`). Each call also costs a fixed 3.5-3.9 us beyond its bytes at the copy
rate, whatever the matrix (seventeenth session, M = 8: 4096 x 4096 in 6.3 us for 2.7 us of
bytes, 32000 x 4096 in 25.1 for 21.3): launch, the first loads' latency, the last steps and the
store, which is most of the small matrices' time and about 480 us of a 7B decode step's 129
calls. The tuning's neighbours (the K split, stages, K step, code loads) were all slower or tied
after the PTX conversion, and a store that waits only for its shared-memory read gained nothing.

Exact up to f32 summation with unfolded scales (`DEFAULT_TUNING`: Q4_0, Q8_0 and the Q6_K split
in decode): the codes (4 or 8 bits) and bf16 x are exact in bf16, and their products are exact in
the f32 accumulator. With `fold_scales` (prefill, and the formats with offsets in decode) each
weight is rounded to bf16 first (`q4_k_split.folded_dequantize`). It takes bf16 x only (the GPU engine's activations);
f32 x is refused rather than rounded.

bench/matmul_ablation.py (variant `mgpu_mma`) and bench/kernels.py (`--impls mosaic_gpu`) time it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gated as gated_ffn, q4_k_split, registry
from pallas_kernels.mgpu_store import load as mgpu_load, pallas_mgpu as _plgpu, store_gated, store_out
from pallas_kernels.mgpu_words import q4_0_words_to_bf16, q4_0_words_to_s8, words6_op, words_op
from pallas_kernels.mgpu_tuning import (  # noqa: F401  (re-exported: the kernel's tuning and plan)
    BLOCK_K, BLOCK_N, CODE_BITS, DEFAULT_TUNING, HIGH_BITS, MAX_ROWS, MIN_TILE_K6, OFFSET_DECODE_TUNING,
    PREFILL6_TUNING, PREFILL_TUNING, SMEM_BYTES, SUPPORTED_FORMATS, MosaicMatmulTuning, default_tuning, fuses_offsets,
    padded_rows, resident_ctas, rows_per_cta, split_for, stage_bytes, stages_for, takes_shape, tile_rows,
)
from pallas_kernels.q4_k_split import OFFSET_FORMS
from pallas_kernels.quant import QuantizedTensor, check_layer


def _check_supported(x: jax.Array, w: QuantizedTensor, layer, tuning: MosaicMatmulTuning, gated: bool = False) -> None:
    offsets = w.fmt in OFFSET_FORMS
    if offsets and not fuses_offsets(tuning):
        raise NotImplementedError(f"mosaic_gpu matmul adds {w.fmt} offsets with `fuse_offsets` (unfolded scales) or "
                                  "`fold_offsets` (folded) only")
    if offsets:
        w = q4_k_split.codes_and_scales(w)
    if w.fmt not in SUPPORTED_FORMATS:
        raise NotImplementedError(f"mosaic_gpu matmul takes {', '.join((*SUPPORTED_FORMATS, *OFFSET_FORMS))}; "
                                  f"not {w.fmt}")
    check_layer(w, layer)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {list(x.shape)} does not match weight [{n}, {k}]")
    m = math.prod(x.shape[:-1])
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"mosaic_gpu matmul takes bf16 x (the GPU engine's activations), not {x.dtype}")
    if m > MAX_ROWS and not tuning.fold_scales:
        raise NotImplementedError(f"mosaic_gpu matmul with unfolded scales is the decode kernel: at most {MAX_ROWS} "
                                  f"rows of x, got {m}")
    if n % BLOCK_N:
        raise NotImplementedError(f"mosaic_gpu matmul: N={n} is not a multiple of {BLOCK_N}")
    if k % tuning.tile_k:
        raise NotImplementedError(f"mosaic_gpu matmul: K={k} is not a multiple of the K step {tuning.tile_k}")
    if HIGH_BITS.get(w.fmt) and (not tuning.upcast_loads or tuning.tile_k < MIN_TILE_K6):
        raise NotImplementedError(f"mosaic_gpu matmul reads {w.fmt}'s codes 32 bits per thread: it needs upcast_loads "
                                  f"and K steps of at least {MIN_TILE_K6}")
    if tuning.int8_x and w.fmt != "q4_0":
        raise NotImplementedError(f"mosaic_gpu matmul with int8 x takes q4_0, not {w.fmt}")
    if stages_for(w.fmt, tile_rows(m, tuning), tuning, rows_per_cta(n, tuning), offsets, gated) < 2:
        raise NotImplementedError(f"mosaic_gpu matmul: {m} rows with K steps of {tuning.tile_k} leave shared memory "
                                  "for fewer than 2 steps in flight")


def permute_x(x2: jax.Array, gather: bool = False) -> jax.Array:
    """x [M, K] in the order of the int4 view of the codes: [:, 32 g + 2 l + h] = [:, 32 g + 16 h + l].
    `gather`: the same as a gather (`_permuted`)."""
    return _permuted(x2, (2, 16), gather)


def _permuted(x2: jax.Array, block: tuple[int, int], gather: bool) -> jax.Array:
    """x [M, K] with each 32-block, seen as `block` [a, b], transposed to [b, a]: as a reshape and
    transpose, or with `gather` as a gather of the columns. The same values either way; what
    differs is what XLA fuses: it fuses the transpose into a reduction before it (the RMS norm
    before the q/k/v and gate/up matrices) but not the gather; the gather, not the transpose,
    into the elementwise ops before the output and down projections at some shapes (the
    attention's split merge; SiLU at FFN widths of 14,336 and 18,944: the transpose took a
    kernel of its own there on the H200, bench/results, twentieth session)."""
    m, k = x2.shape
    if gather:
        return jnp.take(x2, jnp.asarray(_block_order(k, block), jnp.int32), axis=1)
    return jnp.reshape(jnp.swapaxes(jnp.reshape(x2, (m, k // 32, *block)), 2, 3), (m, k))


def _block_order(k: int, block: tuple[int, int]) -> np.ndarray:
    """The columns [K] `_permuted` takes: each 32-block, seen as `block` [a, b], transposed."""
    return np.arange(k).reshape(k // 32, *block).swapaxes(1, 2).reshape(k)


def codes_view(qs: jax.Array, k: int) -> jax.Array:
    """A plane of 4-bit codes [*S, N, K/2] uint8 (q4_0's and q6_k_split6's `qs`; with K halved,
    q6_k_split6's `qh`) as int4 [L*N, K]."""
    flat = jnp.reshape(qs, (-1, k // 2))
    return jnp.reshape(lax.bitcast_convert_type(flat, jnp.int4), (flat.shape[0], k))


def permute_x_words(x2: jax.Array, gather: bool = False) -> jax.Array:
    """x [M, K] in the column order `mgpu_words.q4_0_words_to_bf16` gives the codes: within each 32-block
    the even weights, then the odd ones. `gather`: the same as a gather (`_permuted`)."""
    return _permuted(x2, (16, 2), gather)


Q4_0_OFFSET = 8  # q4_0 weight = d (q - 8): the s8 operand is q, the -8 goes to x's block sums


def quantize_x_blocks(x2: jax.Array, m_pad: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [M, K] -> what `int8_x` reads: x rounded per 32-block to q = round(x * 127 / amax) (scale
    dx = amax / 127, llama.cpp's q8_0 rounding), as two int8 copies [M_pad, K] holding the even
    and the odd blocks (the other blocks zero: one 64-wide wgmma then yields a single block's
    product), and per block and row dx and 8 * dx * sum(q) [K/32, M_pad] f32, so that block b of
    q4_0 codes c (0..15) contributes d_w * (dx * (c . q) - 8 * dx * sum(q)) = d_w dx ((c - 8) . q)."""
    m, k = x2.shape
    xb = jnp.reshape(x2.astype(jnp.float32), (m, k // 32, 32))
    amax = jnp.max(jnp.abs(xb), axis=-1)
    dx = amax / 127.0
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.round(xb * inv[..., None]).astype(jnp.int8)
    cx = Q4_0_OFFSET * dx * jnp.sum(q.astype(jnp.int32), axis=-1).astype(jnp.float32)
    even = (jnp.arange(k // 32) % 2 == 0)[None, :, None]
    zero = jnp.zeros_like(q)
    pad = ((0, m_pad - m), (0, 0))
    xe, xo = (jnp.pad(jnp.reshape(jnp.where(sel, q, zero), (m, k)), pad) for sel in (even, ~even))
    return xe, xo, jnp.pad(dx, pad).T, jnp.pad(cx, pad).T


def _codes_bf16(c_smem, fmt: str, upcast_loads: bool, word_unpack: bool) -> jax.Array:
    """One step's codes [64, tile_k] from shared memory as centred bf16 values, in the wgmma layout
    (for q4_0 with `word_unpack`, in the column order of `permute_x_words`)."""
    plgpu = _plgpu()
    if fmt == "q4_0" and word_unpack:
        return words_op(c_smem, q4_0_words_to_bf16, jnp.bfloat16, "WGMMA")
    wgmma_layout = plgpu.Layout.WGMMA
    if upcast_loads:
        load_layout = plgpu.Layout.WGMMA_UPCAST_4X if CODE_BITS[fmt] == 4 else plgpu.Layout.WGMMA_UPCAST_2X
        codes = mgpu_load(c_smem, load_layout)
    else:
        codes = c_smem[...]
    if fmt == "q4_0":
        codes = codes ^ jnp.int4(-8)  # q - 8, exact
    if upcast_loads:
        codes = plgpu.layout_cast(codes, wgmma_layout)
    return codes.astype(jnp.bfloat16)


def _block_scales(d_smem, b: int) -> jax.Array:
    """Block b's 64 scales as f32, contiguous in the transposed plane: the row vector of its
    [64, M] result (one per row, in the layout of a WGMMA row)."""
    plgpu = _plgpu()
    return mgpu_load(d_smem.at[b], plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)


def _scale_and_sum(acc: jax.Array, parts: list[jax.Array], d_smem) -> jax.Array:
    """acc + sum over the step's blocks b of parts[b] [64, M] scaled by block b's 64 scales."""
    for b, part in enumerate(parts):
        acc = acc + part * lax.broadcast_in_dim(_block_scales(d_smem, b), part.shape, [0])
    return acc


def _add_offsets(acc: jax.Array, f_smem, xs_smem, nb: int) -> jax.Array:
    """acc [64, M] + sum over the step's nb blocks b of block b's 64 offsets (f_smem [nb, 64] f16 or bf16,
    down the rows) times x's sums over block b (xs_smem [nb, M] f32, across the columns)."""
    plgpu = _plgpu()
    column = plgpu.Layout.WGMMA.reduce(0)
    for b in range(nb):
        xs = lax.broadcast_in_dim(mgpu_load(xs_smem.at[b], column), acc.shape, [1])
        acc = acc + lax.broadcast_in_dim(_block_scales(f_smem, b), acc.shape, [0]) * xs
    return acc


def _scaled_blocks(a: jax.Array, d_smem, blk: int = 32, f_smem=None) -> list[jax.Array]:
    """The step's codes a [64, tile_k] (bf16, wgmma layout) as its blocks [64, blk], each
    multiplied by its 64 scales rounded to bf16; with f_smem ([nb, 64] f16 or bf16, `fold_offsets`),
    plus its 64 offsets rounded to bf16 (on the H200 the multiply and add compile to one fused
    bf16 multiply-add: one rounding, `q4_k_split.folded_dequantize`)."""
    blocks = []
    for b in range(a.shape[1] // blk):
        shape = (a.shape[0], blk)
        block = a[:, blk * b:blk * (b + 1)] * lax.broadcast_in_dim(_bf16_block_scales(d_smem, b), shape, [0])
        if f_smem is not None:
            block = block + lax.broadcast_in_dim(_bf16_block_scales(f_smem, b), shape, [0])
        blocks.append(block)
    return blocks


def _bf16_block_scales(d_smem, b: int) -> jax.Array:
    """Block b's 64 scales (or offsets) rounded to bf16: a bf16 plane's as loaded, an f16 plane's
    through f32."""
    plgpu = _plgpu()
    v = mgpu_load(d_smem.at[b], plgpu.Layout.WGMMA.reduce(1))
    return v if v.dtype == jnp.bfloat16 else v.astype(jnp.float32).astype(jnp.bfloat16)


def _kernel(layer_gmem, x_gmem, c_gmem, d_gmem, *refs, fmt: str, n: int, k: int, m: int, tile_k: int,
            rows: int, steps: int, split: int, stages: int, upcast_loads: bool, word_unpack: bool,
            fold_scales: bool, rows_out: bool, m_tiles: int = 1, offsets: bool = False, gated: str | None = None):
    """layer_gmem [1] int32; x_gmem [M_pad, K] bf16 (permuted for q4_0), of which this CTA takes
    the m rows of its tile (grid axis "mtile" when m_tiles > 1); c_gmem [L*N, K] codes (int4 or
    int8); d_gmem [L*K/B, N] f16 scales (the transposed plane; B = BLOCK_K[fmt]; bf16 for the 4-bit splits);
    for "q6_k_split6" (`HIGH_BITS`), refs begin with h_gmem [L*N, K/2] int4, the codes' high bits;
    with `offsets` (`OFFSET_FORMS`) and unfolded scales (one tile of x), refs begin with xs_gmem
    [K/32, M_pad] f32, x's block sums, and f_gmem [L*K/32, N] f16 or bf16, the offsets (the `c`
    plane); with folded scales, f_gmem alone (the offsets folded into the weights,
    `fold_offsets`); then o_gmem [split, M_pad, N] f32
    partial sums with o_smem [m, rows] (`rows_out`), else [split, N, M_pad] with [rows, m]; with
    `gated` (one split, `rows_out`), o_gmem [M_pad, N / 2] bf16, act(gate) * up of the
    interleaved weight (`mgpu_store.store_gated`), and g_smem [m, rows / 2] bf16 after o_smem. Each
    warpgroup takes `rows` rows (64-row tiles t) of the weight, one K split and one tile of x."""
    xs_gmem = g_smem = h_gmem = None
    if HIGH_BITS.get(fmt):
        h_gmem, *refs = refs
    if gated:
        *refs, g_smem = refs
    if offsets and fold_scales:
        f_gmem, o_gmem, o_smem = refs
    elif offsets:
        xs_gmem, f_gmem, o_gmem, o_smem = refs
    else:
        o_gmem, o_smem = refs
    plgpu = _plgpu()
    blk = BLOCK_K[fmt]
    nb, tiles = tile_k // blk, rows // BLOCK_N
    bits = CODE_BITS[fmt]
    blk_id, sid = lax.axis_index("rows"), lax.axis_index("split")
    x0 = lax.axis_index("mtile") * m if m_tiles > 1 else 0  # this CTA's rows of x
    layer = layer_gmem[0]
    row0 = layer * n + blk_id * rows
    lo, hi = (sid * steps) // split, ((sid + 1) * steps) // split
    a_swz = plgpu.find_swizzle(tile_k * bits, "lhs")
    h_swz = plgpu.find_swizzle(tile_k * HIGH_BITS[fmt], "lhs") if h_gmem is not None else None
    x_swz = plgpu.find_swizzle(blk * 16, "rhs")  # one block of x's bf16 columns
    wgmma_layout = plgpu.Layout.WGMMA

    def tile_codes(c_smem, t):  # [64, tile_k]
        tile = pl.ds(BLOCK_N * t, BLOCK_N)
        if h_gmem is not None:  # the codes' two planes
            return words6_op(c_smem[0].at[tile], c_smem[1].at[tile])
        return _codes_bf16(c_smem.at[tile], fmt, upcast_loads, word_unpack)

    def x_block(x_smem, b):
        return x_smem.at[:, pl.ds(blk * b, blk)].transpose((1, 0))

    def body(idx, x_smem, c_smem, d_smem, *rest):
        del idx
        accs = rest[-1]
        a = [tile_codes(c_smem, t) for t in range(tiles)]

        def blockdots(*acc_refs):  # every tile's block products issued before one wait
            for i, acc_ref in enumerate(acc_refs):
                t, b = divmod(i, nb)
                plgpu.wgmma(acc_ref, a[t][:, blk * b:blk * (b + 1)], x_block(x_smem, b))
            return [r[...] for r in acc_refs]

        parts = pl.run_scoped(blockdots, *[plgpu.ACC((BLOCK_N, m), jnp.float32) for _ in range(tiles * nb)])
        out = []
        for t in range(tiles):
            tile = pl.ds(BLOCK_N * t, BLOCK_N)
            acc = _scale_and_sum(accs[t], parts[t * nb:(t + 1) * nb], d_smem.at[:, tile])
            if offsets:
                xs_smem, f_smem = rest[:2]
                acc = _add_offsets(acc, f_smem.at[:, tile], xs_smem, nb)
            out.append(acc)
        return tuple(out)

    def folded_body(acc_refs, idx, x_smem, c_smem, d_smem, f_smem=None):
        del idx
        for t, acc_ref in enumerate(acc_refs):
            tile = pl.ds(BLOCK_N * t, BLOCK_N)
            blocks = _scaled_blocks(tile_codes(c_smem, t), d_smem.at[:, tile], blk,
                                    None if f_smem is None else f_smem.at[:, tile])
            for b, ab in enumerate(blocks):
                plgpu.wgmma(acc_ref, ab, x_block(x_smem, b))
        # this step's wgmmas may still run; the previous step's are done, so its x (released
        # one step late) is no longer read
        plgpu.wgmma_wait(tiles * nb)

    def pipeline(body, **kwargs):
        weight_rows = (pl.ds(layer * (k // blk), k // blk), pl.ds(blk_id * rows, rows))  # of the [L*K/blk, N] planes
        in_specs = [
            plgpu.BlockSpec((m, tile_k), lambda j: (0, lo + j),
                            transforms=(plgpu.TilingTransform((8, x_swz * 8 // 16)), plgpu.SwizzleTransform(x_swz)),
                            delay_release=1 if fold_scales else 0),
            plgpu.BlockSpec((rows, tile_k), lambda j: (0, lo + j),
                            transforms=(plgpu.TilingTransform((8, a_swz * 8 // bits)), plgpu.SwizzleTransform(a_swz))),
            plgpu.BlockSpec((nb, rows), lambda j: (lo + j, 0)),
        ]
        args = [x_gmem.at[pl.ds(x0, m)], c_gmem.at[pl.ds(row0, rows)], d_gmem.at[weight_rows]]
        if h_gmem is not None:  # the high bits' plane after the codes; the body takes both as one
            # K steps of MIN_TILE_K6 or more (`_check_supported`): rows of 32 bytes or more, swizzled
            in_specs.insert(2, plgpu.BlockSpec((rows, tile_k * HIGH_BITS[fmt] // 4), lambda j: (0, lo + j), transforms=(
                plgpu.TilingTransform((8, h_swz * 8 // 4)), plgpu.SwizzleTransform(h_swz))))
            args.insert(2, h_gmem.at[pl.ds(row0, rows)])
            inner = body

            def body(idx, x_smem, c_smem, h_smem, *rest):
                return inner(idx, x_smem, (c_smem, h_smem), *rest)
        if offsets and not fold_scales:
            in_specs.append(plgpu.BlockSpec((nb, m), lambda j: (lo + j, 0)))
            args.append(xs_gmem)
        if offsets:
            in_specs.append(plgpu.BlockSpec((nb, rows), lambda j: (lo + j, 0)))
            args.append(f_gmem.at[weight_rows])
        return plgpu.emit_pipeline(
            body,
            grid=(steps,) if split == 1 else (hi - lo,),
            in_specs=in_specs,
            max_concurrent_steps=stages,
            **kwargs,
        )(*args)

    if fold_scales:
        def accumulate(*acc_refs):
            pipeline(functools.partial(folded_body, acc_refs))
            return tuple(plgpu.wgmma_accumulator_load(r, wait_n=0) for r in acc_refs)

        accs = pl.run_scoped(accumulate, *[plgpu.ACC((BLOCK_N, m), jnp.float32) for _ in range(tiles)])
    else:
        zero = plgpu.layout_cast(jnp.zeros((BLOCK_N, m), jnp.float32), wgmma_layout)
        accs = pipeline(body, init_carry=(zero,) * tiles)
    if gated:
        store_gated(accs, o_smem, g_smem, o_gmem, blk_id * rows // 2, x0, m, gated)
    else:
        store_out(accs, o_smem, o_gmem, sid, blk_id * rows, rows_out, x0, m)


def _kernel_int8(layer_gmem, xe_gmem, xo_gmem, dx_gmem, cx_gmem, c_gmem, d_gmem, o_gmem, o_smem, *, n: int,
                 k: int, m: int, tile_k: int, steps: int, split: int, stages: int, rows_out: bool):
    """`int8_x` (q4_0): xe_gmem, xo_gmem [M, K] int8, x's rounded values in its even and its odd
    32-blocks (`quantize_x_blocks`); dx_gmem, cx_gmem [K/32, M] f32 its per-block factors; c_gmem
    [L*N, K] int4 codes; d_gmem [L*K/32, N] f16 scales; o_gmem f32 partial sums as `_kernel`'s
    (one tile of x: at most MAX_ROWS rows).
    Per step, each 64-column chunk of s8 codes meets the even copy and then the odd copy of x's
    chunk in two int8 wgmmas, so every 32-block lands in an accumulator of its own."""
    plgpu = _plgpu()
    nb = tile_k // 32
    blk, sid = lax.axis_index("rows"), lax.axis_index("split")
    layer = layer_gmem[0]
    row0 = layer * n + blk * BLOCK_N
    lo, hi = (sid * steps) // split, ((sid + 1) * steps) // split
    a_swz = plgpu.find_swizzle(tile_k * 4, "lhs")
    x_swz = 64  # bytes of one 64-wide int8 chunk: the K of one wgmma with s8 A in registers
    column = plgpu.Layout.WGMMA.reduce(0)

    def x_chunk(x_smem, j):
        return x_smem.at[:, pl.ds(64 * j, 64)].transpose((1, 0))

    def body(idx, xe_smem, xo_smem, dx_smem, cx_smem, c_smem, d_smem, acc):
        del idx
        a = words_op(c_smem, q4_0_words_to_s8, jnp.int8, "WGMMA_8BIT")  # [64, tile_k] s8

        def scaled(acc, part, b):
            dx = lax.broadcast_in_dim(mgpu_load(dx_smem.at[b], column), part.shape, [1])
            cx = lax.broadcast_in_dim(mgpu_load(cx_smem.at[b], column), part.shape, [1])
            dw = lax.broadcast_in_dim(_block_scales(d_smem, b), part.shape, [0])
            return acc + (part.astype(jnp.float32) * dx - cx) * dw

        def blockdots(*acc_refs):  # block b: chunk b // 2 against the copy of x that keeps b
            for b, acc_ref in enumerate(acc_refs):
                j = b // 2
                plgpu.wgmma(acc_ref, a[:, 64 * j:64 * (j + 1)], x_chunk(xo_smem if b % 2 else xe_smem, j))
            return [r[...] for r in acc_refs]

        parts = pl.run_scoped(blockdots, *[plgpu.ACC((BLOCK_N, m), jnp.int32) for _ in range(nb)])
        for b, part in enumerate(parts):
            acc = scaled(acc, part, b)
        return acc

    def x_spec():
        return plgpu.BlockSpec((m, tile_k), lambda j: (0, lo + j),
                               transforms=(plgpu.TilingTransform((8, x_swz)), plgpu.SwizzleTransform(x_swz)))

    def factor_spec():
        return plgpu.BlockSpec((nb, m), lambda j: (lo + j, 0))

    zero = plgpu.layout_cast(jnp.zeros((BLOCK_N, m), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        body,
        grid=(steps,) if split == 1 else (hi - lo,),
        in_specs=[
            x_spec(), x_spec(), factor_spec(), factor_spec(),
            plgpu.BlockSpec((BLOCK_N, tile_k), lambda j: (0, lo + j),
                            transforms=(plgpu.TilingTransform((8, a_swz * 2)), plgpu.SwizzleTransform(a_swz))),
            plgpu.BlockSpec((nb, BLOCK_N), lambda j: (lo + j, 0)),
        ],
        max_concurrent_steps=stages,
        init_carry=zero,
    )(xe_gmem, xo_gmem, dx_gmem, cx_gmem, c_gmem.at[pl.ds(row0, BLOCK_N)],
      d_gmem.at[pl.ds(layer * (k // 32), k // 32), pl.ds(blk * BLOCK_N, BLOCK_N)])
    store_out((acc,), o_smem, o_gmem, sid, blk * BLOCK_N, rows_out, 0, m)


def tuning_for(w: QuantizedTensor, rows: int) -> MosaicMatmulTuning:
    """The default tuning of a call on weight w with `rows` rows of x (`default_tuning`: the
    formats with offsets fold them in decode)."""
    return default_tuning(rows, w.fmt in OFFSET_FORMS, w.fmt)


def codes_of(w: QuantizedTensor) -> jax.Array:
    """The codes of every stacked matrix as [L*N, K] (free views): int4 for q4_0 (see
    `codes_view`), the int8 `qs` plane of q8_0 and q6_k_split as it is."""
    k = w.shape[1]
    if w.fmt in ("q4_0", "q6_k_split6"):  # 4-bit codes (for q6_k_split6, the low nibbles)
        return codes_view(w.planes["qs"], k)
    return jnp.reshape(w.planes["qs"], (-1, k))  # q8_0, q6_k_split


def high_of(w: QuantizedTensor) -> jax.Array:
    """"q6_k_split6"'s plane of the codes' high two bits [*S, N, K/4] uint8 as int4 [L*N, K/2] (a
    free view, loaded 32 bits per thread as the codes are)."""
    return codes_view(w.planes["qh"], w.shape[1] // 2)


def x_order(w: QuantizedTensor, rows: int, tuning: MosaicMatmulTuning | None = None) -> np.ndarray | None:
    """The column order [K] the kernel reads x [rows, K] in for weight w (it computes
    `x[:, order]` itself unless called with `x_in_order=True`); None: x as it is. Q4_0's codes
    (and those of the formats that run as Q4_0, `OFFSET_FORMS`) unpack in a permuted order
    within each 32-block (`permute_x_words`, or `permute_x` without `word_unpack`)."""
    tuning = tuning or tuning_for(w, rows)
    if tuning.int8_x or OFFSET_FORMS.get(w.fmt, w.fmt) != "q4_0":
        return None
    return _block_order(w.shape[1], (16, 2) if tuning.word_unpack else (2, 16))


def _epilogue_takes(w: QuantizedTensor, tuning: MosaicMatmulTuning) -> bool:
    """Whether the kernel can make the gated product of w under `tuning` itself: not with int8 x
    (its own rounding of x) or columns out, nor where the offsets of `OFFSET_FORMS` are added
    after it (`fuses_offsets`)."""
    if tuning.int8_x or not tuning.rows_out:
        return False
    return w.fmt not in OFFSET_FORMS or fuses_offsets(tuning)


def takes_gated(w: QuantizedTensor, rows: int, act: str) -> bool:
    """Whether `gated=act` on w [N, K] (interleaved) at `rows` rows of x makes the product in
    the kernel at no cost to the matmul: an activation it has, a kernel that can
    (`_epilogue_takes`), and a K the default tuning would not split anyway (the epilogue needs
    whole sums: `split_for` 1, waves not counted: a gated call keeps its last wave partly empty
    rather than lose the epilogue)."""
    n, k = w.shape
    tuning = tuning_for(w, rows)
    if act not in gated_ffn.ACTIVATIONS or n % (2 * gated_ffn.GROUP) or not takes_shape(n, k):
        return False
    if not _epilogue_takes(w, tuning):
        return False
    return split_for(n, k, tuning, -(-rows // tile_rows(rows, tuning))) == 1


@functools.partial(jax.jit, static_argnames=("tuning", "gather_x", "x_in_order", "gated"))
def _qmatmul_jit(x2: jax.Array, w: QuantizedTensor, layer_arr: jax.Array, tuning: MosaicMatmulTuning,
                 gather_x: bool = False, x_in_order: bool = False, gated: str | None = None) -> jax.Array:
    plgpu = _plgpu()
    n, k = w.shape
    m = x2.shape[0]
    offsets = w.fmt in OFFSET_FORMS  # the kernel adds the offsets (`fuses_offsets`): Q4_0's or Q8_0's otherwise
    q = q4_k_split.codes_and_scales(w) if offsets else w
    m_tile = tile_rows(m, tuning)
    m_tiles = -(-m // m_tile)
    m_pad = m_tile * m_tiles
    scales = jnp.reshape(q.planes["d"], (-1, n))  # [L*K/B, N]: a view, read in place
    rows = BLOCK_N if tuning.int8_x else rows_per_cta(n, tuning)
    resident = resident_ctas(q.fmt, m_tile, tuning, rows, offsets and not tuning.int8_x)
    # the epilogue of `gated` needs each output's whole sum: one split
    split, steps = 1 if gated else split_for(n, k, tuning, m_tiles, resident), k // tuning.tile_k
    if tuning.int8_x:
        if x_in_order:
            raise NotImplementedError("mosaic_gpu matmul with int8 x rounds x itself: it takes x in its own order")
        kernel = functools.partial(_kernel_int8, n=n, k=k, m=m_tile, tile_k=tuning.tile_k, steps=steps, split=split,
                                   stages=stages_for(q.fmt, m_tile, tuning, rows), rows_out=tuning.rows_out)
        x_inputs = quantize_x_blocks(x2, m_pad)
    else:
        if q.fmt == "q4_0" and not x_in_order:
            xp = permute_x_words(x2, gather_x) if tuning.word_unpack else permute_x(x2, gather_x)
        else:
            xp = x2
        if m_pad != m:
            xp = jnp.pad(xp, ((0, m_pad - m), (0, 0)))
        kernel = functools.partial(_kernel, fmt=q.fmt, n=n, k=k, m=m_tile, tile_k=tuning.tile_k, rows=rows,
                                   steps=steps, split=split,
                                   stages=stages_for(q.fmt, m_tile, tuning, rows, offsets, bool(gated)),
                                   upcast_loads=tuning.upcast_loads,
                                   word_unpack=tuning.word_unpack, fold_scales=tuning.fold_scales,
                                   rows_out=tuning.rows_out, m_tiles=m_tiles, offsets=offsets, gated=gated)
        x_inputs = (xp,)
    offset_inputs = ()
    if offsets:  # the offsets, and (unless folded) x's block sums [K/32, M_pad]
        offset_inputs = (jnp.reshape(w.planes["c"], (-1, n)),)
        if not tuning.fold_scales:
            # x's order permutes columns within each 32-block only: the same sums, though XLA's
            # reduce may round them differently (a gather back to the model's order, tried, did
            # not make them bit for bit the plain call's on the H200; a fixed order of adds did,
            # at a kernel of its own per call: 549 against 517 per Q4_K_M 7B decode step)
            sums = q4_k_split.block_sums(x2)
            offset_inputs = (jnp.pad(sums, ((0, m_pad - m), (0, 0))).T, *offset_inputs)
    if tuning.rows_out:
        out_shape, smem_shape = (split, m_pad, n), (m_tile, rows)
    else:
        out_shape, smem_shape = (split, n, m_pad), (rows, m_tile)
    out_type, scratch = jax.ShapeDtypeStruct(out_shape, jnp.float32), [plgpu.SMEM(smem_shape, jnp.float32)]
    if gated:
        out_type = jax.ShapeDtypeStruct((m_pad, n // 2), jnp.bfloat16)
        scratch.append(plgpu.SMEM((m_tile, rows // 2), jnp.bfloat16))
    grid, grid_names = (n // rows, split), ("rows", "split")
    if m_tiles > 1:
        grid, grid_names = (*grid, m_tiles), (*grid_names, "mtile")
    partial = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        scratch_types=scratch,
    )(layer_arr, *x_inputs, codes_of(q), scales, *((high_of(q),) if HIGH_BITS.get(q.fmt) else ()), *offset_inputs)
    if gated:
        return partial[:m]
    out = partial[0] if split == 1 else jnp.sum(partial, axis=0)
    return out[:m] if tuning.rows_out else out[:, :m].T


def qmatmul_mgpu(
    x: jax.Array,  # [..., K] bf16
    w: QuantizedTensor,  # [N, K], or a stack [L, N, K] with `layer`
    tuning: MosaicMatmulTuning | None = None,
    *,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
    gather_x: bool = False,
    x_in_order: bool = False,
    gated: str | None = None,
) -> jax.Array:  # [..., N] f32; with `gated`, [..., N / 2] bf16
    """x @ dequant(w).T through the Mosaic GPU kernel; without a tuning, `tuning_for` w and x's
    rows (decode up to 64, prefill beyond) and w's format. "q4_k_split" (Q4_K split at load,
    pallas_kernels/q4_k_split.py) runs as Q4_0 with its offsets folded into the kernel's bf16
    weights (`fold_offsets`, on in OFFSET_DECODE_TUNING and PREFILL_TUNING) or added by the
    unfolded decode kernel (`fuse_offsets`), else as its Q4_0 part plus an XLA dot for them; "q5_k_split"
    (pallas_kernels/q5_k_split.py) likewise as Q8_0, and Q4_1 and Q5_1 split into those forms
    (pallas_kernels/legacy_split.py) as they are (`OFFSET_FORMS`). Raises NotImplementedError for
    what it does not take (formats other than q4_0, q8_0, q6_k_split and those of `OFFSET_FORMS`,
    x not bf16, more than 64 rows of x with unfolded scales, N not a multiple of 64, K not a
    multiple of the tuning's K step, too many rows for shared memory, interpret mode).

    `gather_x`: x's column permutation (Q4_0's kernels read x in the order they unpack the codes)
    as a gather rather than a transpose, for x made by elementwise ops, into which XLA then fuses
    it (`_permuted`); the result is the same. `x_in_order`: x comes already in the column order
    the kernel reads (`x_order`: made so by its producer, e.g. the engine's attention output from
    values whose rows were permuted at load), and is taken as it is.

    `gated` ("silu" or "gelu_tanh", `pallas_kernels.gated.ACTIVATIONS`): w is a gate/up matrix
    in the interleaved layout (`gated.interleave_index`), and the call returns act(gate) * up
    [..., N / 2] in bf16, made in the kernel's epilogue (its K unsplit) where the kernel makes
    the whole product itself, else from its output (`gated.from_interleaved`)."""
    if interpret:
        raise NotImplementedError("mosaic_gpu matmul has no interpret mode")
    tuning = tuning or tuning_for(w, math.prod(x.shape[:-1]))
    if gated is not None:
        if gated not in gated_ffn.ACTIVATIONS:
            raise NotImplementedError(f"mosaic_gpu matmul: no gated activation {gated!r}")
        if w.shape[0] % (2 * gated_ffn.GROUP):
            raise ValueError(f"a gated matmul's weight has pairs of {gated_ffn.GROUP}-row groups: N={w.shape[0]}")
        if not _epilogue_takes(w, tuning):
            y = qmatmul_mgpu(x, w, tuning, layer=layer, gather_x=gather_x, x_in_order=x_in_order)
            return gated_ffn.from_interleaved(y, gated).astype(jnp.bfloat16)
    if w.fmt in OFFSET_FORMS and not fuses_offsets(tuning):  # Q4_0's or Q8_0's kernel, plus the offsets' XLA dot
        # (x in the kernel's order has the same 32-block sums for the offsets, up to rounding)
        return q4_k_split.matmul_via(qmatmul_mgpu, x, w, layer, tuning=tuning,
                                     offset_precision=q4_k_split.KERNEL_OFFSET_PRECISION, gather_x=gather_x,
                                     x_in_order=x_in_order)
    _check_supported(x, w, layer, tuning, gated is not None)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = jnp.reshape(x, (-1, k))
    n_out, dtype = (n // 2, jnp.bfloat16) if gated else (n, jnp.float32)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, n_out), dtype)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return jnp.reshape(_qmatmul_jit(x2, w, layer_arr, tuning, gather_x, x_in_order, gated), (*lead, n_out))


def _is_available() -> bool:
    """A Hopper GPU (compute capability 9.x: wgmma and TMA). A Mosaic GPU import that fails
    there raises: absl-py is a dependency, so that is a broken install, not a missing feature."""
    if jax.default_backend() != "gpu":
        return False
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    if major != "9":
        return False
    _plgpu()
    return True


# The optional protocol of a matmul implementation that permutes x (model/kernels.py reads it):
# it takes `gather_x=True` for x made by elementwise ops.
qmatmul_mgpu.takes_gather_x = True
# ... takes `gated=act` on an interleaved gate/up matrix (pallas_kernels/gated.py), and says
# where that costs the call nothing: `takes_gated(w, rows, act)`
qmatmul_mgpu.takes_gated = takes_gated
# ... and reads x in a column order of its own: `x_order(w, rows)`, which a caller may produce
# itself and pass with `x_in_order=True`.
qmatmul_mgpu.x_order = x_order
registry.register("matmul", "mosaic_gpu", qmatmul_mgpu, is_available=_is_available, priority=20)
