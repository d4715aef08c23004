"""pallas_kernels/q4_k_split.py: a Q4_K matrix as Q4_0 codes and scales plus per-block offsets,
held against the Q4_K reference dequantization (itself tested against gguf's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_dtypes import bfloat16

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


def per_block(w: QuantizedTensor, super_plane: str, sub_plane: str) -> np.ndarray:
    """f64 [N, K/32]: a super-block's f16 value times each sub-block's 6-bit int (d sc_b, dmin m_b)."""
    sup = np.repeat(np.asarray(w.planes[super_plane], np.float64), 8, axis=1)
    return sup * np.asarray(w.planes[sub_plane], np.float64)


# A block's scale or offset rounded to f16 and then to bf16 (the planes' values) is within
# 2^-11 + 2^-8 (1 + 2^-11) of itself: the unit roundoffs of f16's 11-bit and bf16's 8-bit
# significands (a value halfway between two bf16 neighbours after the first rounding goes to the even one)
PLANE_ROUNDING = 2.0**-11 + 2.0**-8 * (1 + 2.0**-11)


def offset_bound(w: QuantizedTensor) -> np.ndarray:
    """[N, K] f64: how far c_b's rounding may move each weight, PLANE_ROUNDING |8 s_b - dmin m_b|
    (2^-25 absolute below f16's normal range, 2^-14), s_b taken at its largest, d sc_b (1 +
    PLANE_ROUNDING)."""
    c = 8 * per_block(w, "d", "sc") * (1 + PLANE_ROUNDING) + per_block(w, "dmin", "m")
    return np.repeat(np.maximum(PLANE_ROUNDING * c, 2.0**-25), 32, axis=1)


def test_split_is_exact_where_the_block_scales_and_offsets_fit_bf16():
    # d a power of two and dmin = 0: d * sc (sc < 64) and 8 d sc are exact in bf16, so the split
    # dequantizes to w up to f32 rounding
    w = random_q4_k(0, 64, 512, d_values=[2.0**-7, 2.0**-9, 2.0**-12])
    w.planes["dmin"][:] = 0
    split = q4_k_split.split_q4_k(w)
    assert split.fmt == "q4_k_split" and split.shape == (64, 512)
    assert {k: v.shape for k, v in split.planes.items()} == {"qs": (64, 256), "d": (16, 64), "c": (16, 64)}
    assert {k: v.dtype for k, v in split.planes.items()} == {"qs": np.uint8, "d": bfloat16, "c": bfloat16}
    assert all(isinstance(v, np.ndarray) for v in split.planes.values())  # the loader's host planes stay numpy
    ref = np.asarray(dequantize_reference(w), np.float64)
    got = np.asarray(dequantize_reference(split), np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_split_moves_each_weight_by_at_most_the_rounding_of_its_scale_and_offset():
    w = random_q4_k(1, 96, 768)
    split = q4_k_split.split_q4_k(w)
    ref = np.asarray(dequantize_reference(w), np.float64)
    diff = np.abs(np.asarray(dequantize_reference(split), np.float64) - ref)
    # |(s_b - d sc_b) q| <= PLANE_ROUNDING d sc_b * 15, plus c_b's own rounding
    bound = PLANE_ROUNDING * 15 * np.repeat(per_block(w, "d", "sc"), 32, axis=1) + offset_bound(w)
    assert (diff <= bound + 1e-6 * np.abs(ref).max()).all()
    assert diff.max() > 0  # random d: some scales do not fit bf16


@pytest.mark.parametrize("m", [1, 8, 20])
def test_q4_0_part_plus_offsets_is_the_q4_k_matmul(m):
    # what the Mosaic GPU matmul runs for the split: Q4_0's matmul on `codes_and_scales`, plus `offset_term`
    w = random_q4_k(2, 128, 512)
    split = jax.device_put(q4_k_split.split_q4_k(w))
    x = jax.random.normal(jax.random.key(m), (m, 512), jnp.float32)
    want = np.asarray(qmatmul_reference(x, w), np.float64)
    composed = jax.jit(lambda x, s: q4_k_split.matmul_via(qmatmul_reference, x, s))
    for got in (composed(x, split), qmatmul_reference(x, split)):
        got = np.asarray(got, np.float64)
        # the planes' bf16 scales and offsets: 1.8-2.0e-3 measured (under 5e-4 with the f16 planes before)
        assert np.isfinite(got).all() and np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


def test_stacked_split_and_a_layer_of_it():
    ws = [random_q4_k(seed, 32, 256) for seed in (4, 5)]
    stacked = QuantizedTensor({k: np.stack([w.planes[k] for w in ws]) for k in ws[0].planes}, "q4_k", (32, 256))
    split = q4_k_split.split_q4_k(stacked)
    x = jax.random.normal(jax.random.key(0), (3, 256), jnp.float32)
    for layer, w in enumerate(ws):
        one = q4_k_split.split_q4_k(w)
        for name in one.planes:
            np.testing.assert_array_equal(split.planes[name][layer], one.planes[name])
        got = q4_k_split.matmul_via(qmatmul_reference, x, split, layer)
        want = np.asarray(qmatmul_reference(x, one))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_jax_planes_in_jax_planes_out():
    split = jax.jit(q4_k_split.split_q4_k)(jax.device_put(random_q4_k(6, 16, 256)))
    assert all(isinstance(v, jax.Array) for v in split.planes.values())
    np.testing.assert_array_equal(split.planes["qs"], q4_k_split.split_q4_k(random_q4_k(6, 16, 256)).planes["qs"])


def test_block_sums():
    x = jnp.arange(2 * 64, dtype=jnp.float32).reshape(2, 64)
    np.testing.assert_array_equal(q4_k_split.block_sums(x), [[496, 1520], [2544, 3568]])


def test_refuses_other_formats():
    split = q4_k_split.split_q4_k(random_q4_k(3, 8, 256))
    with pytest.raises(ValueError, match="takes q4_k"):
        q4_k_split.split_q4_k(split)


@pytest.mark.parametrize("m", [1, 8, 20])
def test_triton_matmul_takes_the_split(m):
    # interpret mode: its Q4_0 kernel on the codes and scales plus the offsets' dot (it serves the
    # shapes and GPUs the Mosaic kernel refuses)
    from pallas_kernels.matmul_triton import qmatmul_triton

    w = random_q4_k(7, 64, 512)
    split = jax.device_put(q4_k_split.split_q4_k(w))
    x = jax.random.normal(jax.random.key(m), (m, 512), jnp.float32)
    got = np.asarray(qmatmul_triton(x, split, interpret=True), np.float64)
    want = np.asarray(qmatmul_reference(x, w), np.float64)
    assert np.isfinite(got).all() and np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3  # bf16 planes: 1.7e-3 at 8 rows


def test_folded_weights_are_the_split_where_every_step_fits_bf16():
    # d a power of two, sub-block scales under 4 and no mins: every scale, offset and weight has
    # at most 7 significant bits, within bf16's 8, so the folded weights are the split's exactly
    w = random_q4_k(1, 64, 512, d_values=[2.0**-7, 2.0**-9])
    w.planes["dmin"][:] = 0
    w.planes["sc"] %= 4
    split = q4_k_split.split_q4_k(w)
    np.testing.assert_array_equal(np.asarray(q4_k_split.folded_dequantize(split)),
                                  np.asarray(dequantize_reference(split)))


def test_folded_weights_round_each_step_to_bf16():
    w = random_q4_k(2, 64, 512)
    split = q4_k_split.split_q4_k(w)
    got = np.asarray(q4_k_split.folded_dequantize(split), np.float64)
    exact = np.asarray(dequantize_reference(w), np.float64)  # Q4_K's own weights
    assert np.array_equal(got.astype(np.float32).astype(jnp.bfloat16).astype(np.float64), got)  # bf16 values
    # three roundings of at most 2^-8 of the value rounded: the scale and the offset (f16, then
    # bf16's 8-bit significand: the planes), and their fused product and sum; none of those
    # values exceeds about 8 |s| + |c|
    d = np.repeat(np.asarray(split.planes["d"], np.float64).T, 32, axis=1)
    c = np.repeat(np.asarray(split.planes["c"], np.float64).T, 32, axis=1)
    bound = 3 * 2.0**-8 * (8 * np.abs(d) + np.abs(c)) * (1 + 2.0**-8) ** 2
    assert np.all(np.abs(got - exact) <= bound)
    assert not np.array_equal(got, exact)  # random scales do not fit bf16


def test_folded_weights_of_a_stack_and_of_the_block_formats():
    from pallas_kernels import q6_k_split
    from tests.pallas_kernels.test_q6_k_split import random_q6_k

    stack = q4_k_split.split_q4_k(QuantizedTensor(
        {k: np.stack([a, b]) for (k, a), b in zip(random_q4_k(3, 64, 256).planes.items(),
                                                   random_q4_k(4, 64, 256).planes.values())}, "q4_k", (64, 256)))
    got = np.asarray(q4_k_split.folded_dequantize(stack))
    for i in range(2):
        one = QuantizedTensor({k: v[i] for k, v in stack.planes.items()}, "q4_k_split", (64, 256))
        np.testing.assert_array_equal(got[i], np.asarray(q4_k_split.folded_dequantize(one)))
    q6 = q6_k_split.split_q6_k(random_q6_k(5, 64, 256))
    got, exact = (np.asarray(f(q6), np.float64) for f in (q4_k_split.folded_dequantize, dequantize_reference))
    np.testing.assert_allclose(got, exact, rtol=2.1 * 2.0**-8, atol=0)  # no offsets: the scale's, the product's
    with pytest.raises(NotImplementedError, match="q4_k"):
        q4_k_split.folded_dequantize(random_q4_k(6, 64, 256))


def test_folded_weights_round_once_after_the_offset():
    # the kernel's multiply and add are one fused bf16 operation (measured on the H200): a weight
    # is bf16(bf16(s) (q - 8) + bf16(c)), which differs from rounding s (q - 8) first wherever
    # that product needs more than bf16's 8 bits
    split = q4_k_split.split_q4_k(random_q4_k(7, 64, 512))
    got = np.asarray(q4_k_split.folded_dequantize(split), np.float32)
    bf16 = jnp.bfloat16
    s = np.repeat(np.asarray(split.planes["d"], np.float32).T, 32, axis=1).astype(bf16).astype(np.float32)
    c = np.repeat(np.asarray(split.planes["c"], np.float32).T, 32, axis=1).astype(bf16).astype(np.float32)
    ones = np.ones_like(split.planes["d"])
    q = np.asarray(dequantize_reference(QuantizedTensor({"qs": split.planes["qs"], "d": ones}, "q4_0", split.shape)))
    once = (s * q + c).astype(bf16).astype(np.float32)
    twice = ((s * q).astype(bf16).astype(np.float32) + c).astype(bf16).astype(np.float32)
    np.testing.assert_array_equal(got, once)
    assert np.mean(once != twice) > 0.05
