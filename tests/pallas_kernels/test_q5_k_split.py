"""pallas_kernels/q5_k_split.py: a Q5_K matrix as Q8_0 codes and scales plus per-block offsets,
held against gguf's own Q5_K dequantization (llama.cpp's Python reference) and ours."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import q4_k_split, q5_k_split, quant
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QuantizedTensor, dequantize_reference


def random_q5_k_blocks(seed: int, n: int, k: int, d_values=None, zero_dmin: bool = False) -> np.ndarray:
    """Random Q5_K rows as GGUF bytes [N, K/256 * 176]: random codes and 6-bit scales and mins,
    f16 d (or d drawn from `d_values`) and dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * (k // 256), 176), dtype=np.uint8)
    d = rng.uniform(1e-3, 5e-2, len(blocks)) if d_values is None else rng.choice(d_values, len(blocks))
    blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    dmin = np.zeros(len(blocks)) if zero_dmin else rng.uniform(1e-3, 5e-2, len(blocks))
    blocks[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def q5_k_tensor(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    return quant.repack(raw, gguf.GGMLQuantizationType.Q5_K, (n, k))


def test_split_matches_gguf_where_the_block_scales_and_offsets_fit_f16():
    # d a power of two and dmin = 0: d sc (sc < 64) and 16 d sc are exact in f16, so the split
    # dequantizes to llama.cpp's weights exactly
    n, k = 64, 512
    raw = random_q5_k_blocks(0, n, k, d_values=[2.0**-7, 2.0**-9, 2.0**-12], zero_dmin=True)
    split = q5_k_split.split_q5_k(q5_k_tensor(raw, n, k))
    assert split.fmt == "q5_k_split" and split.shape == (n, k)
    assert {p: (v.shape, v.dtype) for p, v in split.planes.items()} == {
        "qs": ((n, k), np.int8), "d": ((k // 32, n), np.float16), "c": ((k // 32, n), np.float16)}
    assert all(isinstance(v, np.ndarray) for v in split.planes.values())  # the loader's host planes stay numpy
    assert split.planes["qs"].min() == -16 and split.planes["qs"].max() == 15
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(n, k)
    np.testing.assert_array_equal(np.asarray(dequantize_reference(split)), want)


def test_split_moves_each_weight_by_at_most_the_f16_rounding_of_its_scale_and_offset():
    n, k = 96, 768
    raw = random_q5_k_blocks(1, n, k)
    w = q5_k_tensor(raw, n, k)
    split = q5_k_split.split_q5_k(w)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(n, k).astype(np.float64)
    diff = np.abs(np.asarray(dequantize_reference(split), np.float64) - ref)
    sup = lambda p: np.repeat(np.asarray(w.planes[p], np.float64), 8, axis=1)  # noqa: E731
    d_sc, dmin_m = sup("d") * np.asarray(w.planes["sc"], np.float64), sup("dmin") * np.asarray(w.planes["m"], np.float64)
    # w' - w = (s_b - d sc_b) q + (c_b's rounding): at most 2^-11 d sc_b * 31 plus 2^-11 |16 s_b - dmin m_b|
    c = 16 * d_sc * (1 + 2.0**-11) + dmin_m
    bound = np.repeat(2.0**-11 * 31 * d_sc + np.maximum(2.0**-11 * c, 2.0**-25), 32, axis=1)
    assert (diff <= bound + 1e-6 * np.abs(ref).max()).all()
    assert diff.max() > 0  # random d: some scales do not fit f16


def test_device_split_equals_the_host_split_and_keeps_the_stack():
    n, k = 64, 512
    layers = [q5_k_tensor(random_q5_k_blocks(2 + i, n, k), n, k) for i in range(3)]
    w = QuantizedTensor({p: np.stack([t.planes[p] for t in layers]) for p in layers[0].planes}, "q5_k", (n, k))
    host = q5_k_split.split_q5_k(w)
    device = jax.jit(q5_k_split.split_q5_k)(jax.device_put(w))
    assert host.stack_shape == (3,) and host.planes["c"].shape == (3, k // 32, n)
    for p in host.planes:
        np.testing.assert_array_equal(np.asarray(device.planes[p]), host.planes[p])
    for i in range(3):
        one = q5_k_split.split_q5_k(quant.layer_of(w, i))
        for p in host.planes:
            np.testing.assert_array_equal(host.planes[p][i], one.planes[p])


@pytest.mark.parametrize("m", [1, 8, 20])
def test_q8_0_part_plus_offsets_is_the_q5_k_matmul(m):
    # what the Triton matmul runs (and the Mosaic GPU one where a tuning neither adds nor folds the offsets):
    # Q8_0's matmul on its codes and scales, plus the offsets
    n, k = 128, 512
    w = q5_k_tensor(random_q5_k_blocks(5, n, k), n, k)
    split = jax.device_put(q5_k_split.split_q5_k(w))
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    want = np.asarray(qmatmul_reference(x, w), np.float64)
    composed = jax.jit(lambda x, s: q4_k_split.matmul_via(qmatmul_reference, x, s))
    for got in (composed(x, split), qmatmul_reference(x, split)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3  # f16 scales and offsets


def test_other_formats_are_refused():
    with pytest.raises(ValueError, match="takes q5_k"):
        q5_k_split.split_q5_k(QuantizedTensor({"qs": np.zeros((2, 16), np.uint8), "d": np.zeros((2, 1), np.float16)},
                                              "q4_0", (2, 32)))
