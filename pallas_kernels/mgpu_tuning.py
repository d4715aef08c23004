"""The Mosaic GPU matmul's tiling and plan (`pallas_kernels/matmul_mgpu.py`, which re-exports
these names): the formats and block sizes the kernel reads, `MosaicMatmulTuning` with the decode
and prefill defaults, the shapes they take, and the arithmetic of one call (rows of x per CTA,
weight rows per warpgroup, shared memory per pipeline step, steps in flight, K splits). Plain
Python: nothing here needs Mosaic or a GPU (the loader asks `takes_shape`)."""

from __future__ import annotations

import dataclasses

SUPPORTED_FORMATS = ("q4_0", "q8_0", "q6_k_split", "q6_k_split6")
# Bits per code of the codes plane as the kernel views it; "q6_k_split6" has a second plane of
# the codes' high bits (`HIGH_BITS` per code, pallas_kernels/q6_k_split.py).
CODE_BITS = {"q4_0": 4, "q8_0": 8, "q6_k_split": 8, "q6_k_split6": 4}
HIGH_BITS = {"q6_k_split6": 2}
# Weights per scale: a block meets x in wgmmas of this K (Q6_K split at load,
# pallas_kernels/q6_k_split.py, has a scale per 16 weights and runs as int8 codes, as Q8_0 does,
# or as 6-bit codes in two planes).
BLOCK_K = {"q4_0": 32, "q8_0": 32, "q6_k_split": 16, "q6_k_split6": 16}
MAX_ROWS = 64  # rows of x in one tile of the decode kernel (unfolded scales: an accumulator per block)
# Beyond MAX_ROWS (prefill), the folded-scale kernel runs x in tiles of `m_tile` rows (a grid axis;
# one [64, m_tile] accumulator, carried across K steps); the unfolded one refuses.
BLOCK_N = 64  # weight rows per warpgroup: the wgmma M


@dataclasses.dataclass(frozen=True)
class MosaicMatmulTuning:
    """Tiling of one call. The defaults won on the H200 (gate/up, q/k/v, down and output
    projection of a 7B at M = 8, the kernel's first cut): `tile_k` 128 or 512, and 3 or 8
    stages, were slower."""

    tile_k: int = 256  # K elements per pipeline step: a power of 2, 64..512 (2..16 blocks of 32, or 4..32 of 16)
    stages: int = 4  # pipeline steps in flight per warpgroup
    # K is split until the grid reaches this many warpgroups (about two per SM of the H200's 132).
    # 256 rather than 264 makes a 4096-row matrix (64 row tiles) 4 splits, not 5: every SM then
    # holds at most two CTAs, the 16 K steps of a 4096-wide K split evenly, and there are fewer
    # partial sums; on the H200 the 4096 x 4096 Q4_0 call went from 6.2 to 5.6 us, a 7B decode
    # step's Mosaic matmuls from 1,584-1,610 to 1,550-1,567 us (bench/results, thirty-third
    # session). Matrices of other widths take the same split either way at the 7B shapes.
    target_ctas: int = 256
    # SMs the GPU runs CTAs on (the H200's 132; 0: off, as in prefill). A matrix of more row
    # tiles than one wave (these SMs times the CTAs one SM holds, `resident_ctas`), which
    # `target_ctas` leaves unsplit, has its K split in 2 where that leaves its last wave much
    # fuller (`split_for`). On the H200 at M = 8 (thirty-ninth session, kernel alone): the 6-bit
    # Q6_K split's 32000 x 4096 (500 tiles at 3 per SM: 1.26 waves unsplit, taking two waves'
    # time, and 2.53 waves of half the steps in 2 splits) went from 50.9 to 39.6 us; at 2 per SM
    # (the 8-bit codes' shared memory) Q8_0's 22016 x 4096 from 36.8 to 32.6 and the 8-bit
    # split's from 42.1 to 36.5, while their 32000 x 4096 (1.89 waves) stays unsplit, where 2
    # splits had made it 2-6% slower. A 7B Q4_0 decode step's Mosaic matmuls: 10-15 us less
    # (the output projection), with one more kernel (its two partial sums added).
    # Llama-3-8B's 128256-row output (6 waves against 5.5 in 2 splits) got 5% faster alone,
    # but its step's Mosaic matmuls 5-8 us slower: a split needs a gain of `WAVE_GAIN`.
    wave_sms: int = 132
    # Codes come out of shared memory 32 bits per thread (Mosaic's upcast layouts: 8 int4 or 4
    # int8 per load) and are moved to the wgmma layout in registers before conversion; False
    # loads them in the wgmma layout itself (8 or 16 bits per load); q4_0 with `word_unpack`
    # always loads 32 bits, so False there is refused.
    upcast_loads: bool = True
    # q4_0: each thread turns the 32-bit word of 8 codes it loads into its four bf16 pairs of the
    # wgmma operand with shifts, masks and one subtraction (`mgpu_words.q4_0_words_to_bf16`), with x
    # permuted to match; False moves the codes to the wgmma layout first (two warp shuffles per
    # word) and converts them there.
    word_unpack: bool = True
    # Each block's scales multiply its bf16 codes before the wgmma (the scale rounded to bf16,
    # then the product, fused with the offset's addition where there is one:
    # `q4_k_split.folded_dequantize`; a weight is off by up to about 2^-7 of itself), so all of a
    # 64-row tile's wgmmas add into one accumulator carried across K steps and a step never
    # waits for its own wgmmas (only for the previous step's, before that step's x is
    # released); False keeps the codes exact, one accumulator per block, and scales the block's
    # [64, M] f32 result after waiting for the step's wgmmas. Slower on the H200 (bench/results,
    # sixth session).
    fold_scales: bool = False
    # 64-row tiles of the weight per warpgroup (fewer where N does not divide): they share each
    # step's x tile, so x is read from L2 once per 64 * row_tiles rows of weights rather than
    # once per 64 (with 8 rows of x, x is half as many bytes as a 64-row tile of q4_0 codes).
    row_tiles: int = 1
    # q4_0: x is rounded to int8 per 32-block (scale amax / 127, as llama.cpp's MMQ kernels and
    # its CPU dot products do) and the codes meet it in int8 wgmmas (s32 accumulators): a word of
    # 8 codes becomes the two s8 registers of the wgmma operand with a mask and a shift (no
    # conversion to bf16, no x permutation; `mgpu_words.q4_0_words_to_s8`). Each block's integer result is
    # scaled by d_w * d_x after the step's wait. Not exact: x's rounding moves a product by about
    # 0.5% (relative norm error; bench/results, seventh session).
    int8_x: bool = False
    # The kernel writes its partial sums as [split, M, N] (each [64, M] accumulator stored
    # through a transposed view of shared memory), so the result needs no transpose after the
    # call and XLA can fuse the split-K sum into whatever reads the rows (the residual add and
    # the next norm); False writes [split, N, M], transposed by XLA after the call.
    rows_out: bool = True
    # Rows of x per CTA when x has more than MAX_ROWS (with `fold_scales` only): the wgmma N,
    # a multiple of 8 up to 256 (fewer rows of x run as one tile of their own size).
    m_tile: int = 256
    # "q4_k_split" (Q4_K split at load, pallas_kernels/q4_k_split.py) and the other formats with
    # offsets (`OFFSET_FORMS`): the unfolded decode kernel (DEFAULT_TUNING; not their default
    # since the thirty-fifth session, OFFSET_DECODE_TUNING folds them) adds each
    # block's offsets (its row of the `c` plane times x's sums over the block) to the block's
    # scaled result, so a split matrix costs one kernel; False, and where the kernel cannot
    # (int8 x, K steps under 128; folded scales unless `fold_offsets`), they are an XLA dot after
    # the call (`q4_k_split.offset_term`).
    fuse_offsets: bool = True
    # The K split rounded up to one that divides the K steps evenly (at most twice the split
    # `target_ctas` gives; else that one): the CTA with the most steps bounds a latency-bound
    # call, and the default split can leave one with a step more than the rest (8192 x 4096:
    # 3 splits of 5, 5 and 6 steps; with this, 4 of 4). Off: on the H200 (twenty-second
    # session) it took a Q4_0 4096 x 4096 call from 6.2 to 5.7 us alone, but a 7B Q4_K_M decode
    # step's Mosaic matmuls from 2,184 to 2,248 us (more partial sums for XLA to add). A
    # `bench/kernels.py --sweep` neighbour.
    even_split: bool = False
    # With `fold_scales`, the formats with offsets: each block's offsets are added to its scaled
    # bf16 codes before the wgmma (the offset rounded to bf16, then the sum, fused with the
    # scale's product), instead of an XLA dot of x's block sums and the offsets after the call.
    # On in PREFILL_TUNING: a 7B Q4_K_M 512-token prefill went from 23.3 to 20.2 ms on the H200
    # (1,114 kernels to 778; the Mosaic matmuls 16.67 -> 16.83 ms; twenty-second session); and
    # in OFFSET_DECODE_TUNING.
    fold_offsets: bool = False

    def __post_init__(self) -> None:
        if self.row_tiles not in (1, 2, 4):
            raise ValueError(f"row_tiles must be 1, 2 or 4, got {self.row_tiles!r}")
        if self.tile_k not in (64, 128, 256, 512):
            raise ValueError(f"tile_k must be 64, 128, 256 or 512, got {self.tile_k!r}")
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        if not isinstance(self.m_tile, int) or not 8 <= self.m_tile <= 256 or self.m_tile % 8:
            raise ValueError(f"m_tile must be a multiple of 8 from 8 to 256, got {self.m_tile!r}")
        if not isinstance(self.target_ctas, int) or self.target_ctas < 1:
            raise ValueError(f"target_ctas must be an int >= 1, got {self.target_ctas!r}")
        if not isinstance(self.wave_sms, int) or self.wave_sms < 0:
            raise ValueError(f"wave_sms must be an int >= 0, got {self.wave_sms!r}")
        if self.word_unpack and not self.upcast_loads:
            raise ValueError("word_unpack reads the codes 32 bits per thread: it needs upcast_loads")
        if self.int8_x and (self.fold_scales or self.row_tiles != 1 or not self.upcast_loads or self.tile_k < 128):
            # tile_k >= 128: a step's x factors [tile_k / 32, 8] f32 must fill a 128-byte copy
            raise ValueError("int8_x takes one 64-row tile, unfolded scales, 32-bit code loads and tile_k >= 128")


DEFAULT_TUNING = MosaicMatmulTuning()
# More than MAX_ROWS rows of x (prefill chunks): folded scales, tiles of up to 256 rows of x, K
# steps of 64. On the H200 at M = 512 (7B shapes, bench/results, eighth session), the kernel
# alone: 410-475 TFLOP/s, 58-61% of XLA's bf16 dot in the same run, against 263-291 for the
# Triton kernel's; the split-K sum and x's permutation add 6.5-18 us per call outside it (4096 x
# 4096: 54 us in all, 46% of the dot). Tiles of 128 rows were 2-7% slower with K steps of 128 and
# 22-28% slower with K steps of 64; tiles of 256 with K steps of 128 (3 stages), 30% slower.
PREFILL_TUNING = MosaicMatmulTuning(tile_k=64, stages=4, fold_scales=True, m_tile=256,
                                    fold_offsets=True, target_ctas=264,  # the grid the prefill was measured with
                                    wave_sms=0)
# "q6_k_split6" (`HIGH_BITS`) reads its high bits' plane tile_k / 4 bytes per row and step, which
# Mosaic GPU loads 32 bits per thread correctly only from swizzled shared memory, 32 bytes or more
# (on the H200 an unswizzled 16-byte tile gave wrong products): K steps of at least MIN_TILE_K6,
# so its prefill takes steps of 128 and, for 4 steps in flight, tiles of 128 rows of x.
MIN_TILE_K6 = 128
PREFILL6_TUNING = dataclasses.replace(PREFILL_TUNING, tile_k=MIN_TILE_K6, m_tile=128)


def takes_shape(n: int, k: int) -> bool:
    """Whether the default decode and prefill tunings take a weight of [N, K] (N a multiple of
    the warpgroup's rows, K of both K steps); formats aside."""
    return n % BLOCK_N == 0 and k % DEFAULT_TUNING.tile_k == 0 and k % PREFILL_TUNING.tile_k == 0


# Decode of the formats with offsets (`q4_k_split.OFFSET_FORMS`: Q4_K, Q4_1, Q5_K and Q5_1 split
# at load): the scales and offsets folded into the bf16 weights, as the prefill kernel does.
# Unfolded, the kernel adds each block's offsets times x's block sums, which XLA makes in a
# reduction kernel of its own before each call (112 of a 7B Q4_K_M decode step's 483 kernels).
# On the H200 (bench/results, thirty-fifth session) the step went from 2.85 / 2.87 to 2.67 /
# 2.73 ms at 1 / 8 busy slots, the Mosaic matmuls themselves unchanged (1,992 against 1,987
# us). The cost is the weights' rounding: a folded weight is within about 2^-8 of its scale's
# and offset's magnitude (`q4_k_split.folded_dequantize`; bench/fold_agreement.py measures
# what that does to agreement with llama.cpp). Q4_0, Q8_0 and the Q6_K split keep DEFAULT_TUNING:
# folding saves them no kernel, and made the Q6_K split's calls 3-5% slower (thirty-fifth
# session) and Q4_0's 4-5% (sixth).
OFFSET_DECODE_TUNING = dataclasses.replace(DEFAULT_TUNING, fold_scales=True, fold_offsets=True)


def default_tuning(m: int, offsets: bool = False, fmt: str | None = None) -> MosaicMatmulTuning:
    """The tuning for m rows of x: for decode (up to MAX_ROWS) DEFAULT_TUNING, or, for a matrix
    with offsets (`offsets`: its format in `q4_k_split.OFFSET_FORMS`), OFFSET_DECODE_TUNING; else
    PREFILL_TUNING (PREFILL6_TUNING for `fmt` "q6_k_split6")."""
    if m > MAX_ROWS:
        return PREFILL6_TUNING if HIGH_BITS.get(fmt) else PREFILL_TUNING
    return OFFSET_DECODE_TUNING if offsets else DEFAULT_TUNING


def fuses_offsets(tuning: MosaicMatmulTuning) -> bool:
    """Whether the kernel adds the offsets of a matrix in `OFFSET_FORMS` itself: the unfolded decode
    kernel with `fuse_offsets` (bf16 x, and K steps of at least 128: a step's block sums of x,
    [tile_k / 32, 8] f32, must fill a 128-byte copy), the folded one with `fold_offsets`."""
    if tuning.fold_scales:
        return tuning.fold_offsets
    return tuning.fuse_offsets and not tuning.int8_x and tuning.tile_k >= 128


SMEM_BYTES = 227 * 1024  # shared memory one CTA may use on the H100/H200
SM_SMEM_BYTES = 228 * 1024  # shared memory of one SM, 1 KiB of it reserved per CTA
# CTAs of the decode kernel one SM holds by its registers: 161-167 per thread of a 128-thread
# warpgroup (ptxas, bench/kernel_mix.py; thirty-eighth session), 3 of 64 Ki.
REG_CTAS_PER_SM = 3
# `wave_sms`: 2 splits must take at most this share of the unsplit call's waves' time
WAVE_GAIN = 0.85


def padded_rows(m: int) -> int:
    """Rows of x as the kernel runs them: a multiple of 8 (the wgmma N)."""
    return -(-m // 8) * 8


def tile_rows(m: int, tuning: MosaicMatmulTuning = DEFAULT_TUNING) -> int:
    """Rows of x per CTA (a multiple of 8): all of them up to MAX_ROWS; beyond, the fewest tiles
    of at most `tuning.m_tile` rows, balanced (300 rows: two tiles of 152, not 256 + 256)."""
    if m <= MAX_ROWS:
        return padded_rows(m)
    tiles = -(-m // tuning.m_tile)
    return padded_rows(-(-m // tiles))


def rows_per_cta(n: int, tuning: MosaicMatmulTuning = DEFAULT_TUNING) -> int:
    """Weight rows per warpgroup: 64 * `tuning.row_tiles`, halved until they divide N (a multiple of 64)."""
    if n % BLOCK_N:
        raise ValueError(f"N={n} is not a multiple of {BLOCK_N}")
    tiles = tuning.row_tiles
    while n % (BLOCK_N * tiles):
        tiles //= 2
    return BLOCK_N * tiles


def stage_bytes(fmt: str, m: int, tile_k: int, rows: int = BLOCK_N, int8_x: bool = False,
                offsets: bool = False) -> int:
    """Shared memory of one pipeline step: x [M, tile_k] bf16, codes [rows, tile_k] (and their high
    bits' plane, `HIGH_BITS`), scales. With
    `int8_x`, x's two int8 copies take the bytes of the bf16 one, and its two f32 factors per block
    and row come on top; with `offsets` (`OFFSET_FORMS`), x's f32 block sums and the 16-bit offsets.
    (The folded kernel loads no block sums, so for it this overcounts: the Q5_K and Q5_1 splits'
    gated calls at 57-64 and at 256 rows get 3 steps in flight where the count without them
    gives 4. At 256 rows (gated prefill) those 4 would fill shared memory to the last of the
    1,024 bytes kept for barriers and alignment, which the small planes' buffers may need; so
    left until both are measured on the GPU: only the 8- and 64-row gated cases ran there.)"""
    extra = 2 * padded_rows(m) * (tile_k // 32) * 4 if int8_x else 0
    if offsets:
        extra += (padded_rows(m) * 4 + rows * 2) * (tile_k // 32)
    scales = rows * (tile_k // BLOCK_K[fmt]) * 2
    codes = rows * tile_k * (CODE_BITS[fmt] + HIGH_BITS.get(fmt, 0)) // 8
    return padded_rows(m) * tile_k * 2 + codes + scales + extra


def _fixed_smem(m: int, rows: int, gated: bool) -> int:
    """Shared memory a CTA holds beside its steps in flight: the [rows, m] f32 output tile, with
    `gated` the [rows / 2, m] bf16 product's, and 1 KiB of barriers and alignment."""
    return rows * padded_rows(m) * (4 + (1 if gated else 0)) + 1024


def stages_for(fmt: str, m: int, tuning: MosaicMatmulTuning = DEFAULT_TUNING, rows: int | None = None,
               offsets: bool = False, gated: bool = False) -> int:
    """Steps in flight: `tuning.stages`, or as many as fit beside the [rows, m] f32 output tile
    (m: the CTA's rows of x, `tile_rows`; rows: `rows_per_cta(n, tuning)`, by default the most
    the tuning allows) and, `gated`, the [rows / 2, m] bf16 product's."""
    rows = BLOCK_N * tuning.row_tiles if rows is None else rows
    room = SMEM_BYTES - _fixed_smem(m, rows, gated)
    return min(tuning.stages, room // stage_bytes(fmt, m, tuning.tile_k, rows, tuning.int8_x, offsets))


def resident_ctas(fmt: str, m: int, tuning: MosaicMatmulTuning = DEFAULT_TUNING, rows: int | None = None,
                  offsets: bool = False, gated: bool = False) -> int:
    """CTAs the GPU runs at once (`wave_sms` SMs; 0 with it off): each SM holds REG_CTAS_PER_SM,
    or fewer where their shared memory (`stages_for` steps in flight and the output tile, as
    the kernel allocates them) does not fit."""
    rows = BLOCK_N * tuning.row_tiles if rows is None else rows
    stages = stages_for(fmt, m, tuning, rows, offsets, gated)
    smem = stages * stage_bytes(fmt, m, tuning.tile_k, rows, tuning.int8_x, offsets) + _fixed_smem(m, rows, gated)
    return tuning.wave_sms * min(REG_CTAS_PER_SM, SM_SMEM_BYTES // (smem + 1024))


def split_for(n: int, k: int, tuning: MosaicMatmulTuning = DEFAULT_TUNING, m_tiles: int = 1,
              resident: int = 0) -> int:
    """K splits: the fewest giving `target_ctas` warpgroups (with `m_tiles` tiles of x's rows),
    at most one per K step; with `even_split`, rounded up to divide the steps. Beyond one wave
    of `resident` CTAs (`resident_ctas`; 0: no waves counted), 2 splits where they divide the
    steps and take at most WAVE_GAIN of the waves' time of one (each wave as long as a CTA's
    steps): a split adds [M, N] f32 partial sums to write and add."""
    ctas = (n // rows_per_cta(n, tuning)) * m_tiles
    steps = k // tuning.tile_k
    split = max(1, min(steps, -(-tuning.target_ctas // ctas)))
    if tuning.even_split:
        split = next((s for s in range(split, min(steps, 2 * split) + 1) if steps % s == 0), split)
    if resident and split == 1 and ctas > resident and steps % 2 == 0:
        waves = -(-ctas // resident), -(-2 * ctas // resident) / 2
        split = 2 if waves[1] <= WAVE_GAIN * waves[0] else 1
    return split
