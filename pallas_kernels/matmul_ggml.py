"""Quantized matmul with ggml's activation numerics: implementation "ggml_q8" of op "matmul".

llama.cpp's CPU and CUDA backends do not multiply f32 activations with quantized weights: they
first quantize each activation row to 8 bits per block (ggml's `vec_dot_type`: q8_0 for
Q4_0/Q5_0/Q8_0, q8_1 for Q4_1/Q5_1, q8_K for the K-quants, f16 for F16 weights) and take integer
dot products. The rounding this adds (about 0.5% per dot product) moves logits by tenths, enough
to flip near-tied greedy choices. This implementation reproduces it exactly in value: it rounds
x the way ggml does and then runs the f32 reference matmul on the rounded x, so its greedy
tokens can be held against llama.cpp's. The plain "reference" stays the f32 specification that
GPU kernels are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QuantizedTensor

# weight format -> ggml vec_dot_type of the activations
_VEC_DOT = {
    "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0",
    "q4_1": "q8_1", "q5_1": "q8_1",
    "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k",
    "f16": "f16", "bf16": "bf16", "f32": "f32",
}


def _q8_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ggml quantize_row_q8_0/q8_1: per block d = amax/127 (f32), q = round(x / d).
    Returns q [M, nb, block] f32, d f32 [M, nb, 1] and d rounded to f16 [M, nb, 1]."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    d = amax / 127.0
    inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    q = jnp.round(xb * inv)
    return q, d, d.astype(jnp.float16).astype(jnp.float32)


def _q8_k(x: jax.Array) -> jax.Array:
    """ggml quantize_row_q8_K: per 256 block, scale by the signed element of largest magnitude:
    iscale = -127 / max, q = min(127, round(iscale x)), d = 1 / iscale (kept in f32)."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 256, 256)
    idx = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)
    mx = jnp.take_along_axis(xb, idx, axis=-1)
    safe = jnp.where(mx == 0, 1.0, mx)
    iscale = -127.0 / safe
    q = jnp.minimum(127.0, jnp.round(iscale * xb))
    out = q * (1.0 / iscale)
    return jnp.where(mx == 0, 0.0, out).reshape(x.shape)


def quantize_activations(x: jax.Array, vec_dot: str) -> jax.Array:  # x [M, K] f32 -> [M, K] f32
    if vec_dot in ("q8_0", "q8_1"):
        q, _, d16 = _q8_blocks(x, 32)
        return (q * d16).reshape(x.shape)
    if vec_dot == "q8_k":
        return _q8_k(x)
    if vec_dot == "f16":
        return x.astype(jnp.float16).astype(jnp.float32)
    if vec_dot == "bf16":
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    return x


def qmatmul_ggml_q8(
    x: jax.Array,  # [M, K]
    w: QuantizedTensor,  # [N, K]
) -> jax.Array:  # [M, N] f32
    x = x.astype(jnp.float32)
    vec_dot = _VEC_DOT[w.fmt]
    y = qmatmul_reference(quantize_activations(x, vec_dot), w)
    if vec_dot == "q8_1":
        # ggml adds m_w * s per block with s = f16(d * sum(q)) (d unrounded); the matmul above
        # used m_w * f16(d) * sum(q). Add the difference: [M, nb] @ [nb, N].
        q, d, d16 = _q8_blocks(x, 32)
        sum_q = jnp.sum(q, axis=-1)
        s16 = (d[..., 0] * sum_q).astype(jnp.float16).astype(jnp.float32)
        corr = s16 - d16[..., 0] * sum_q  # [M, nb]
        m = w.planes["m"].astype(jnp.float32)  # [N, nb]
        y = y + jnp.einsum("mb,nb->mn", corr, m, precision="highest")
    return y


registry.register("matmul", "ggml_q8", qmatmul_ggml_q8, priority=-1)
