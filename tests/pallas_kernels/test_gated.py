"""The gated activation taken by the gate/up matmul (pallas_kernels/gated.py): the interleaved
layout and the product's definition on the CPU; the Mosaic GPU matmul's epilogue lowered for
CUDA on the CPU and, on the GPU (marked `gpu`), against that definition."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated, matmul_mgpu, q4_k_split, q5_k_split
from pallas_kernels.matmul import qmatmul_reference
from tests.pallas_kernels.test_matmul_conformance import random_weight, relative_error
from tests.pallas_kernels.test_matmul_mgpu import _spec


@pytest.mark.parametrize("act,ref", [("silu", jax.nn.silu),
                                     ("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True))])
def test_activation_is_the_forward_pass(act, ref):
    x = jnp.asarray(np.linspace(-30, 30, 4001), jnp.float32)
    np.testing.assert_allclose(np.asarray(gated.activation(act, x)), np.asarray(ref(x)), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="unknown activation"):
        gated.activation("relu", x)


@pytest.mark.parametrize("act", gated.ACTIVATIONS)
@pytest.mark.parametrize("ordered", [False, True])
def test_interleaved_rows_give_the_gated_product_in_order(act, ordered):
    """x times the [gate; up] rows taken in `interleave_index`'s order, through
    `from_interleaved`, is act(x gate^T) * (x up^T) with its features in the given order."""
    rng = np.random.default_rng(0)
    f, k = 96, 40
    gate, up, x = rng.standard_normal((f, k)), rng.standard_normal((f, k)), rng.standard_normal((5, k))
    order = rng.permutation(f) if ordered else None
    index = gated.interleave_index(f, order)
    assert sorted(index.tolist()) == list(range(2 * f))
    y = jnp.asarray(x @ np.concatenate([gate, up])[index].T, jnp.float32)
    got = np.asarray(gated.from_interleaved(y, act))
    want = np.asarray(gated.activation(act, jnp.asarray(x @ gate.T, jnp.float32))) * (x @ up.T)
    np.testing.assert_allclose(got, want[:, np.arange(f) if order is None else order], rtol=1e-5, atol=1e-5)


def test_interleave_index_refuses_what_is_no_layout():
    with pytest.raises(ValueError, match="multiple of 32"):
        gated.interleave_index(48)
    with pytest.raises(ValueError, match="permutation"):
        gated.interleave_index(64, np.zeros(64, int))


def test_takes_gated_where_the_k_is_not_split():
    """The Mosaic kernel makes the product itself at no cost where its default tuning would not
    split K anyway: a 7B's gate/up (22016 x 4096, 344 warpgroups) in decode and prefill, not a
    1024-row one (16 warpgroups, K split 17 ways)."""
    up = _spec("q4_0", 22016, 4096)
    assert matmul_mgpu.takes_gated(up, 8, "silu") and matmul_mgpu.takes_gated(up, 512, "gelu_tanh")
    assert not matmul_mgpu.takes_gated(_spec("q4_0", 1024, 4096), 8, "silu")
    assert not matmul_mgpu.takes_gated(up, 8, "relu")
    assert not matmul_mgpu.takes_gated(_spec("q4_0", 22016, 4064), 8, "silu")  # K no multiple of the step
    # Q4_K: the decode and prefill kernels both fold the offsets into their weights
    assert matmul_mgpu.takes_gated(_spec("q4_k_split", 22016, 4096), 8, "silu")
    assert matmul_mgpu.takes_gated(_spec("q4_k_split", 22016, 4096), 512, "silu")


@pytest.mark.parametrize("fmt,m,stack", [("q4_0", 8, 2), ("q4_0", 512, 2), ("q8_0", 8, None), ("q4_k_split", 200, None),
                                         ("q4_k_split", 8, None), ("q6_k_split", 8, None), ("q5_k_split", 8, None),
                                         ("q5_1_split", 64, 2)])
@pytest.mark.parametrize("act", gated.ACTIVATIONS)
def test_gated_epilogue_lowers_for_cuda(fmt, m, stack, act):
    """The kernel with the gated epilogue (one K split, the product out in bf16) lowers, and its
    output is [M, N / 2] bf16 with no XLA op for the product after it."""
    pytest.importorskip("absl")
    w = _spec(fmt, 1024, 2048, stack)
    fn = lambda x, w, i: matmul_mgpu.qmatmul_mgpu(x, w, layer=i if stack else None, gated=act)  # noqa: E731
    traced = jax.jit(fn).trace(jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16), w, jax.ShapeDtypeStruct((), jnp.int32))
    assert traced.out_info.shape == (m, 512) and traced.out_info.dtype == jnp.bfloat16
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "stablehlo.exponential" not in text and "stablehlo.tanh" not in text  # the activation is the kernel's


@pytest.mark.parametrize("fmt,tuning", [("q4_0", matmul_mgpu.MosaicMatmulTuning(int8_x=True)),
                                        ("q4_k_split", matmul_mgpu.MosaicMatmulTuning(fuse_offsets=False))])
def test_gated_without_the_epilogue_is_the_product_after_the_call(fmt, tuning):
    """Where the kernel does not make the product (int8 x: its own rounding; Q4_K's offsets
    added after the kernel), the call is the plain one followed by `from_interleaved`, in bf16;
    an unknown activation is refused."""
    pytest.importorskip("absl")
    w = _spec(fmt, 1024, 2048)
    fn = lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w, tuning, gated="silu")  # noqa: E731
    traced = jax.jit(fn).trace(jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), w)
    assert traced.out_info.shape == (8, 512) and traced.out_info.dtype == jnp.bfloat16
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.exponential" in text
    with pytest.raises(NotImplementedError, match="gated activation"):
        matmul_mgpu.qmatmul_mgpu(jnp.zeros((8, 2048), jnp.bfloat16), w, gated="relu")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,m,act", [("q4_0", 8, "silu"), ("q4_0", 1, "silu"), ("q4_0", 200, "silu"),
                                       ("q8_0", 8, "silu"), ("q4_k", 8, "silu"), ("q4_k", 200, "silu"),
                                       ("q4_0", 8, "gelu_tanh"), ("q4_k", 200, "gelu_tanh"), ("q5_k", 8, "silu"),
                                       ("q5_k", 64, "silu")])
def test_gated_epilogue_gives_the_product(fmt, m, act):
    """The epilogue's act(gate) * up in bf16 against the plain call of the same kernel with K
    unsplit too (`target_ctas=1`) followed by `from_interleaved` (the path without it): the same
    sums, so they differ by the activation's f32 rounding and the bf16 rounding of a product
    that straddles it; and against the format's reference."""
    n, k = 1024, 1024
    rng = np.random.default_rng(seed := int(np.random.SeedSequence().entropy % (1 << 63)))
    w0 = random_weight(fmt, n, k, rng)
    w = {"q4_k": q4_k_split.split_q4_k, "q5_k": q5_k_split.split_q5_k}.get(fmt, lambda w: w)(w0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = np.asarray(matmul_mgpu.qmatmul_mgpu(x, w, gated=act).astype(jnp.float32))
    whole = dataclasses.replace(matmul_mgpu.default_tuning(m, offsets=w.fmt in q4_k_split.OFFSET_FORMS), target_ctas=1)
    y = matmul_mgpu.qmatmul_mgpu(x, w, whole)
    want = np.asarray(gated.from_interleaved(y, act).astype(jnp.bfloat16).astype(jnp.float32))
    assert got.shape == (m, n // 2)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6 * np.abs(want).max(), err_msg=f"seed {seed}")
    # bit for bit where the activation is well conditioned: with gelu_tanh, not where a gate is
    # below -2 (1 + tanh cancels there, and one f32 ulp of tanh, XLA's against the kernel's,
    # changed a third of such products on the CPU; above -2, none: bench/results, thirty-first
    # session)
    gate = np.asarray(jnp.reshape(y, (m, -1, 2, gated.GROUP))[:, :, 0].reshape(m, -1))
    same = (got == want)[gate > -2] if act == "gelu_tanh" else got == want
    assert np.mean(same) > 0.98, f"seed {seed}: {np.mean(same)} of the products the same"
    ref = gated.from_interleaved(qmatmul_reference(x.astype(jnp.float32), w0), act)
    assert relative_error(got, np.asarray(ref)) < 1e-2, f"seed {seed}"
