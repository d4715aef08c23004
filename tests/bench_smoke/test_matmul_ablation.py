"""bench/matmul_ablation.py: its twins of the production q4_0 decode kernel compute the same
product (interpret mode on CPU), so that a gap it measures on the GPU is the cost of what a
variant leaves out or changes, not a different result."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import matmul_triton as mt
from pallas_kernels import quant
from pallas_kernels.matmul import qmatmul_reference

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "matmul_ablation.py"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("matmul_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["mma", "mmabf@tiled:block_k=64", "prefetch@tiled:x_mask=1", "mma:evict=1"])
def test_compute_variants_match_the_reference(ablation, variant):
    n, k, layers, m = 128, 1024, 3, 5
    w = ablation.random_q4_0_stack(jax.random.key(0), layers, n, k)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
    layer = 2
    ref = qmatmul_reference(x, quant.QuantizedTensor({p: v[layer] for p, v in w.planes.items()}, "q4_0", (n, k)))
    mode, tiled, tuning, extra = ablation.parse_variant(variant, mt.default_tuning("q4_0", m, n, k, jnp.bfloat16))
    mt.check_tiling("q4_0", n, k, tuning)
    y = ablation.ablation_matmul(x, w, jnp.array([layer], jnp.int32), mode=mode, tuning=tuning, interpret=True,
                                 tiled=tiled, **extra)
    assert y.shape == (m, n)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-2


def test_parse_variant_rejects_unknown_modes(ablation):
    base = mt.default_tuning("q4_0", 8, 128, 1024, jnp.bfloat16)
    with pytest.raises(ValueError):
        ablation.parse_variant("fast", base)
    with pytest.raises(ValueError):
        ablation.parse_variant("mma@rowmajor", base)


def test_dense_bar_computes_the_product_and_mosaic_keys_parse(ablation):
    """`dense` (the bf16 bar for prefill rows) is the product of the same weights; the Mosaic
    variant's `mtile` and `rowsout` keys reach its tuning's extras."""
    n, k, layers, m = 128, 1024, 2, 5
    w = ablation.random_q4_0_stack(jax.random.key(0), layers, n, k)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = qmatmul_reference(x, quant.QuantizedTensor({p: v[1] for p, v in w.planes.items()}, "q4_0", (n, k)))
    base = mt.default_tuning("q4_0", m, n, k, jnp.bfloat16)
    mode, tiled, tuning, extra = ablation.parse_variant("dense", base)
    y = ablation.run_variant(mode, tiled, extra, x, w, tuning)(1)
    assert y.shape == (m, n)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 1e-2
    mode, _, _, extra = ablation.parse_variant("mgpu_mma:fold=1,mtile=128,rowsout=0,block_k=32", base)
    assert mode == "mgpu_mma" and extra == {"fold": 1, "mtile": 128, "rowsout": 0}
