"""pallas_kernels/q4_k_split.py: a Q4_K matrix as Q4_0 codes and scales plus per-block offsets,
held against the Q4_K reference dequantization (itself tested against gguf's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import q4_k_split
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QuantizedTensor, dequantize_reference


def random_q4_k(seed: int, n: int, k: int, d_values=None) -> QuantizedTensor:
    """Random Q4_K planes: codes, 6-bit scales and mins, f16 d and dmin (or d drawn from
    `d_values`)."""
    rng = np.random.default_rng(seed)
    supers = k // 256
    d = rng.uniform(1e-3, 5e-2, (n, supers)) if d_values is None else rng.choice(d_values, (n, supers))
    planes = {
        "qs": rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
        "sc": rng.integers(0, 64, (n, k // 32), dtype=np.uint8),
        "m": rng.integers(0, 64, (n, k // 32), dtype=np.uint8),
        "d": d.astype(np.float16),
        "dmin": rng.uniform(1e-3, 5e-2, (n, supers)).astype(np.float16),
    }
    return QuantizedTensor(planes, "q4_k", (n, k))


def composed_weights(q40: QuantizedTensor, offsets: jax.Array) -> np.ndarray:
    """w' [N, K] f64: the Q4_0 part's dequantization plus each block's offset."""
    w = np.asarray(dequantize_reference(q40), np.float64)
    n, k = w.shape
    return (w.reshape(n, k // 32, 32) + np.asarray(offsets, np.float64).T[..., None]).reshape(n, k)


def test_split_is_exact_where_the_block_scales_fit_f16():
    # d a power of two: d * sc (sc < 64) is exact in f16, so w' = w up to f32 rounding
    w = random_q4_k(0, 64, 512, d_values=[2.0**-7, 2.0**-9, 2.0**-12])
    q40, offsets = q4_k_split.split_q4_k(w)
    assert q40.fmt == "q4_0" and q40.shape == (64, 512) and offsets.shape == (16, 64)
    ref = np.asarray(dequantize_reference(w), np.float64)
    np.testing.assert_allclose(composed_weights(q40, offsets), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_split_moves_each_weight_by_at_most_the_f16_rounding_of_its_scale():
    w = random_q4_k(1, 96, 768)
    q40, offsets = q4_k_split.split_q4_k(w)
    ref = np.asarray(dequantize_reference(w), np.float64)
    diff = np.abs(composed_weights(q40, offsets) - ref)
    n, k = ref.shape
    # |(s_b - d sc_b) q| <= 2^-11 d sc_b * 15, d sc_b bounded by the block's largest |w + dmin m|
    d_sc = np.repeat(np.asarray(w.planes["d"], np.float64), 8, axis=1) * np.asarray(w.planes["sc"], np.float64)
    bound = 2.0**-11 * 15 * np.repeat(d_sc, 32, axis=1) + 1e-6 * np.abs(ref).max()
    assert (diff <= bound).all()
    assert diff.max() > 0  # random d: some scales do not fit f16


@pytest.mark.parametrize("m", [1, 8, 20])
def test_matmul_split_matches_the_q4_k_matmul(m):
    w = random_q4_k(2, 128, 512)
    q40, offsets = q4_k_split.split_q4_k(w)
    x = jax.random.normal(jax.random.key(m), (m, 512), jnp.float32)
    got = np.asarray(jax.jit(q4_k_split.matmul_split)(x, q40, offsets), np.float64)
    want = np.asarray(qmatmul_reference(x, w), np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and err < 5e-4


def test_block_sums():
    x = jnp.arange(2 * 64, dtype=jnp.float32).reshape(2, 64)
    np.testing.assert_array_equal(q4_k_split.block_sums(x), [[496, 1520], [2544, 3568]])


def test_refuses_other_formats_and_stacks():
    w = random_q4_k(3, 8, 256)
    stacked = QuantizedTensor({k: np.stack([v, v]) for k, v in w.planes.items()}, "q4_k", w.shape)
    with pytest.raises(ValueError, match="one matrix"):
        q4_k_split.split_q4_k(stacked)
    q40, _ = q4_k_split.split_q4_k(w)
    with pytest.raises(ValueError, match="takes q4_k"):
        q4_k_split.split_q4_k(q40)
