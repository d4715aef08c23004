"""Q4_K weights split into a Q4_0 tensor and an offset plane, so that Q4_0's kernels (the Mosaic
GPU one reads 4-bit codes at 2-2.5x the rate the Triton Q4_K kernel reaches, bench/results,
thirteenth session) can serve Q4_K files.

A Q4_K super-block of 256 weights holds per 32-weight sub-block b the codes q (0..15), a 6-bit
scale sc_b and a 6-bit min m_b, and per super-block f16 d and dmin: w = d sc_b q - dmin m_b
(llama.cpp). That is Q4_0's form plus one offset per block and row:

    w' = s_b (q - 8) + c_b,   s_b = f16(d sc_b),   c_b = 8 s_b - dmin m_b  (f32)

so x @ w'.T = q4_0_matmul(x, codes, s) + xsum @ C, with xsum [M, K/32] the sums of x over each
32-block and C [K/32, N] the offsets (transposed like Q4_0's scales). w' = s_b q - dmin m_b
differs from w only where d sc_b (up to 17 significant bits) does not fit f16's 11: by at most
2^-11 of d sc_b times q, i.e. 2^-11 of the weight's scaled code; in a dot with bf16 x (the GPU
path) that is below x's own rounding. The codes keep their bits; they move from Q4_K's nibble
order (per 64 weights, 32 bytes: low nibbles weights 0..31, high nibbles 32..63) to Q4_0's (per
32 weights, 16 bytes: low nibbles 0..15, high 16..31).

Bytes per weight: 0.5 (codes) + 2/32 (s) + 4/32 (C) = 0.6875, against Q4_K's 0.5625.

Status: the split and the composed matmul, tested on the CPU against the Q4_K reference
(tests/pallas_kernels/test_q4_k_split.py); `bench/kernels.py` times them on the GPU as impl
"mosaic_gpu:q4_k_split". The engine does not use them yet: that needs the loader to split
Q4_K matrices when the chosen kernel asks for it, and the forward pass to add the offset term.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import QK_K, QuantizedTensor

BLOCK = 32  # weights per Q4_0 block and per Q4_K sub-block
CODE_OFFSET = 8  # Q4_0 weight = d (q - 8)


def split_q4_k(w: QuantizedTensor) -> tuple[QuantizedTensor, jax.Array]:
    """A single Q4_K matrix [N, K] -> (a Q4_0 tensor [N, K] of its codes and rounded block
    scales, its offsets C [K/32, N] f32); see the module docstring."""
    if w.fmt != "q4_k":
        raise ValueError(f"split_q4_k takes q4_k, not {w.fmt}")
    if w.stack_shape:
        raise ValueError(f"split_q4_k takes one matrix, got a stack {w.stack_shape}")
    n, k = w.shape
    supers, blocks = k // QK_K, k // BLOCK
    p = w.planes
    qs = jnp.reshape(jnp.asarray(p["qs"]), (n, supers, 4, 1, 32))  # 4 runs of 32 bytes per super-block
    codes = (qs >> jnp.asarray([0, 4], jnp.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [N, S, 4, 2, 32]
    codes = jnp.reshape(codes, (n, blocks, BLOCK))  # sub-block 8 s + 2 run + nibble, weights in order
    qs40 = jnp.reshape(codes[..., :16] | (codes[..., 16:] << 4), (n, k // 2)).astype(jnp.uint8)

    def per_block(super_vals, sub_vals):  # f32 [N, K/32]: a super-block's f16 value times its 6-bit ints
        return jnp.repeat(jnp.asarray(super_vals, jnp.float32), QK_K // BLOCK, axis=1) * jnp.asarray(
            sub_vals, jnp.float32)

    scales = per_block(p["d"], p["sc"]).astype(jnp.float16)  # s_b
    mins = per_block(p["dmin"], p["m"])
    offsets = CODE_OFFSET * scales.astype(jnp.float32) - mins  # c_b
    q40 = QuantizedTensor({"qs": qs40, "d": scales.T}, "q4_0", (n, k))
    return q40, offsets.T


def block_sums(x: jax.Array) -> jax.Array:
    """x [..., K] -> [..., K/32] f32: the sum of x over each 32-block."""
    k = x.shape[-1]
    return jnp.sum(jnp.reshape(x.astype(jnp.float32), (*x.shape[:-1], k // BLOCK, BLOCK)), axis=-1)


def matmul_split(
    x: jax.Array,  # [..., K]
    q40: QuantizedTensor,  # [N, K] q4_0, from `split_q4_k`
    offsets: jax.Array,  # [K/32, N] f32
    q4_0_matmul: Callable[[jax.Array, QuantizedTensor], jax.Array] = qmatmul_reference,
) -> jax.Array:  # [..., N] f32
    """x @ w'.T: `q4_0_matmul` (any implementation of op "matmul" for q4_0) on the codes and
    scales, plus the offsets' term in an f32 dot (HIGHEST: a GPU would otherwise use tf32)."""
    main = q4_0_matmul(x, q40)
    correction = jax.lax.dot_general(
        block_sums(x), offsets, (((x.ndim - 1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return main + correction
