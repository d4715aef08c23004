"""pallas_kernels/legacy_split.py: Q4_1, Q5_0 and Q5_1 in the forms the Mosaic GPU matmul takes,
held against gguf's own dequantization (llama.cpp's Python reference)."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import legacy_split, matmul_mgpu, matmul_triton, quant
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QuantizedTensor, dequantize_reference
from tests.pallas_kernels.test_q4_k_split import PLANE_ROUNDING  # bf16(d) and bf16(f16(m + offset d))

Q = gguf.GGMLQuantizationType
# where each format's f16 d (and m) sit in its block of 32 weights
FIELDS = {"q4_1": (Q.Q4_1, (0, 2)), "q5_0": (Q.Q5_0, (0,)), "q5_1": (Q.Q5_1, (0, 2))}
SPLIT = {"q4_1": legacy_split.split_q4_1, "q5_0": legacy_split.q5_0_as_q8_0, "q5_1": legacy_split.split_q5_1}
CODE_OFFSET = {"q4_1": 8, "q5_1": 16}


def random_blocks(fmt: str, seed: int, n: int, k: int) -> np.ndarray:
    """Random rows of `fmt` as GGUF bytes [N, K/32 * type size]: random codes (and fifth bits),
    f16 d in [1e-3, 5e-2) and m in (-0.5, 0.5)."""
    qtype, offsets = FIELDS[fmt]
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n * k // 32, size), dtype=np.uint8)
    values = [rng.uniform(1e-3, 5e-2, len(blocks)), rng.uniform(-0.5, 0.5, len(blocks))]
    for at, v in zip(offsets, values):
        blocks[:, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def tensor(fmt: str, raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    return quant.repack(raw, FIELDS[fmt][0], (n, k))


def gguf_weights(fmt: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, FIELDS[fmt][0]).reshape(n, k).astype(np.float64)


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1"])
def test_split_is_the_file_s_weights_up_to_the_rounding_of_its_planes(fmt):
    n, k = 96, 512
    raw = random_blocks(fmt, 0, n, k)
    w = tensor(fmt, raw, n, k)
    split = SPLIT[fmt](w)
    want_fmt = {"q4_1": "q4_1_split", "q5_0": "q8_0", "q5_1": "q5_1_split"}[fmt]
    assert split.fmt == want_fmt and split.shape == (n, k)
    f = quant.ALL_FORMATS[want_fmt]
    assert {p: v.shape for p, v in split.planes.items()} == f.plane_shapes(n, k)
    assert {p: v.dtype for p, v in split.planes.items()} == f.plane_dtypes()
    assert all(isinstance(v, np.ndarray) for v in split.planes.values())  # the loader's host planes stay numpy
    got = np.asarray(dequantize_reference(split), np.float64)
    want = gguf_weights(fmt, raw, n, k)
    if fmt == "q5_0":
        np.testing.assert_array_equal(got, want)  # Q8_0's form holds Q5_0 exactly
        assert split.planes["qs"].min() == -16 and split.planes["qs"].max() == 15
        return
    d = np.asarray(w.planes["d"], np.float64)
    m = np.asarray(w.planes["m"], np.float64)
    offset = CODE_OFFSET[fmt]  # the largest |code - offset| of the split
    if fmt == "q4_1":  # bf16(d) and bf16(f16(m + 8 d)), q4_k_split's planes
        bound = np.repeat(PLANE_ROUNDING * (offset * np.abs(d) + np.abs(m + offset * d)), 32, axis=1)
    else:  # d kept, f16(m + 16 d)
        bound = np.repeat(np.maximum(2.0**-11 * np.abs(m + offset * d), 2.0**-25), 32, axis=1)
    diff = np.abs(got - want)
    assert (diff <= bound + 1e-6 * np.abs(want).max()).all()
    assert diff.max() > 0  # random d and m: some do not fit the planes


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1"])
def test_device_split_equals_the_host_split_and_keeps_the_stack(fmt):
    n, k = 64, 256
    layers = [tensor(fmt, random_blocks(fmt, 1 + i, n, k), n, k) for i in range(3)]
    w = QuantizedTensor({p: np.stack([t.planes[p] for t in layers]) for p in layers[0].planes}, fmt, (n, k))
    host = SPLIT[fmt](w)
    device = jax.jit(SPLIT[fmt])(jax.device_put(w))
    assert host.stack_shape == (3,)
    for p in host.planes:
        np.testing.assert_array_equal(np.asarray(device.planes[p]), np.asarray(host.planes[p]))
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(host.planes[p])[i], np.asarray(SPLIT[fmt](layers[i]).planes[p]))


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1"])
def test_triton_matmul_of_the_split_is_the_file_s_product(fmt):
    # the Triton kernels serve the forms too (interpret mode here): Q4_0's or Q8_0's kernel, plus the offsets
    n, k = 128, 512
    raw = random_blocks(fmt, 5, n, k)
    split = jax.device_put(SPLIT[fmt](tensor(fmt, raw, n, k)))
    x = jax.random.normal(jax.random.key(0), (8, k), jnp.float32)
    want = np.asarray(x, np.float64) @ gguf_weights(fmt, raw, n, k).T
    for got in (matmul_triton.qmatmul_triton(x, split, interpret=True), qmatmul_reference(x, split)):
        got = np.asarray(got, np.float64)
        # Q4_1's bf16 scales and offsets (2^-8 of each); Q5_1's f16 offsets (2^-11)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < (5e-3 if fmt == "q4_1" else 1e-3)


@pytest.mark.parametrize("fmt,m,fuse", [("q4_1_split", 8, True), ("q4_1_split", 512, True),
                                        ("q5_1_split", 8, True), ("q5_1_split", 8, False), ("q5_1_split", 512, True)])
def test_mosaic_kernel_lowers_for_cuda(fmt, m, fuse):
    """The split forms run the Mosaic GPU kernel of the K-quant splits of the same form: the
    unfolded decode kernel (DEFAULT_TUNING; the folded one is their decode default) adds the
    offsets itself, the prefill one folds them into its bf16 weights."""
    pytest.importorskip("absl")
    f = quant.ALL_FORMATS[fmt]
    shapes, dtypes = f.plane_shapes(4096, 11008), f.plane_dtypes()
    w = QuantizedTensor({p: jax.ShapeDtypeStruct((3, *shapes[p]), dtypes[p]) for p in f.planes}, fmt, (4096, 11008))
    x = jax.ShapeDtypeStruct((m, 11008), jnp.bfloat16)
    tuning = dataclasses.replace(matmul_mgpu.default_tuning(m), fuse_offsets=fuse)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, tuning, layer=i)  # noqa: E731
    text = jax.jit(fn).trace(x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert ("dot_general" in text) == (not matmul_mgpu.fuses_offsets(tuning))


def test_other_formats_are_refused():
    w = QuantizedTensor({"qs": np.zeros((2, 16), np.uint8), "d": np.zeros((1, 2), np.float16)}, "q4_0", (2, 32))
    for split in SPLIT.values():
        with pytest.raises(ValueError, match="takes q"):
            split(w)
