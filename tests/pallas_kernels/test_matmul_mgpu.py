"""The Mosaic GPU matmul (pallas_kernels/matmul_mgpu.py), decode and prefill rows: the shared
conformance checks on the GPU (marked `gpu`), and on the CPU its contract: what it refuses, that it registers above the
Triton kernel for the GPU only, its x permutation and int4 view of the codes (checked against the
reference with plain jnp), and that the kernel lowers for CUDA (no GPU needed); and the splits
with offsets through the Pallas Triton matmul on the GPU, the other kernel that reads their planes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    legacy_split, matmul_mgpu, matmul_triton, mgpu_words, q4_k_split, q5_k_split, q6_k_split, quant, registry,
)
from pallas_kernels.matmul import qmatmul_reference
from tests.pallas_kernels.test_matmul_conformance import Case, MatmulConformance, random_weight, relative_error
from tests.pallas_kernels.test_matmul_conformance import pytest_generate_tests  # noqa: F401  (parametrizes `case`)


def _spec(fmt: str, n: int, k: int, stack: int | None = None) -> quant.QuantizedTensor:
    f = quant.ALL_FORMATS[fmt]
    shapes, dtypes = f.plane_shapes(n, k), f.plane_dtypes()
    lead = (stack,) if stack else ()
    return quant.QuantizedTensor({p: jax.ShapeDtypeStruct((*lead, *shapes[p]), dtypes[p]) for p in f.planes}, fmt,
                                 (n, k))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpu(MatmulConformance):
    CASES = (
        Case("q4_0", 1, 256, 1024, "bfloat16"),
        Case("q4_0", 3, 256, 1024, "bfloat16"),
        Case("q4_0", 8, 512, 4096, "bfloat16", stack=True),
        Case("q4_0", 64, 1024, 2048, "bfloat16"),
        Case("q4_0", 8, 4096, 11008, "bfloat16", stack=True),  # K split unevenly (43 steps)
        Case("q4_0", 8, 12288, 4096, "bfloat16"),
        Case("q8_0", 1, 256, 1024, "bfloat16"),
        Case("q8_0", 8, 512, 4096, "bfloat16", stack=True),
        Case("q8_0", 64, 1024, 2048, "bfloat16"),
        Case("q8_0", 8, 4096, 11008, "bfloat16", stack=True),
    )

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, layer=layer)

    def poison(self):
        jax.block_until_ready(jnp.full((64 << 20,), jnp.nan, jnp.float32))


# The splits made at load for the Mosaic kernel, by the GGML format they take: Q4_K and Q4_1 as
# Q4_0's codes and scales plus 16-bit offsets (folded with the scales into the kernel's bf16
# weights, in decode as in prefill), Q5_K and Q5_1 likewise as Q8_0's, Q5_0 as Q8_0 exactly, Q6_K as int8 codes with a scale
# per 16 weights (16-wide wgmmas).
SPLITS = {"q4_k": q4_k_split.split_q4_k, "q5_k": q5_k_split.split_q5_k, "q6_k": q6_k_split.split_q6_k,
          "q4_1": legacy_split.split_q4_1, "q5_0": legacy_split.q5_0_as_q8_0, "q5_1": legacy_split.split_q5_1}


def split_cases(*fmts: str) -> tuple[Case, ...]:
    return tuple(c for fmt in fmts for c in (
        Case(fmt, 1, 256, 1024, "bfloat16"),
        Case(fmt, 8, 512, 4096, "bfloat16", stack=True),
        Case(fmt, 8, 4096, 11008, "bfloat16", stack=True),
        Case(fmt, 64, 1024, 2048, "bfloat16"),
        Case(fmt, 200, 1024, 2048, "bfloat16"),  # prefill rows: the folded-scale kernel
        Case(fmt, 512, 1024, 2048, "bfloat16", stack=True),  # the engine's chunk: stacked, two tiles of x
    ))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuSplits(TestMosaicGpu):
    """Each format split at load (`SPLITS`) through the kernel, against the format's reference."""

    CASES = split_cases(*SPLITS)

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, SPLITS[case.fmt](w), layer=layer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuQ6KSplit6(TestMosaicGpu):
    """Q6_K split with its codes in 6 bits (`q6_k_split.split_q6_k6`: a nibble plane and a plane
    of the high two bits, unpacked by the kernel's 6-bit path), against Q6_K's reference."""

    CASES = split_cases("q6_k")

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, q6_k_split.split_q6_k6(w), layer=layer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuGatherX(TestMosaicGpu):
    """x's permutation as a gather (`gather_x`, the output and down projections' x in the engine)."""

    CASES = (
        Case("q4_0", 8, 512, 4096, "bfloat16", stack=True),
        Case("q4_0", 200, 1024, 2048, "bfloat16"),
        Case("q4_k", 8, 4096, 11008, "bfloat16", stack=True),
        Case("q4_k", 200, 1024, 2048, "bfloat16"),
    )

    def matmul(self, x, w, case, layer=None):
        if case.fmt == "q4_k":
            w = q4_k_split.split_q4_k(w)
        return matmul_mgpu.qmatmul_mgpu(x, w, layer=layer, gather_x=True)


OFFSET_SPLITS = ("q4_k", "q5_k", "q4_1", "q5_1")  # the splits with offsets (`q4_k_split.OFFSET_FORMS`)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuUnfoldedOffsets(TestMosaicGpu):
    """The formats with offsets through the unfolded decode kernel (DEFAULT_TUNING: exact codes,
    f32 block results, each block's offsets times x's block sums added by the kernel), the
    decode default for them until the thirty-fifth session."""

    CASES = tuple(c for c in split_cases(*OFFSET_SPLITS) if c.m <= matmul_mgpu.MAX_ROWS)

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, SPLITS[case.fmt](w), matmul_mgpu.DEFAULT_TUNING, layer=layer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestTritonGpuOffsetSplits(TestMosaicGpu):
    """The same splits through the Pallas Triton matmul compiled for the GPU (where the Mosaic
    kernel refuses a shape, or is not the one chosen): their block format's kernel on the codes and
    scales (bf16 scales for the 4-bit splits) plus the offsets' dot, `q4_k_split.matmul_via`."""

    CASES = split_cases(*OFFSET_SPLITS)

    def matmul(self, x, w, case, layer=None):
        return matmul_triton.qmatmul_triton(x, SPLITS[case.fmt](w), layer=layer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", OFFSET_SPLITS)
@pytest.mark.parametrize("m", [1, 8, 200])
def test_folded_kernel_multiplies_by_the_folded_weights(fmt, m):
    """By default (decode and prefill) the formats with offsets run with scales and offsets
    folded into bf16 weights: the product is x times `q4_k_split.folded_dequantize`'s weights,
    up to f32 summation (far closer than to the exact weights, which the conformance classes
    bound)."""
    rng = np.random.default_rng(m)
    n, k = 512, 4096
    w = jax.tree_util.tree_map(jnp.asarray, SPLITS[fmt](random_weight(fmt, n, k, rng)))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    assert matmul_mgpu.default_tuning(m, offsets=True).fold_offsets
    got = np.asarray(matmul_mgpu.qmatmul_mgpu(x, w), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    folded = x64 @ np.asarray(q4_k_split.folded_dequantize(w), np.float64).T
    exact = x64 @ np.asarray(quant.dequantize_reference(w), np.float64).T
    scale = np.linalg.norm(folded)
    assert np.linalg.norm(got - folded) / scale < 2e-5
    assert np.linalg.norm(exact - folded) / scale > 1e-4  # the folding is visible at all


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuQ4KSplitOffsetsAfter(TestMosaicGpu):
    """The split's offsets as an XLA dot after Q4_0's kernel at its own tuning (the unfolded
    one in decode, `fuse_offsets=False`; the folded one in prefill, `fold_offsets=False`), not
    in it: bench/kernels.py's "...:offsets_after"."""

    CASES = split_cases("q4_k")

    def matmul(self, x, w, case, layer=None):
        tuning = dataclasses.replace(matmul_mgpu.default_tuning(x.shape[0]), fuse_offsets=False, fold_offsets=False)
        return matmul_mgpu.qmatmul_mgpu(x, q4_k_split.split_q4_k(w), tuning, layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuPrefillOffsetsAfter(TestMosaicGpu):
    """The formats with offsets through the prefill (folded-scale) kernel with their offsets left
    to a dot after the call (`fold_offsets` off; by default they are folded into the kernel's
    bf16 weights, which `TestMosaicGpuSplits` and the cases here at the default cover)."""

    CASES = tuple(c for fmt in ("q4_k", "q5_k", "q4_1", "q5_1") for c in (
        Case(fmt, 200, 1024, 2048, "bfloat16"),
        Case(fmt, 512, 1024, 2048, "bfloat16", stack=True),  # the engine's chunk: stacked, two tiles of x
    ))

    def matmul(self, x, w, case, layer=None):
        tuning = dataclasses.replace(matmul_mgpu.PREFILL_TUNING, fold_offsets=False)
        return matmul_mgpu.qmatmul_mgpu(x, SPLITS[case.fmt](w), tuning, layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuShuffleUnpack(TestMosaicGpu):
    """q4_0 through the other conversion (codes moved to the wgmma layout by warp shuffles)."""

    CASES = tuple(c for c in TestMosaicGpu.CASES if c.fmt == "q4_0")

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.MosaicMatmulTuning(word_unpack=False), layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuFoldedScales(TestMosaicGpu):
    """Scales folded into the bf16 codes, one accumulator carried across K steps (`fold_scales`)."""

    CASES = tuple(c for c in TestMosaicGpu.CASES if c.m == 8)

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.MosaicMatmulTuning(fold_scales=True), layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuRowTiles(TestMosaicGpu):
    """Two and four 64-row tiles per warpgroup (fewer where N does not divide), scales unfolded
    and folded."""

    CASES = TestMosaicGpu.CASES + (Case("q4_0", 8, 192, 1024, "bfloat16"),)

    def matmul(self, x, w, case, layer=None):
        tiles, fold = (2, False) if case.n % 1024 else (4, True)
        tuning = matmul_mgpu.MosaicMatmulTuning(tile_k=128, row_tiles=tiles, fold_scales=fold)
        return matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuColumnsOut(TestMosaicGpu):
    """Partial sums written as [split, N, M] and transposed after the call (`rows_out=False`),
    the default path of sessions 4 to 7."""

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.MosaicMatmulTuning(rows_out=False), layer=layer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuPrefillRows(TestMosaicGpu):
    """More than 64 rows of x (the prefill regime): folded scales, x in tiles of `m_tile` rows on
    a grid axis (a last tile padded), in tiles of 128 and of 256."""

    CASES = (
        Case("q4_0", 128, 4096, 4096, "bfloat16", stack=True),  # the engine's 128-token chunk: one tile
        Case("q8_0", 100, 1024, 2048, "bfloat16"),  # one tile of 104
        Case("q4_0", 200, 512, 4096, "bfloat16", stack=True),  # two tiles of 104 (m_tile 128)
        Case("q4_0", 512, 4096, 11008, "bfloat16", stack=True),  # two tiles of 256
        Case("q8_0", 130, 1024, 2048, "bfloat16"),  # two tiles of 72, written as [split, N, M]
        Case("q8_0", 512, 4096, 4096, "bfloat16", stack=True),
    )
    TUNINGS = {  # (m, fmt) -> tuning; the others take PREFILL_TUNING (no tuning given)
        (200, "q4_0"): matmul_mgpu.MosaicMatmulTuning(fold_scales=True, m_tile=128, tile_k=128),
        (130, "q8_0"): matmul_mgpu.MosaicMatmulTuning(fold_scales=True, m_tile=128, tile_k=128, rows_out=False),
    }

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, self.TUNINGS.get((case.m, case.fmt)), layer=layer)


@pytest.mark.gpu
@pytest.mark.variant
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestMosaicGpuInt8X(TestMosaicGpu):
    """q4_0 with x rounded to int8 per 32-block and int8 wgmmas (`int8_x`): within the bf16
    tolerance of the exact product, and equal to the exact product of the rounded x."""

    CASES = tuple(c for c in TestMosaicGpu.CASES if c.fmt == "q4_0")
    TUNING = matmul_mgpu.MosaicMatmulTuning(int8_x=True)

    def matmul(self, x, w, case, layer=None):
        return matmul_mgpu.qmatmul_mgpu(x, w, self.TUNING, layer=layer)

    def test_exact_for_the_rounded_x(self, case):
        rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 63)))
        w = random_weight(case.fmt, case.n, case.k, rng)
        x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.float32).astype(jnp.bfloat16)
        y = np.asarray(self.matmul(x, w, case))
        assert relative_error(y, qmatmul_reference(_rounded_x(x), w)) < 1e-5


@pytest.mark.parametrize("fmt,m,n,k,dtype", [
    ("q4_1", 8, 256, 1024, jnp.bfloat16), ("q5_0", 8, 256, 1024, jnp.bfloat16), ("q4_k", 8, 256, 1024, jnp.bfloat16),
    ("q4_0", 8, 96, 1024, jnp.bfloat16), ("q4_0", 8, 256, 1056, jnp.bfloat16),
    ("q4_0", 8, 256, 1024, jnp.float32),
])
def test_refuses_what_it_cannot_take(fmt, m, n, k, dtype):
    with pytest.raises(NotImplementedError):
        jax.eval_shape(matmul_mgpu.qmatmul_mgpu, jax.ShapeDtypeStruct((m, k), dtype), _spec(fmt, n, k))


def test_int8_x_takes_q4_0_only():
    with pytest.raises(NotImplementedError, match="int8 x"):
        jax.eval_shape(lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.MosaicMatmulTuning(int8_x=True)),
                       jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16), _spec("q8_0", 256, 1024))


def test_no_interpret_mode_and_gpu_only():
    with pytest.raises(NotImplementedError, match="interpret"):
        matmul_mgpu.qmatmul_mgpu(jnp.zeros((8, 1024), jnp.bfloat16), _spec("q4_0", 256, 1024), interpret=True)
    impls = {impl.name: impl for impl in registry.implementations("matmul")}
    assert impls["mosaic_gpu"].priority > impls["triton"].priority
    if jax.default_backend() != "gpu":
        assert not impls["mosaic_gpu"].is_available()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_code_views_and_x_order_give_the_reference_product(fmt):
    """What the kernel computes, in plain jnp: the codes as it views them (int4 XOR -8 for q4_0,
    int8 for q8_0) times each block's scale from the transposed d plane, against x in the
    kernel's order (permuted within each 32-block for q4_0)."""
    n, k = 64, 512
    w = random_weight(fmt, n, k, np.random.default_rng(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, k)), jnp.float32).astype(jnp.bfloat16)
    codes = matmul_mgpu.codes_of(w)
    if fmt == "q4_0":
        codes, x_kernel = codes ^ jnp.int4(-8), matmul_mgpu.permute_x(x)
    else:
        x_kernel = x
    d = jnp.asarray(w.planes["d"], jnp.float32).T  # held [K/32, N]
    deq = jnp.reshape(jnp.reshape(codes.astype(jnp.float32), (n, k // 32, 32)) * d[:, :, None], (n, k))
    y = x_kernel.astype(jnp.float32) @ deq.T
    assert relative_error(y, qmatmul_reference(x, w)) < 1e-5


def _lane_words(w: quant.QuantizedTensor) -> np.ndarray:
    """The q4_0 qs plane as the 32-bit words the kernel's threads load: [N, K/32, lane c] uint32,
    word c of a block = its bytes 4c..4c+3, little-endian."""
    n, k = w.shape
    qs = np.asarray(w.planes["qs"]).reshape(n, k // 32, 4, 4)  # [row, block, lane c, byte]
    return qs.astype(np.uint32) @ (np.uint32(1) << (8 * np.arange(4, dtype=np.uint32)))


def _rounded_x(x: jax.Array) -> jax.Array:
    """x as `quantize_x_blocks` rounds it, in f32: q * amax / 127 per 32-block."""
    m, k = x.shape
    xe, xo, dx, _ = matmul_mgpu.quantize_x_blocks(x, m)
    q = (xe.astype(jnp.float32) + xo.astype(jnp.float32)).reshape(m, k // 32, 32)
    return (q * dx.T[:, :, None]).reshape(m, k)


def test_int8_x_arithmetic_gives_the_product_of_the_rounded_x():
    """`int8_x` restated per block in numpy: the s8 operand is the unsigned code (low nibbles =
    weights 4c..4c+3, high = 4c+16..4c+19 of the word a thread loads, i.e. natural order), each
    32-block meets exactly one of x's two int8 copies, and d_w * (dx * (c . q) - cx) sums to the
    product of the rounded x; that x is within int8 rounding of the original."""
    n, k, m = 64, 512, 5
    w = random_weight("q4_0", n, k, np.random.default_rng(4))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((m, k)), jnp.float32).astype(jnp.bfloat16)
    xe, xo, dx, cx = (np.asarray(a) for a in matmul_mgpu.quantize_x_blocks(x, 8))
    assert xe.dtype == np.int8 and xe.shape == (8, k) and dx.shape == cx.shape == (k // 32, 8)
    assert not xe[m:].any() and not xo[m:].any()  # padding rows
    nb = k // 32
    blocks_e, blocks_o = xe.reshape(8, nb, 32), xo.reshape(8, nb, 32)
    assert not blocks_e[:, 1::2].any() and not blocks_o[:, 0::2].any()
    words = _lane_words(w)
    codes = np.zeros((n, nb, 32), np.int64)
    for c in range(4):
        for byte in range(4):
            codes[:, :, 4 * c + byte] = (words[:, :, c] >> np.uint32(8 * byte)) & 0xF
            codes[:, :, 16 + 4 * c + byte] = (words[:, :, c] >> np.uint32(8 * byte + 4)) & 0xF
    d = np.asarray(w.planes["d"], np.float64).T  # [N, K/32]
    y = np.zeros((8, n))
    for b in range(nb):
        xq = (blocks_e if b % 2 == 0 else blocks_o)[:, b].astype(np.int64)  # [8, 32]
        dots = xq @ codes[:, b].T  # [8, N] integers
        y += (dots * dx[b][:, None] - cx[b][:, None]) * d[:, b][None, :]
    assert relative_error(jnp.asarray(y[:m]), qmatmul_reference(_rounded_x(x), w)) < 1e-5
    assert 1e-4 < relative_error(jnp.asarray(y[:m]), qmatmul_reference(x, w)) < 1e-2


def _bf16_halves(words: np.ndarray) -> np.ndarray:
    """uint32 words -> their two bf16 halves (low, high) as f32, [..., 2]."""
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint32)
    return (halves << 16).view(np.float32)


def test_word_unpack_bit_arithmetic_and_x_order_give_the_reference_product():
    """`_q4_0_words_to_bf16` restated per thread in numpy: lane c of a row holds bytes 4c..4c+3 of
    each 32-block as one word; its pair j, (w >> 4j) & 0x000F000F OR 0x43004300 read as two bf16
    less 136, lands at wgmma columns 8j + 2c (+1). With x in `permute_x_words` order and each
    block's scale, that is the reference product (the register placement is checked on the GPU)."""
    n, k, m = 64, 512, 5
    w = random_weight("q4_0", n, k, np.random.default_rng(2))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((m, k)), jnp.float32).astype(jnp.bfloat16)
    words = _lane_words(w)
    a = np.zeros((n, k // 32, 32), np.float32)
    for j in range(4):
        nibbles = (words >> np.uint32(4 * j)) & np.uint32(mgpu_words.NIBBLE_PAIR_MASK)
        pair = _bf16_halves(nibbles | np.uint32(mgpu_words.BF16_128_PAIR)) - _bf16_halves(
            np.uint32(mgpu_words.BF16_136_PAIR))
        for c in range(4):
            a[:, :, 8 * j + 2 * c:8 * j + 2 * c + 2] = pair[:, :, c, :]
    assert set(np.unique(a)) <= set(range(-8, 8))
    d = np.asarray(w.planes["d"], np.float32).T  # held [K/32, N]
    deq = (a * d[:, :, None]).reshape(n, k)
    y = np.asarray(matmul_mgpu.permute_x_words(x), np.float32) @ deq.T
    assert relative_error(jnp.asarray(y), qmatmul_reference(x, w)) < 1e-5


def test_6bit_word_arithmetic_gives_the_reference_product():
    """`q6_words_to_bf16` restated per thread in numpy: lane c's words of the "q6_k_split6" planes
    (bytes 4c..4c+3 of a row's 32-block of `qs` and of its 64-block of `qh`), shifted as
    `pair6_shifts` says, masked and OR'd as the PTX's two lop3 ((a & b) | c) do and read as two bf16
    less 160, are codes - 32 at wgmma columns 8j + 2c (+1) in natural order; with each 16-block's
    scale that is the reference product (the register placement is checked on the GPU)."""
    from tests.pallas_kernels.test_q6_k_split import random_q6_k

    n, k, m = 64, 512, 5
    w = q6_k_split.split_q6_k6(random_q6_k(4, n, k))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((m, k)), jnp.float32).astype(jnp.bfloat16)
    lo_words = w.planes["qs"].view("<u4").reshape(n, k // 32, 4)  # [row, 32-block, lane]
    hi_words = w.planes["qh"].view("<u4").reshape(n, k // 64, 4)  # [row, 64-block, lane]
    a = np.zeros((n, k // 32, 32), np.float32)
    for b in range(k // 32):
        for j in range(4):
            low_shift, high_shift = mgpu_words.pair6_shifts(b, j)
            nibbles = lo_words[:, b] >> np.uint32(low_shift)
            high = hi_words[:, b // 2]
            crumbs = high >> np.uint32(high_shift) if high_shift >= 0 else high << np.uint32(-high_shift)
            t = (nibbles & np.uint32(mgpu_words.NIBBLE_PAIR_MASK)) | (
                (crumbs & np.uint32(mgpu_words.CRUMB_PAIR_MASK)) | np.uint32(mgpu_words.BF16_128_PAIR))
            pair = _bf16_halves(t) - _bf16_halves(np.uint32(mgpu_words.BF16_160_PAIR))  # [row, lane, 2]
            for c in range(4):
                a[:, b, 8 * j + 2 * c:8 * j + 2 * c + 2] = pair[:, c, :]
    assert set(np.unique(a)) <= set(range(-32, 32))
    d = np.repeat(np.asarray(w.planes["d"], np.float32).T, 16, axis=1)  # held [K/16, N]
    deq = a.reshape(n, k) * d
    y = np.asarray(x, np.float32) @ deq.T
    assert relative_error(jnp.asarray(y), qmatmul_reference(x, w)) < 1e-5


@pytest.mark.parametrize("kwargs", [dict(tile_k=32), dict(tile_k=384), dict(stages=0), dict(target_ctas=0),
                                    dict(upcast_loads=False), dict(row_tiles=3), dict(row_tiles=0),
                                    dict(int8_x=True, fold_scales=True), dict(int8_x=True, row_tiles=2),
                                    dict(int8_x=True, tile_k=64)])
def test_tuning_validation(kwargs):
    with pytest.raises(ValueError):
        matmul_mgpu.MosaicMatmulTuning(**kwargs)


def test_k_must_divide_by_the_tuned_step():
    x, w = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16), _spec("q4_0", 256, 1024)
    jax.eval_shape(lambda x, w: matmul_mgpu._check_supported(x, w, None, matmul_mgpu.MosaicMatmulTuning(512)), x, w)
    with pytest.raises(NotImplementedError, match="K step 256"):
        jax.eval_shape(matmul_mgpu.qmatmul_mgpu, jax.ShapeDtypeStruct((8, 1152), jnp.bfloat16), _spec("q4_0", 256, 1152))


def test_steps_in_flight_fit_shared_memory():
    assert matmul_mgpu.stages_for("q4_0", 8) == matmul_mgpu.DEFAULT_TUNING.stages
    wide = matmul_mgpu.MosaicMatmulTuning(tile_k=512, stages=8)
    for fmt in ("q4_0", "q8_0"):
        for m in (1, 8, 64):
            s = matmul_mgpu.stages_for(fmt, m, wide)
            assert s * matmul_mgpu.stage_bytes(fmt, m, 512) + 64 * matmul_mgpu.padded_rows(m) * 4 <= matmul_mgpu.SMEM_BYTES
    assert matmul_mgpu.stages_for("q8_0", 64, wide) < matmul_mgpu.stages_for("q8_0", 8, wide)


def test_rows_per_warpgroup_divide_n():
    two, four = matmul_mgpu.MosaicMatmulTuning(row_tiles=2), matmul_mgpu.MosaicMatmulTuning(row_tiles=4)
    assert matmul_mgpu.rows_per_cta(4096, four) == 256
    assert matmul_mgpu.rows_per_cta(4224, four) == 128  # 4224 = 33 x 128
    assert matmul_mgpu.rows_per_cta(192, two) == 64
    assert matmul_mgpu.stages_for("q4_0", 8, four) == matmul_mgpu.stages_for("q4_0", 8, four, 256)
    with pytest.raises(ValueError):
        matmul_mgpu.rows_per_cta(96, two)
    assert matmul_mgpu.split_for(4096, 11008, two) == 8  # 32 row blocks x 8 >= 256
    assert matmul_mgpu.stage_bytes("q4_0", 8, 256, 128) == 8 * 256 * 2 + 128 * 128 + 128 * 8 * 2
    # q4_k_split: x's f32 block sums [8 blocks, 8 rows] and the 16-bit offsets [8 blocks, 64 rows] on top
    assert matmul_mgpu.stage_bytes("q4_0", 8, 256, 64, offsets=True) == (
        matmul_mgpu.stage_bytes("q4_0", 8, 256, 64) + 8 * 8 * 4 + 8 * 64 * 2)


def test_split_reaches_the_target_grid():
    assert matmul_mgpu.split_for(22016, 4096) == 1
    assert matmul_mgpu.split_for(12288, 4096) == 2  # 192 row blocks x 2 >= 256
    assert matmul_mgpu.split_for(4096, 11008) == 4  # 64 row blocks x 4 >= 256: at most two CTAs per SM
    assert matmul_mgpu.split_for(4096, 4096) == 4  # 16 K steps, 4 each
    assert matmul_mgpu.split_for(4096, 4096, matmul_mgpu.MosaicMatmulTuning(target_ctas=264)) == 5
    # the prefill kernel keeps the grid it was measured with: 64 row blocks x 2 tiles of x x 3 >= 264
    assert matmul_mgpu.split_for(4096, 4096, matmul_mgpu.PREFILL_TUNING, m_tiles=2) == 3
    assert matmul_mgpu.split_for(256, 256) == 1  # never more splits than K steps


def test_resident_ctas_count_shared_memory():
    # 3 per SM by registers; the 8-bit codes' 4 steps in flight (86 KiB) fit 2 per SM's 228 KiB
    assert matmul_mgpu.resident_ctas("q4_0", 8) == 3 * 132
    assert matmul_mgpu.resident_ctas("q6_k_split6", 8) == 3 * 132
    assert matmul_mgpu.resident_ctas("q8_0", 8) == matmul_mgpu.resident_ctas("q6_k_split", 8) == 2 * 132
    assert matmul_mgpu.resident_ctas("q4_0", 512, matmul_mgpu.PREFILL_TUNING) == 0  # waves not counted
    assert matmul_mgpu.resident_ctas("q4_0", 8, matmul_mgpu.MosaicMatmulTuning(wave_sms=100)) == 300


def test_split_fills_the_last_wave():
    # 500 row tiles: 2 waves' time unsplit and 1.5 in 2 splits at 396 CTAs a wave; equal at 264
    assert matmul_mgpu.split_for(32000, 4096, resident=396) == 2
    assert matmul_mgpu.split_for(32000, 4096, resident=264) == 1
    assert matmul_mgpu.split_for(32000, 4096) == 1  # no waves counted
    assert matmul_mgpu.split_for(22016, 4096, resident=396) == 1  # 344 tiles: one wave
    assert matmul_mgpu.split_for(22016, 4096, resident=264) == 2
    assert matmul_mgpu.split_for(152064, 3584, resident=396) == 1  # 2,376 tiles: 6 whole waves
    assert matmul_mgpu.split_for(128256, 4096, resident=396) == 1  # 2,004 tiles: 5.5 waves against 6, too little
    assert matmul_mgpu.split_for(28672, 4096, resident=396) == 2  # 448 tiles
    assert matmul_mgpu.split_for(4096, 4096, resident=396) == 4  # split by target_ctas as before
    assert matmul_mgpu.split_for(32000, 4352, resident=396) == 1  # 17 K steps: 2 does not divide them


def test_even_split_divides_the_k_steps():
    even = matmul_mgpu.MosaicMatmulTuning(even_split=True, target_ctas=264)
    base = matmul_mgpu.MosaicMatmulTuning(target_ctas=264)
    assert matmul_mgpu.split_for(8192, 4096, base) == 3 and matmul_mgpu.split_for(8192, 4096, even) == 4  # 16 steps
    assert matmul_mgpu.split_for(4096, 4096, even) == 8  # 5 does not divide 16; 8 does, within twice 5
    assert matmul_mgpu.split_for(12288, 4096, even) == 2  # already even
    assert matmul_mgpu.split_for(4096, 11008, even) == 5  # 43 steps: no divisor up to 10, the split stays
    assert matmul_mgpu.split_for(4096, 14336, even) == 7  # 56 steps
    for n, k in [(4096, 4096), (8192, 4096), (6144, 4096), (1024, 4096), (4096, 14336), (64, 256)]:
        split, steps = matmul_mgpu.split_for(n, k, even), k // even.tile_k
        assert matmul_mgpu.split_for(n, k, base) <= split <= steps


@pytest.mark.parametrize("fmt,m,n,k,stack,tile_k,word_unpack,fold,tiles", [
    ("q4_0", 8, 4096, 11008, 3, 256, True, False, 1), ("q4_0", 1, 256, 1024, None, 256, True, False, 1),
    ("q4_0", 64, 512, 4096, 2, 256, True, False, 1), ("q4_0", 8, 512, 4096, 2, 512, True, False, 1),
    ("q4_0", 8, 512, 4096, 2, 64, True, False, 1),
    ("q8_0", 8, 4096, 11008, 3, 256, True, False, 1), ("q8_0", 64, 512, 4096, 2, 512, True, False, 1),
    ("q4_0", 8, 512, 4096, 2, 256, False, False, 1),
    ("q4_0", 8, 4096, 11008, 3, 256, True, True, 1), ("q8_0", 8, 512, 4096, 2, 256, True, True, 1),
    ("q4_0", 8, 4096, 11008, 3, 128, True, False, 2), ("q4_0", 8, 4096, 4096, 3, 64, True, True, 4),
    ("q8_0", 64, 512, 4096, 2, 128, True, False, 2), ("q4_0", 8, 256, 1024, None, 128, False, False, 2),
    ("q4_0", 8, 4096, 11008, 3, 256, True, "int8", 1), ("q4_0", 1, 256, 1024, None, 128, True, "int8", 1),
    ("q4_0", 64, 512, 4096, 2, 512, True, "int8", 1),
])
def test_lowers_for_cuda(fmt, m, n, k, stack, tile_k, word_unpack, fold, tiles):
    pytest.importorskip("absl")  # jax's Mosaic GPU imports it
    w = _spec(fmt, n, k, stack)
    # fold: True (folded scales), False, or "int8" (unfolded, x rounded to int8)
    tuning = matmul_mgpu.MosaicMatmulTuning(tile_k, word_unpack=word_unpack, fold_scales=fold is True, row_tiles=tiles,
                                            int8_x=fold == "int8")
    if stack:
        fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)  # noqa: E731
    else:
        fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning)  # noqa: E731
    lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w,
                                jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("permute", [matmul_mgpu.permute_x, matmul_mgpu.permute_x_words])
def test_x_permutations_as_gathers_are_the_transposes(permute):
    """`gather_x`: the same permutation of x's columns, as a gather (what XLA fuses into
    elementwise producers) rather than a transpose."""
    x = jax.random.normal(jax.random.key(0), (3, 128), jnp.float32)
    as_transpose, as_gather = permute(x), permute(x, gather=True)
    np.testing.assert_array_equal(np.asarray(as_gather), np.asarray(as_transpose))
    assert not np.array_equal(np.asarray(as_transpose), np.asarray(x))
    assert "gather" in str(jax.make_jaxpr(lambda x: permute(x, gather=True))(x))
    assert "transpose" in str(jax.make_jaxpr(permute)(x))


@pytest.mark.parametrize("word_unpack", [True, False])
def test_x_order_is_the_permutation_the_kernel_applies(word_unpack):
    """`x_order` names the columns the kernel reads x in: x[:, order] is what it computes
    itself (`permute_x_words`, or `permute_x` without `word_unpack`), for Q4_0 and the formats
    that run as Q4_0; None where x is read as it is."""
    x = jax.random.normal(jax.random.key(1), (3, 256), jnp.float32)
    tuning = matmul_mgpu.MosaicMatmulTuning(word_unpack=word_unpack, upcast_loads=True)
    permute = matmul_mgpu.permute_x_words if word_unpack else matmul_mgpu.permute_x
    for fmt in ("q4_0", "q4_k_split", "q4_1_split"):
        order = matmul_mgpu.x_order(_spec(fmt, 64, 256), 8, tuning)
        assert sorted(order.tolist()) == list(range(256))
        np.testing.assert_array_equal(np.asarray(x)[:, order], np.asarray(permute(x)))
    for fmt in ("q8_0", "q5_k_split", "q6_k_split"):
        assert matmul_mgpu.x_order(_spec(fmt, 64, 256), 8, tuning) is None
    assert matmul_mgpu.x_order(_spec("q4_0", 64, 256), 8, matmul_mgpu.MosaicMatmulTuning(int8_x=True)) is None
    # the decode and the prefill tunings read Q4_0's x in one order
    w = _spec("q4_0", 64, 256)
    np.testing.assert_array_equal(matmul_mgpu.x_order(w, 8), matmul_mgpu.x_order(w, 512))


@pytest.mark.parametrize("fmt,m", [("q4_0", 8), ("q4_0", 512), ("q4_k_split", 8)])
def test_x_in_order_is_taken_as_it_is(fmt, m):
    """With `x_in_order` the program permutes nothing: x goes to the kernel as given."""
    pytest.importorskip("absl")
    w = _spec(fmt, 512, 1024, 2)
    x = jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16)

    def text(**options):
        fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, layer=i, **options)  # noqa: E731
        return jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()

    plain, in_order = text(), text(x_in_order=True)
    assert "stablehlo.gather" in text(gather_x=True) and "mosaic_gpu" in in_order
    # x's transpose gone (the unfolded Q4_K kernel's offsets would keep a transpose of x's block
    # sums; its folded default takes none), and no gather
    assert plain.count("stablehlo.transpose") == in_order.count("stablehlo.transpose") + 1
    assert "stablehlo.gather" not in in_order
    with pytest.raises(NotImplementedError, match="int8"):
        matmul_mgpu.qmatmul_mgpu(jnp.zeros((8, 1024), jnp.bfloat16), w, matmul_mgpu.MosaicMatmulTuning(int8_x=True),
                                 layer=0, x_in_order=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,m,n,k,unfolded", [("q4_0", 8, 512, 4096, False), ("q4_0", 200, 512, 4096, False),
                                              ("q8_0", 8, 512, 4096, False), ("q4_k", 8, 512, 4096, False),
                                              ("q4_k", 200, 512, 4096, False), ("q4_k", 8, 512, 4096, True)])
def test_x_in_order_gives_the_same_product(fmt, m, n, k, unfolded):
    """x permuted by its producer (`x_order`) and passed with `x_in_order` gives the product of
    the plain call bit for bit where x goes to the kernel alone: every default tuning, Q4_K split
    at load among them (its decode kernel folds the offsets since the thirty-fifth session). The
    unfolded decode kernel (`unfolded`, DEFAULT_TUNING forced) also takes x's block sums for the
    offsets: there the two calls agree up to the sums' f32 rounding (x spans many binades, and
    XLA's reduce of a block may add its values in another order: it did on the H200, also with x
    gathered back to the model's order first)."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 63)))
    w = random_weight(fmt, n, k, rng)
    if fmt == "q4_k":
        w = q4_k_split.split_q4_k(w)
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-12, 12, (m, k)))
    x = jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
    tuning = matmul_mgpu.DEFAULT_TUNING if unfolded else None
    order = matmul_mgpu.x_order(w, m, tuning)
    x_in = x if order is None else x[:, order]
    want = np.asarray(matmul_mgpu.qmatmul_mgpu(x, w, tuning))
    got = np.asarray(matmul_mgpu.qmatmul_mgpu(x_in, w, tuning, x_in_order=True))
    if unfolded:
        # the block sums' f32 rounding, through the offsets: a bound on it from the size of the
        # terms (K/32 blocks of 32 values), not of the result (terms of many binades cancel)
        bound = 2 * np.finfo(np.float32).eps * k * np.abs(np.asarray(x, np.float32)).max()
        bound *= np.abs(np.asarray(w.planes["c"], np.float32)).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt,m", [("q4_0", 8), ("q4_0", 512), ("q4_k_split", 8), ("q4_k_split", 512),
                                   ("q4_1_split", 512), ("q8_0", 8)])
def test_gather_x_lowers_for_cuda(fmt, m):
    """With `gather_x` the Q4_0 kernels' x is permuted by a gather; Q8_0's x is not permuted."""
    pytest.importorskip("absl")
    w = _spec(fmt, 512, 1024, 2)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, layer=i, gather_x=True)  # noqa: E731
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16), w,
                             jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("gather" in text) == (fmt != "q8_0")


@pytest.mark.parametrize("m,fuse,fold", [(1, True, False), (8, True, False), (64, True, False), (8, False, False),
                                         (512, True, False), (512, True, True), (200, True, True)])
def test_q4_k_split_lowers_for_cuda(m, fuse, fold):
    """A Q4_K matrix split at load runs Q4_0's kernel (decode or prefill tuning by its rows)
    on its codes and scales, stacked with a layer index; the unfolded decode kernel
    (DEFAULT_TUNING, not the format's default: `test_decode_folds_the_offsets_by_default`) adds
    the offsets itself (`fuse_offsets`: no dot left in the program), the prefill one leaves
    them to a dot unless it folds them into its weights (`fold_offsets`)."""
    pytest.importorskip("absl")
    w = _spec("q4_k_split", 4096, 11008, 3)
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    tuning = dataclasses.replace(matmul_mgpu.default_tuning(m), fuse_offsets=fuse, fold_offsets=fold)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)  # noqa: E731
    assert jax.eval_shape(fn, x, w, jax.ShapeDtypeStruct((), jnp.int32)).shape == (m, 4096)
    lowered = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    assert ("dot_general" in text) == (not matmul_mgpu.fuses_offsets(tuning)), text.count("dot_general")


@pytest.mark.parametrize("fmt", ["q4_k_split", "q5_k_split", "q4_1_split", "q5_1_split"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_decode_folds_the_offsets_by_default(fmt, m):
    """At decode rows the formats with offsets take OFFSET_DECODE_TUNING (scales and offsets
    folded into the kernel's weights): no dot after the kernel and no block sums of x before it,
    so the program's only reduction is the K splits' sum, as for Q4_0; with DEFAULT_TUNING's
    unfolded kernel, x's block sums are a second one."""
    pytest.importorskip("absl")
    assert matmul_mgpu.default_tuning(m, offsets=True) == matmul_mgpu.OFFSET_DECODE_TUNING
    assert matmul_mgpu.default_tuning(m) == matmul_mgpu.DEFAULT_TUNING
    w = _spec(fmt, 4096, 11008, 3)
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    texts = {}
    for name, tuning in (("default", None), ("unfolded", matmul_mgpu.DEFAULT_TUNING)):
        fn = lambda x, w, i, t=tuning: matmul_mgpu.qmatmul_mgpu(x, w, t, layer=i)  # noqa: E731
        texts[name] = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert all("mosaic_gpu" in t and "dot_general" not in t for t in texts.values())
    assert texts["default"].count("stablehlo.reduce") == 1
    assert texts["unfolded"].count("stablehlo.reduce") == 2


@pytest.mark.parametrize("m,fuse,fold", [(1, True, False), (8, True, False), (8, False, False), (512, True, False),
                                         (512, True, True)])
def test_q5_k_split_lowers_for_cuda(m, fuse, fold):
    """A Q5_K matrix split at load runs Q8_0's kernel on its int8 codes and scales, the unfolded
    decode kernel adding the offsets itself, the prefill one leaving them to a dot unless it
    folds them (as Q4_K's split)."""
    pytest.importorskip("absl")
    w = _spec("q5_k_split", 4096, 11008, 3)
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    tuning = dataclasses.replace(matmul_mgpu.default_tuning(m), fuse_offsets=fuse, fold_offsets=fold)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)  # noqa: E731
    assert jax.eval_shape(fn, x, w, jax.ShapeDtypeStruct((), jnp.int32)).shape == (m, 4096)
    lowered = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    assert ("dot_general" in text) == (not matmul_mgpu.fuses_offsets(tuning)), text.count("dot_general")


@pytest.mark.parametrize("fmt", ["q6_k_split", "q6_k_split6"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_q6_k_split_lowers_for_cuda(m, fmt):
    """A Q6_K matrix split at load runs the 8-bit path (or, "q6_k_split6", the 6-bit one: two
    code planes) with a scale per 16 weights (16-wide wgmmas and x blocks), decode or prefill
    tuning by its rows, stacked with a layer index."""
    pytest.importorskip("absl")
    w = _spec(fmt, 4096, 11008, 3)
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, layer=i)  # noqa: E731
    assert jax.eval_shape(fn, x, w, jax.ShapeDtypeStruct((), jnp.int32)).shape == (m, 4096)
    lowered = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_q6_k_split6_takes_k_steps_of_128_or_more():
    """The 6-bit split's high bits come 32 bytes or more per row and step (swizzled shared
    memory): its prefill tuning has K steps of 128, and a tuning of 64 is refused."""
    pytest.importorskip("absl")
    w = _spec("q6_k_split6", 4096, 11008, 3)
    assert matmul_mgpu.tuning_for(w, 512) == matmul_mgpu.PREFILL6_TUNING
    assert matmul_mgpu.PREFILL6_TUNING.tile_k == matmul_mgpu.MIN_TILE_K6 == 128
    assert matmul_mgpu.tuning_for(_spec("q6_k_split", 4096, 11008), 512) == matmul_mgpu.PREFILL_TUNING
    x = jax.ShapeDtypeStruct((512, 11008), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="K steps of at least 128"):
        jax.eval_shape(lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.PREFILL_TUNING, layer=0), x, w)


@pytest.mark.parametrize("m,m_tile", [(512, 128), (200, 128), (512, 256)])
def test_prefill_rows_take_folded_scales_and_lower_for_cuda(m, m_tile):
    """More than 64 rows: the folded-scale kernel tiles them (a grid axis), and without a tuning
    they get PREFILL_TUNING; the unfolded decode tuning refuses them."""
    pytest.importorskip("absl")
    w = _spec("q4_0", 4096, 11008, 3)
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="decode kernel"):
        jax.eval_shape(lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, matmul_mgpu.DEFAULT_TUNING, layer=0), x, w)
    assert jax.eval_shape(lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, layer=0), x, w).shape == (m, 4096)
    assert matmul_mgpu.default_tuning(m) == matmul_mgpu.PREFILL_TUNING and matmul_mgpu.PREFILL_TUNING.fold_scales
    assert matmul_mgpu.default_tuning(64) == matmul_mgpu.DEFAULT_TUNING
    tiles = -(-m // 256)  # balanced tiles of at most 256 rows, padded to 8
    assert matmul_mgpu.tile_rows(m, matmul_mgpu.PREFILL_TUNING) == -(-(-(-m // tiles)) // 8) * 8
    tuning = matmul_mgpu.MosaicMatmulTuning(fold_scales=True, m_tile=m_tile, tile_k=64)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)  # noqa: E731
    assert jax.eval_shape(fn, x, w, jax.ShapeDtypeStruct((), jnp.int32)).shape == (m, 4096)
    lowered = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("rows_out", [True, False])
@pytest.mark.parametrize("extra", [{}, dict(row_tiles=2, tile_k=128), dict(int8_x=True)])
def test_either_output_order_lowers_for_cuda(rows_out, extra):
    """The output written as [split, M, N] (through a transposed view of shared memory, from
    the WGMMA_TRANSPOSED register layout) or as [split, N, M]; both give [M, N]."""
    pytest.importorskip("absl")
    w = _spec("q4_0", 4096, 11008, 3)
    tuning = matmul_mgpu.MosaicMatmulTuning(rows_out=rows_out, **extra)
    out = jax.eval_shape(lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i),
                         jax.ShapeDtypeStruct((8, 11008), jnp.bfloat16), w, jax.ShapeDtypeStruct((), jnp.int32))
    assert out.shape == (8, 4096)
    lowered = jax.jit(lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)).trace(
        jax.ShapeDtypeStruct((8, 11008), jnp.bfloat16), w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("m,m_tile,expected", [(65, 256, 72), (256, 256, 256), (260, 256, 136), (300, 256, 152),
                                               (384, 256, 192), (512, 256, 256), (513, 256, 176), (200, 128, 104)])
def test_tiles_of_x_rows_are_balanced(m, m_tile, expected):
    """Beyond 64 rows, the fewest tiles of at most m_tile rows, evened out (padding under 8 rows
    a tile), not full tiles and a mostly empty last one."""
    tuning = matmul_mgpu.MosaicMatmulTuning(fold_scales=True, m_tile=m_tile)
    rows = matmul_mgpu.tile_rows(m, tuning)
    assert rows == expected and rows % 8 == 0 and rows <= m_tile
    assert rows * -(-m // rows) - m < 8 * -(-m // rows)
