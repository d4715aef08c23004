"""Reference quantized matmul and embedding against float64 numpy on the dequantized weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from pallas_kernels import matmul, quant, registry

F16_OFFSETS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}


def random_weight(name: str, n: int, k: int, seed: int = 0) -> quant.QuantizedTensor:
    rng = np.random.default_rng(seed)
    fmt = quant.FORMATS[name]
    if fmt.is_float:
        data = rng.standard_normal((n, k)).astype(fmt.plane_dtypes()["w"])
    else:
        block_size, type_size = GGML_QUANT_SIZES[fmt.ggml_type]
        blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
        for off in F16_OFFSETS[name]:
            scale = rng.uniform(1e-3, 0.1, (n, k // block_size, 1)).astype(np.float16)
            blocks[..., off : off + 2] = scale.view(np.uint8)
        data = blocks.reshape(n, -1)
    return jax.device_put(quant.repack(data, fmt.ggml_type, (n, k)))


def expected_matmul(x, w: quant.QuantizedTensor) -> np.ndarray:
    w64 = np.asarray(quant.dequantize_reference(w), np.float64)
    return np.asarray(x, np.float64) @ w64.T


def assert_rel_close(actual, expected, tol=1e-6):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all() and np.isfinite(expected).all(), "NaN/inf never passes"
    err = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    assert err < tol, err


qmatmul_jit = jax.jit(matmul.qmatmul_reference, static_argnames="config")


@pytest.mark.parametrize("name", list(quant.FORMATS))
def test_qmatmul_matches_float64(name):
    k = 512
    w = random_weight(name, 24, k)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, k)), jnp.float32)
    y = qmatmul_jit(x, w)
    assert y.shape == (5, 24) and y.dtype == jnp.float32
    assert_rel_close(y, expected_matmul(x, w))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_qmatmul_low_precision_x(dtype):
    w = random_weight("q4_1", 16, 64)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), dtype)
    y = qmatmul_jit(x, w)
    assert y.dtype == jnp.float32
    assert_rel_close(y, expected_matmul(np.asarray(x.astype(jnp.float32)), w))


@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q4_k"])  # one dot; one per phase (see matmul.py)
def test_qmatmul_tiled_with_remainder_matches_untiled(name):
    k = 256
    w = random_weight(name, 100, k)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, k)), jnp.float32)  # leading dims
    tiled = qmatmul_jit(x, w, config=matmul.ReferenceMatmulConfig(tile_bytes=7 * k * 4))  # 14 tiles + 2 rows
    whole = qmatmul_jit(x, w, config=matmul.ReferenceMatmulConfig(tile_bytes=1 << 30))
    assert tiled.shape == (2, 3, 100)
    assert_rel_close(tiled, whole)
    assert_rel_close(tiled, expected_matmul(x, w))


def test_config_validation():
    with pytest.raises(ValueError):
        matmul.ReferenceMatmulConfig(tile_bytes=0)


def test_qmatmul_nan_propagates():
    w = random_weight("q8_0", 4, 32)
    x = jnp.ones((1, 32), jnp.float32).at[0, 5].set(jnp.nan)
    assert np.isnan(np.asarray(qmatmul_jit(x, w))).all()


def test_qmatmul_bad_input():
    w = random_weight("q4_0", 4, 64)
    with pytest.raises(ValueError, match="does not match"):
        matmul.qmatmul_reference(jnp.ones((2, 32)), w)
    stacked = jax.tree.map(lambda p: jnp.stack([p, p]), w)
    with pytest.raises(ValueError, match="stack"):
        matmul.qmatmul_reference(jnp.ones((2, 64)), stacked)


def test_qmatmul_in_scan_over_stacked_layers():
    layers = [random_weight("q6_k", 8, 256, seed=s) for s in range(3)]
    stacked = jax.tree.map(lambda *ps: jnp.stack(ps), *layers)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 256)), jnp.float32)

    @jax.jit
    def run(x, stacked):
        return jax.lax.scan(lambda c, w: (c, matmul.qmatmul_reference(x, w)), None, stacked)[1]

    ys = run(x, stacked)
    for i, w in enumerate(layers):
        assert_rel_close(ys[i], expected_matmul(x, w))


def test_embed_reference():
    w = random_weight("q5_k", 10, 256)
    ids = jnp.array([9, 0, 4], jnp.int32)
    rows = jax.jit(matmul.embed_reference)(w, ids)
    np.testing.assert_array_equal(rows, np.asarray(quant.dequantize_reference(w))[np.asarray(ids)])


def test_reference_is_registered_and_chosen_on_cpu():
    names = {impl.name for impl in registry.implementations("matmul")}
    assert "reference" in names and "reference" in {i.name for i in registry.implementations("embed")}
    w = random_weight("q4_1", 16, 64)
    w_spec = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), w)
    x_spec = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    fn = registry.choose("matmul", forced="reference", probes=[(x_spec, w_spec)])
    assert fn is matmul.qmatmul_reference
    assert registry.describe()["matmul"] == "reference"
