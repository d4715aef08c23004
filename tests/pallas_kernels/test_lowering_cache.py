"""pallas_kernels/lowering_cache.py: a Mosaic GPU matmul called through `LoweredOnce` is exported
once per input shapes for every program that calls it, and the programs carry the very kernels a
direct call lowers to (compared by their hashes; lowered for CUDA on this CPU)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from model.config import EngineConfig
from model.kernels import _lowering_reuse
from pallas_kernels import lowering_cache, matmul_mgpu
from pallas_kernels.quant import QuantizedTensor

from tests.pallas_kernels.test_matmul_mgpu import _spec

pytestmark = pytest.mark.skipif(not lowering_cache.available(), reason="this jax cannot export without forward compat")

I32 = jax.ShapeDtypeStruct((), jnp.int32)


def kernel_hashes(text: str) -> list[str]:
    return sorted(set(re.findall(r'kernel_hash = "([^"]*)"', text)))


def lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def two_layers(matmul):
    """A program calling `matmul` on two layers of a square stack, the second on the first's output."""
    def program(x, w, i):
        return matmul(matmul(x, w, layer=i).astype(jnp.bfloat16), w, layer=i + 1)
    return program


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k_split"])
def test_programs_share_one_export_and_carry_the_direct_kernels(fmt):
    pytest.importorskip("absl")  # jax's Mosaic GPU imports it
    w = _spec(fmt, 512, 512, 3)
    x8, x64 = (jax.ShapeDtypeStruct((m, 512), jnp.bfloat16) for m in (8, 64))
    once = lowering_cache.LoweredOnce(matmul_mgpu.qmatmul_mgpu, "cuda")
    direct = {m: lowered(two_layers(matmul_mgpu.qmatmul_mgpu), x, w, I32) for m, x in ((8, x8), (64, x64))}
    assert all(kernel_hashes(t) for t in direct.values())
    # two programs of 8 rows (the decode programs of two context buckets, say) and one of 64
    first = lowered(two_layers(once), x8, w, I32)
    assert len(once.exports) == 1
    second = lowered(lambda x, w, i: two_layers(once)(x, w, i) * 2.0, x8, w, I32)
    assert len(once.exports) == 1  # lowered once for both programs, and for both layers of each
    assert kernel_hashes(first) == kernel_hashes(second) == kernel_hashes(direct[8])
    other = lowered(two_layers(once), x64, w, I32)
    assert len(once.exports) == 2 and kernel_hashes(other) == kernel_hashes(direct[64])


def test_unstacked_weights_and_concurrent_programs():
    pytest.importorskip("absl")
    w = _spec("q4_0", 512, 1024, None)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    once = lowering_cache.LoweredOnce(matmul_mgpu.qmatmul_mgpu, "cuda")
    direct = lowered(lambda x, w: matmul_mgpu.qmatmul_mgpu(x, w), x, w)
    # the engine's compile threads lower programs concurrently: still one export per shape
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda k: lowered(lambda x, w: once(x, w) + k, x, w), range(3)))
    assert len(once.exports) == 1
    assert all(kernel_hashes(t) == kernel_hashes(direct) for t in texts)
    # a differently shaped weight (another matrix of the model) is its own export
    w2 = QuantizedTensor(w.planes, w.fmt, w.shape)
    lowered(lambda x, w: once(x, w), x, w2)
    assert len(once.exports) == 1
    lowered(lambda x, w: once(x, w), jax.ShapeDtypeStruct((8, 512), jnp.bfloat16), _spec("q4_0", 512, 512, None))
    assert len(once.exports) == 2


def test_engine_config_wraps_only_mosaic_matmuls_on_one_device():
    def fn(x, w, layer=None):
        return x

    assert _lowering_reuse(EngineConfig(reuse_kernel_lowering=False))(fn, "mosaic_gpu") is fn
    on = EngineConfig()  # on by default
    wrap = _lowering_reuse(on)
    wrapped = wrap(fn, "mosaic_gpu")
    assert isinstance(wrapped, lowering_cache.LoweredOnce) and wrapped.fn is fn
    assert wrap(fn, "mosaic_gpu") is wrapped  # decode and prefill share one
    assert wrap(fn, "triton") is fn and wrap(fn, "reference") is fn
    assert _lowering_reuse(dataclasses.replace(on, tensor_parallel=2))(fn, "mosaic_gpu") is fn


def test_options_are_part_of_the_key_and_attributes_are_the_implementation_s():
    pytest.importorskip("absl")
    w = _spec("q4_0", 512, 1024, None)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    once = lowering_cache.LoweredOnce(matmul_mgpu.qmatmul_mgpu, "cuda")
    assert once.takes_gather_x  # the implementation's protocol attribute, through the wrapper
    plain = lowered(lambda x, w: once(x, w), x, w)
    gathered = lowered(lambda x, w: once(x, w, gather_x=True), x, w)
    assert len(once.exports) == 2
    assert "gather" in gathered and "gather" not in plain
    assert kernel_hashes(gathered) == kernel_hashes(plain)  # the same kernel: only x's permutation differs
    lowered(lambda x, w: once(x, w, gather_x=True) * 2.0, x, w)
    assert len(once.exports) == 2
