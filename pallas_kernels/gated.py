"""The gated FFN's activation taken by the gate/up matmul itself: the layout of its weight and
what the product means.

A gated FFN computes act(x @ gate.T) * (x @ up.T) and hands it to the down projection. With the
gate and up rows fused into one matrix, the engine ran that product as an XLA kernel of its own
between the two matmuls (with the permutation into the down projection's x order: about 1.9 us
a layer of a 7B decode step on the H200). A matmul that takes `gated=act` computes it in its own
epilogue instead, on a weight whose rows are interleaved at load (`interleave_index`): groups of
GROUP gate rows, each followed by the GROUP up rows of the same features, so that one 64-row
tile of the weight holds both factors of 32 outputs. The features can be put in any order at the
same time (the down projection's x order), so the product comes out as that matmul reads it.

`from_interleaved` is the product's definition on the plain matmul's output: what a matmul
without the epilogue is followed by, and what the kernels are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32  # features per group: gate rows, then the same features' up rows
ACTIVATIONS = ("silu", "gelu_tanh")  # ModelConfig.activation's values


def activation(name: str, x, exp=jnp.exp, tanh=jnp.tanh):
    """act(x) as model/forward.py applies it (jax.nn.silu; jax.nn.gelu with the tanh form), in ops
    a Mosaic GPU kernel lowers (exp, division, tanh; no integer powers). x: a jax array, or, with
    `exp` and `tanh` given, any value with arithmetic (a Mosaic GPU register array: the same ops
    in the same order, so the same f32 roundings)."""
    if name == "silu":
        return x / (1.0 + exp(-x))
    if name == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * (x * x * x))
        return 0.5 * x * (1.0 + tanh(inner))
    raise ValueError(f"unknown activation {name!r}; known: {ACTIVATIONS}")


# gelu_tanh's constants as f32 values (python floats: f32 against an f32 operand in jax and Mosaic)
_SQRT_2_OVER_PI = float(np.float32(np.sqrt(2.0 / np.pi)))
_GELU_CUBIC = float(np.float32(0.044715))


def interleave_index(ffn_dim: int, order: np.ndarray | None = None) -> np.ndarray:
    """The rows [2 F] of the fused [gate; up] matrix (gate rows 0..F-1, up rows F..2F-1) in the
    interleaved layout: group g holds the gate rows of features order[GROUP g : GROUP (g+1)],
    then their up rows. order: the features' order in the product ([F], a permutation; None: as
    they are)."""
    if ffn_dim % GROUP:
        raise ValueError(f"an FFN width of {ffn_dim} is not a multiple of {GROUP}")
    order = np.arange(ffn_dim) if order is None else np.asarray(order)
    if not np.array_equal(np.sort(order), np.arange(ffn_dim)):
        raise ValueError(f"order is not a permutation of the {ffn_dim} features")
    groups = np.reshape(order, (-1, GROUP))
    return np.reshape(np.stack([groups, groups + ffn_dim], axis=1), (-1,)).astype(np.int32)


def from_interleaved(y: jax.Array, act: str) -> jax.Array:
    """y [..., 2 F], x times the interleaved matrix -> act(gate) * up [..., F] in the features'
    order `interleave_index` was given, in y's dtype."""
    lead, n = y.shape[:-1], y.shape[-1]
    pairs = jnp.reshape(y, (*lead, n // (2 * GROUP), 2, GROUP))
    out = activation(act, pairs[..., 0, :]) * pairs[..., 1, :]
    return jnp.reshape(out, (*lead, n // 2))
