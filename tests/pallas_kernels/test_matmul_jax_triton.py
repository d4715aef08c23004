"""The jax-triton matmul (pallas_kernels/matmul_jax_triton.py): the shared conformance checks on
the GPU (marked `gpu`; skipped where there is none or where jax-triton is not installed), and on
the CPU its contract: what it refuses, that it is registered below the reference (chosen only when
forced) and available only on a GPU with jax-triton, and that its default tunings tile the
models' shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul_jax_triton as mjt
from pallas_kernels import matmul_triton, registry
from tests.pallas_kernels.test_matmul_conformance import LLAMA_SHAPES, Case, MatmulConformance
from tests.pallas_kernels.test_matmul_conformance import pytest_generate_tests  # noqa: F401  (parametrizes `case`)
from tests.pallas_kernels.test_matmul_mgpu import SPLITS, _spec, split_cases


def needs_jax_triton(cls):
    for mark in (pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
                 pytest.mark.skipif(not mjt.is_installed(), reason="needs the jax_triton and triton packages")):
        cls = mark(cls)
    return cls


def _t(**kw) -> mjt.JaxTritonMatmulTuning:
    return mjt.JaxTritonMatmulTuning(**kw)


class _JaxTritonBase(MatmulConformance):
    def poison(self):
        jax.block_until_ready(jnp.full((64 << 20,), jnp.nan, jnp.float32))  # freed at once, reused


@needs_jax_triton
class TestJaxTritonGpu(_JaxTritonBase):
    """Default tunings (decode rows split K; prefill rows in 128 x 128 tiles, masked past M) and
    explicit ones (several row tiles of x, split K, small steps)."""

    CASES = (
        Case("q4_0", 1, 256, 1024, "bfloat16"),
        Case("q4_0", 3, 256, 1024, "bfloat16"),
        Case("q4_0", 8, 4096, 4096, "bfloat16", stack=True),
        Case("q4_0", 8, 4096, 11008, "bfloat16", stack=True),  # 43 runs of one K step (11008 = 43 x 256)
        Case("q4_0", 64, 1024, 2048, "bfloat16"),
        Case("q4_0", 200, 1024, 2048, "bfloat16"),  # two row tiles of 128, the second masked
        Case("q4_0", 512, 1024, 4096, "bfloat16", stack=True),
        Case("q4_0", 40, 96, 768, "bfloat16", _t(block_m=16, block_n=32, block_k=64, split_k=3)),
        Case("q4_0", 8, 96, 768, "bfloat16"),  # N not a multiple of 64: 32-row tiles
        Case("q4_0", 200, 96, 768, "bfloat16"),  # prefill tiles of 32 rows of the weight
        Case("q8_0", 1, 256, 1024, "bfloat16"),
        Case("q8_0", 8, 512, 4096, "bfloat16", stack=True),
        Case("q8_0", 8, 4096, 11008, "bfloat16", stack=True),
        Case("q8_0", 512, 1024, 4096, "bfloat16", stack=True),
        Case("q8_0", 40, 96, 768, "bfloat16", _t(block_m=32, block_n=32, block_k=128, split_k=2)),
    )

    def matmul(self, x, w, case, layer=None):
        tuning = case.tuning if isinstance(case.tuning, mjt.JaxTritonMatmulTuning) else None
        return mjt.qmatmul_jax_triton(x, w, tuning, layer=layer)


@needs_jax_triton
class TestJaxTritonGpuSplits(_JaxTritonBase):
    """Each format split at load (Q6_K as int8 codes with a scale per 16; Q4_K, Q5_K, Q4_1, Q5_1
    as a block format plus offsets; Q5_0 as Q8_0) through the kernels."""

    CASES = split_cases(*SPLITS)

    def matmul(self, x, w, case, layer=None):
        return mjt.qmatmul_jax_triton(x, SPLITS[case.fmt](w), layer=layer)


def test_registered_below_the_reference_and_gpu_only():
    impls = {impl.name: impl for impl in registry.implementations("matmul")}
    assert impls["jax_triton"].fn is mjt.qmatmul_jax_triton
    assert impls["jax_triton"].priority < impls["reference"].priority  # only when forced
    if jax.default_backend() != "gpu" or not mjt.is_installed():
        assert not impls["jax_triton"].is_available()


@pytest.mark.parametrize("fmt,m,n,k,dtype", [
    ("q4_1", 8, 256, 1024, jnp.bfloat16), ("q6_k", 8, 256, 1024, jnp.bfloat16), ("f16", 8, 256, 1024, jnp.bfloat16),
    ("q4_0", 8, 40, 1024, jnp.bfloat16), ("q4_0", 8, 256, 1056, jnp.bfloat16), ("q4_0", 8, 256, 1024, jnp.float32),
    ("q8_0", 512, 256, 1024, jnp.float16),
])
def test_refuses_what_it_cannot_take(fmt, m, n, k, dtype):
    with pytest.raises(NotImplementedError):
        jax.eval_shape(mjt.qmatmul_jax_triton, jax.ShapeDtypeStruct((m, k), dtype), _spec(fmt, n, k))


def test_no_interpret_mode_and_stack_needs_a_layer():
    with pytest.raises(NotImplementedError, match="interpret"):
        mjt.qmatmul_jax_triton(jnp.zeros((8, 1024), jnp.bfloat16), _spec("q4_0", 256, 1024), interpret=True)
    with pytest.raises(ValueError, match="needs a layer index"):
        jax.eval_shape(mjt.qmatmul_jax_triton, jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16),
                       _spec("q4_0", 256, 1024, stack=2))


@pytest.mark.parametrize("kwargs", [dict(block_m=8), dict(block_n=48), dict(block_k=32), dict(split_k=0),
                                    dict(num_warps=3), dict(num_stages=0)])
def test_tuning_validation(kwargs):
    with pytest.raises(ValueError):
        mjt.JaxTritonMatmulTuning(**kwargs)


def test_tuning_that_does_not_tile_is_an_error():
    x = jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not tile"):
        jax.eval_shape(lambda x, w: mjt.qmatmul_jax_triton(x, w, _t(block_n=128)), x, _spec("q4_0", 192, 1024))
    with pytest.raises(ValueError, match="does not tile"):
        jax.eval_shape(lambda x, w: mjt.qmatmul_jax_triton(x, w, _t(block_k=512, split_k=3)), x,
                       _spec("q4_0", 192, 1024))


def test_default_tuning_tiles_every_model_shape():
    # and shards of them under tensor parallelism (1376: a 7B's FFN width over 8) and small shapes
    for n, k in LLAMA_SHAPES + [(12288, 4096), (22016, 4096), (28672, 4096), (1376, 4096), (96, 768), (512, 1024)]:
        for m in (1, 2, 3, 8, 16, 33, 64, 65, 512):
            t = mjt.default_tuning(m, n, k)
            mjt.check_tiling(n, k, t)
            steps = k // t.block_k
            if m > mjt.DECODE_ROWS:
                continue
            # the f32 partials stay within half a byte per weight (split * m * n * 4 <= n * k / 2) ...
            assert t.split_k == 1 or t.split_k * m * 4 <= k / 2, (n, k, m, t)
            # ... and the split reaches the target, or no larger even split stays within that
            larger = [s for s in range(t.split_k + 1, steps + 1) if steps % s == 0 and s * m * 4 <= k / 2]
            assert n // t.block_n * t.split_k >= mjt.TARGET_PROGRAMS or not larger, (n, k, m, t)


def test_q4_0_x_parts_are_the_nibbles_order():
    """The kernel's Q4_0 x rearrangement (the Pallas Triton kernels' `x_parts`): part h holds, at
    byte position 16 b + l, the x element weight 32 b + 16 h + l meets (GGUF Q4_0: low nibble of
    byte l is weight l, high weight 16 + l)."""
    m, k = 3, 128
    x = np.arange(m * k, dtype=np.float32).reshape(m, k)
    parts = np.asarray(matmul_triton.x_parts(jnp.asarray(x), 32, 2))
    assert parts.shape == (2, m, k // 2)
    for h in range(2):
        for b in range(k // 32):
            for l in range(16):
                assert (parts[h, :, 16 * b + l] == x[:, 32 * b + 16 * h + l]).all()
