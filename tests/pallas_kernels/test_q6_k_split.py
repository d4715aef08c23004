"""pallas_kernels/q6_k_split.py: a Q6_K matrix as int8 codes and an f16 scale per 16 weights,
held against the Q6_K reference dequantization (itself tested against gguf's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import q6_k_split, quant
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QuantizedTensor, dequantize_reference


def random_q6_k(seed: int, n: int, k: int, d_values=None, stack: int | None = None) -> QuantizedTensor:
    """Random Q6_K planes: codes, signed 8-bit scales, f16 d (or d drawn from `d_values`)."""
    rng = np.random.default_rng(seed)
    lead = (stack,) if stack else ()
    supers = k // 256
    d = rng.uniform(1e-4, 5e-3, (*lead, n, supers)) if d_values is None else rng.choice(d_values, (*lead, n, supers))
    planes = {
        "ql": rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8),
        "qh": rng.integers(0, 256, (*lead, n, k // 4), dtype=np.uint8),
        "sc": rng.integers(-128, 128, (*lead, n, k // 16), dtype=np.int8),
        "d": d.astype(np.float16),
    }
    return QuantizedTensor(planes, "q6_k", (n, k))


def test_split_is_exact_where_the_scales_fit_f16():
    # d a power of two: d * sc (|sc| <= 128) is exact in f16, so the split dequantizes to w exactly
    w = random_q6_k(0, 64, 512, d_values=[2.0**-8, 2.0**-12, 2.0**-14])
    split = q6_k_split.split_q6_k(w)
    assert split.fmt == "q6_k_split" and split.shape == (64, 512)
    assert {k: (v.shape, v.dtype) for k, v in split.planes.items()} == {"qs": ((64, 512), np.int8),
                                                                          "d": ((32, 64), np.float16)}
    assert all(isinstance(v, np.ndarray) for v in split.planes.values())  # the loader's host planes stay numpy
    assert split.planes["qs"].min() >= -32 and split.planes["qs"].max() <= 31
    np.testing.assert_array_equal(np.asarray(dequantize_reference(split)), np.asarray(dequantize_reference(w)))


def test_split_moves_each_weight_by_at_most_the_f16_rounding_of_its_scale():
    w = random_q6_k(1, 96, 768)
    split = q6_k_split.split_q6_k(w)
    ref = np.asarray(dequantize_reference(w), np.float64)
    diff = np.abs(np.asarray(dequantize_reference(split), np.float64) - ref)
    # |(s_j - d sc_j) (q - 32)| <= 2^-11 |d sc_j| * 32
    d_sc = np.repeat(np.asarray(w.planes["d"], np.float64), 16, axis=1) * np.asarray(w.planes["sc"], np.float64)
    bound = 2.0**-11 * 32 * np.repeat(np.abs(d_sc), 16, axis=1) * (1 + 1e-6)
    assert (diff <= bound).all()
    assert diff.max() > 0  # random d: some scales do not fit f16


def test_device_split_equals_the_host_split_and_keeps_the_stack():
    w = random_q6_k(2, 64, 512, stack=3)
    host = q6_k_split.split_q6_k(w)
    device = jax.jit(q6_k_split.split_q6_k)(jax.device_put(w))
    assert host.stack_shape == (3,) and host.planes["d"].shape == (3, 32, 64)
    for p in host.planes:
        np.testing.assert_array_equal(np.asarray(device.planes[p]), host.planes[p])
    for i in range(3):
        one = q6_k_split.split_q6_k(quant.layer_of(w, i))
        np.testing.assert_array_equal(host.planes["qs"][i], one.planes["qs"])


@pytest.mark.parametrize("m", [1, 8])
def test_reference_matmul_of_the_split(m):
    w = random_q6_k(3, 128, 512)
    split = q6_k_split.split_q6_k(w)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((m, 512)), jnp.float32)
    got = np.asarray(qmatmul_reference(x, split), np.float64)
    want = np.asarray(qmatmul_reference(x, w), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3  # f16 scales: about 2^-11 relative


def test_only_matrices_of_64_rows_apiece_are_split_and_other_formats_refused():
    assert q6_k_split.takes(4096) and q6_k_split.takes(64) and not q6_k_split.takes(96)
    with pytest.raises(ValueError, match="takes q6_k"):
        q6_k_split.split_q6_k(QuantizedTensor({"qs": np.zeros((2, 16), np.uint8), "d": np.zeros((2, 1), np.float16)},
                                              "q4_0", (2, 32)))


# "q6_k_split6": the same scales, the codes' 6 bits in two planes laid out for the Mosaic kernel.


def test_split6_keeps_the_codes_and_scales_of_the_split():
    w = random_q6_k(5, 64, 512)
    eight, six = q6_k_split.split_q6_k(w), q6_k_split.split_q6_k6(w)
    assert six.fmt == "q6_k_split6" and six.shape == (64, 512)
    assert {k: (v.shape, v.dtype) for k, v in six.planes.items()} == {
        "qs": ((64, 256), np.uint8), "qh": ((64, 128), np.uint8), "d": ((32, 64), np.float16)}
    assert all(isinstance(v, np.ndarray) for v in six.planes.values())
    np.testing.assert_array_equal(q6_k_split.codes6(six.planes, 512), eight.planes["qs"])
    np.testing.assert_array_equal(six.planes["d"], eight.planes["d"])
    np.testing.assert_array_equal(np.asarray(dequantize_reference(six)), np.asarray(dequantize_reference(eight)))
    assert quant.format_for("q6_k_split6").bits_per_weight == 7.0  # 0.875 bytes per weight


def test_split6_places_each_code_where_its_thread_reads_it():
    # what the Mosaic kernel assumes (pallas_kernels/q6_k_split.py): thread c's little-endian word
    # of bytes 4c..4c+3 holds column 8 j + 2 c + h's low nibble at bit 4 j + 16 h, and its high two
    # bits, for 32-block b of a 64-block, at bit 2 (4 b + j) + 16 h of the `qh` word
    w = random_q6_k(6, 64, 256)
    six = q6_k_split.split_q6_k6(w)
    codes = q6_k_split.split_q6_k(w).planes["qs"].astype(np.int64) + 32
    lo_words = six.planes["qs"].view("<u4").reshape(64, 256 // 32, 4)  # [row, block, thread]
    hi_words = six.planes["qh"].view("<u4").reshape(64, 256 // 64, 4)
    for row in (0, 37):
        for blk in range(256 // 32):
            for c in range(4):
                for j in range(4):
                    for h in range(2):
                        col = 32 * blk + 8 * j + 2 * c + h
                        low = (int(lo_words[row, blk, c]) >> (4 * j + 16 * h)) & 0xF
                        high = (int(hi_words[row, blk // 2, c]) >> (2 * (4 * (blk % 2) + j) + 16 * h)) & 0x3
                        assert low | high << 4 == codes[row, col]


def test_device_split6_equals_the_host_split6_and_keeps_the_stack():
    w = random_q6_k(7, 64, 512, stack=2)
    host = q6_k_split.split_q6_k6(w)
    device = jax.jit(q6_k_split.split_q6_k6)(jax.device_put(w))
    assert host.planes["qh"].shape == (2, 64, 128)
    for p in host.planes:
        np.testing.assert_array_equal(np.asarray(device.planes[p]), host.planes[p])
    one = q6_k_split.split_q6_k6(quant.layer_of(w, 1))
    np.testing.assert_array_equal(host.planes["qs"][1], one.planes["qs"])
    np.testing.assert_array_equal(np.asarray(q6_k_split.codes6(device.planes, 512)),
                                  q6_k_split.codes6(host.planes, 512))


@pytest.mark.parametrize("m", [1, 8])
def test_reference_matmul_of_the_split6(m):
    w = random_q6_k(8, 128, 512)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((m, 512)), jnp.float32)
    got = np.asarray(qmatmul_reference(x, q6_k_split.split_q6_k6(w)))
    np.testing.assert_array_equal(got, np.asarray(qmatmul_reference(x, q6_k_split.split_q6_k(w))))
