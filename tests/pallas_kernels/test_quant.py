"""Format table, repack and reference dequantization against gguf-py's own (llama.cpp's) math."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from pallas_kernels import quant

Q = gguf.GGMLQuantizationType
ALL = list(quant.FORMATS)
BLOCK_FORMATS = [name for name, f in quant.FORMATS.items() if not f.is_float]
# Byte offsets of the f16 fields (d, m / dmin) in each block, from ggml's block structs. Random
# bytes there would give NaN/inf scales; these get small positive values instead.
F16_OFFSETS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}
# Formats gguf-py can quantize (the others it can only dequantize).
QUANTIZABLE = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
dequantize_jit = jax.jit(quant.dequantize_reference)


def assert_close(actual, expected, rtol=1e-6):
    """Equal to f32 rounding; NaN or inf on either side fails (never passes as 'equal')."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all(), "non-finite values in the result"
    assert np.isfinite(expected).all(), "non-finite values in the expectation"
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, equal_nan=False)


def random_data(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF tensor data as the gguf reader gives it: blocks uint8 [N, bytes], floats [N, K]."""
    fmt = quant.FORMATS[name]
    if fmt.is_float:
        return rng.standard_normal((n, k)).astype(fmt.plane_dtypes()["w"])
    block_size, type_size = GGML_QUANT_SIZES[fmt.ggml_type]
    blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    for off in F16_OFFSETS[name]:
        scale = rng.uniform(1e-3, 1.0, (n, k // block_size, 1)).astype(np.float16)
        blocks[..., off : off + 2] = scale.view(np.uint8)
    return blocks.reshape(n, -1)


def gguf_dequant(data: np.ndarray, fmt: quant.QuantFormat) -> np.ndarray:
    if fmt.is_float:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, fmt.ggml_type)


def shapes(name: str) -> list[tuple[int, int]]:
    if quant.FORMATS[name].block_size == 256:
        return [(1, 256), (3, 768), (4, 512)]
    return [(1, 32), (3, 256), (5, 768)]


def test_sizes_match_gguf():
    for name, fmt in quant.FORMATS.items():
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[fmt.ggml_type], name
        assert fmt.name == fmt.ggml_type.name.lower()
        assert quant.format_for(fmt.ggml_type) is fmt
        assert quant.format_for(int(fmt.ggml_type)) is fmt
        assert quant.format_for(name) is fmt


@pytest.mark.parametrize("name", ALL)
def test_dequant_random_blocks_match_gguf(name):
    fmt = quant.FORMATS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    for n, k in shapes(name):
        data = random_data(name, n, k, rng)
        qt = quant.repack(data, fmt.ggml_type, (n, k))
        assert qt.shape == (n, k) and qt.fmt == name and qt.stack_shape == ()
        for plane, shape in fmt.plane_shapes(n, k).items():
            assert qt.planes[plane].shape == shape, plane
            assert qt.planes[plane].dtype == fmt.plane_dtypes()[plane], plane
            assert isinstance(qt.planes[plane], np.ndarray)
        assert_close(dequantize_jit(qt), gguf_dequant(data, fmt))


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequant_quantized_data_matches_gguf(name):
    fmt = quant.FORMATS[name]
    rng = np.random.default_rng(1)
    n, k = 6, 512
    weights = (rng.standard_normal((n, k)) * 0.02 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    data = gguf.quants.quantize(weights, fmt.ggml_type)
    qt = quant.repack(data, fmt.ggml_type, (n, k))
    expected = gguf.quants.dequantize(data, fmt.ggml_type)
    assert_close(quant.dequantize_reference(qt), expected)
    # and the quantization itself is close to the original (the data are not degenerate)
    np.testing.assert_allclose(expected, weights, atol=0.25 * np.abs(weights).max())


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_formats_accept_raw_bytes(name):
    # The gguf reader gives BF16 (and any type it has no numpy dtype for) as uint8 rows.
    fmt = quant.FORMATS[name]
    data = random_data(name, 3, 40, np.random.default_rng(2))
    qt = quant.repack(data.view(np.uint8), fmt.ggml_type, (3, 40))
    assert qt.planes["w"].dtype == fmt.plane_dtypes()["w"]
    np.testing.assert_array_equal(qt.planes["w"], data)


def test_dequant_jit_on_device_arrays():
    rng = np.random.default_rng(3)
    for name in ("q4_k", "q5_0", "bf16"):
        fmt = quant.FORMATS[name]
        n, k = shapes(name)[1]
        data = random_data(name, n, k, rng)
        qt = jax.device_put(quant.repack(data, fmt.ggml_type, (n, k)))
        assert all(isinstance(p, jax.Array) for p in qt.planes.values())
        out = jax.jit(quant.dequantize_reference)(qt)
        assert out.dtype == jnp.float32
        assert_close(out, gguf_dequant(data, fmt))


def test_repack_is_fast():
    import time

    rng = np.random.default_rng(4)
    big = rng.integers(0, 256, (49152, 576 // 32 * 34), dtype=np.uint8)
    t0 = time.perf_counter()
    qt = quant.repack(big, Q.Q8_0, (49152, 576))
    assert time.perf_counter() - t0 < 1.0
    assert qt.planes["qs"].shape == (49152, 576)


def test_unsupported_type_and_bad_shapes():
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        quant.repack(np.zeros((2, 66), np.uint8), Q.IQ2_XXS, (2, 256))
    with pytest.raises(NotImplementedError):
        quant.format_for("q8_1")
    with pytest.raises(ValueError, match="block size"):
        quant.repack(np.zeros((2, 27), np.uint8), Q.Q4_0, (2, 48))
    with pytest.raises(ValueError, match="bytes"):
        quant.repack(np.zeros((2, 19), np.uint8), Q.Q4_0, (2, 32))
    with pytest.raises(ValueError, match="bytes"):  # float data of the wrong dtype
        quant.repack(np.zeros((2, 32), np.float32), Q.F16, (2, 32))
    with pytest.raises(ValueError, match="planes"):
        quant.QuantizedTensor({"qs": np.zeros((2, 16), np.uint8)}, "q4_0", (2, 32))


def test_num_bytes():
    rng = np.random.default_rng(5)
    data = random_data("q4_0", 4, 64, rng)
    qt = quant.repack(data, Q.Q4_0, (4, 64))
    assert quant.num_bytes(qt) == data.nbytes  # Q4_0 planes hold exactly the GGUF bytes
    assert quant.num_bytes(jax.device_put(qt)) == data.nbytes
    data = random_data("q3_k", 2, 256, rng)
    qt = quant.repack(data, Q.Q3_K, (2, 256))
    assert quant.num_bytes(qt) == sum(p.nbytes for p in qt.planes.values())


@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q5_1", "q2_k", "q3_k", "q5_k", "q6_k", "f16"])
def test_take_rows_matches_full_dequant(name):
    fmt = quant.FORMATS[name]
    n, k = 7, 256
    data = random_data(name, n, k, np.random.default_rng(6))
    qt = jax.device_put(quant.repack(data, fmt.ggml_type, (n, k)))
    ids = jnp.array([3, 0, 6, 3], jnp.int32)
    full = np.asarray(quant.dequantize_reference(qt))
    rows = jax.jit(quant.take_rows_reference)(qt, ids)
    assert rows.shape == (4, k)
    np.testing.assert_array_equal(rows, full[np.asarray(ids)])


def test_take_rows_out_of_range_is_nan():
    qt = jax.device_put(quant.repack(random_data("q8_0", 3, 32, np.random.default_rng(7)), Q.Q8_0, (3, 32)))
    rows = np.asarray(quant.take_rows_reference(qt, jnp.array([1, 3], jnp.int32)))
    assert np.isfinite(rows[0]).all() and np.isnan(rows[1]).all()


def test_nan_scale_propagates():
    data = random_data("q4_1", 2, 64, np.random.default_rng(8))
    data.reshape(2, 2, 20)[1, 0, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    out = np.asarray(quant.dequantize_reference(quant.repack(data, Q.Q4_1, (2, 64))))
    assert np.isnan(out[1, :32]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, 32:]).all()
    with pytest.raises(AssertionError):
        assert_close(out, out)  # the comparison helper refuses NaN, even NaN == NaN


@pytest.mark.parametrize("name", ["q4_k", "q5_0", "bf16"])
def test_stacked_planes(name):
    fmt = quant.FORMATS[name]
    rng = np.random.default_rng(9)
    n, k = 3, 512
    datas = [random_data(name, n, k, rng) for _ in range(3)]
    singles = [quant.repack(d, fmt.ggml_type, (n, k)) for d in datas]
    stacked = jax.tree.map(lambda *ps: np.stack(ps), *singles)
    assert stacked.shape == (n, k) and stacked.stack_shape == (3,)
    # repack of stacked data gives the same planes
    from_stacked_data = quant.repack(np.stack(datas), fmt.ggml_type, (n, k))
    jax.tree.map(np.testing.assert_array_equal, from_stacked_data, stacked)

    stacked = jax.device_put(stacked)
    full = np.asarray(dequantize_jit(stacked))
    assert full.shape == (3, n, k)
    for i, single in enumerate(singles):
        layer = jax.tree.map(lambda p: p[i], stacked)
        assert jax.tree.structure(layer) == jax.tree.structure(single)
        jax.tree.map(np.testing.assert_array_equal, layer, single)
        np.testing.assert_array_equal(full[i], dequantize_jit(single))

    def body(carry, layer):  # lax.scan hands each layer's QuantizedTensor to the body
        return carry, quant.dequantize_reference(layer)

    _, scanned = jax.lax.scan(body, None, stacked)
    np.testing.assert_array_equal(scanned, full)


def test_pytree_keys_and_aux():
    qt = quant.repack(random_data("q4_1", 2, 32, np.random.default_rng(10)), Q.Q4_1, (2, 32))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(qt)[0]]
    assert paths == ["['qs']", "['d']", "['m']"]
    shapes_only = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), qt)
    out = jax.eval_shape(quant.dequantize_reference, shapes_only)
    assert out.shape == (2, 32) and out.dtype == jnp.float32
    assert ml_dtypes.bfloat16 == quant.FORMATS["bf16"].plane_dtypes()["w"]
