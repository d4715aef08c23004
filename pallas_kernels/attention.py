"""Attention ops: plain-jnp references (f32 math; the specification and the CPU path).

Decode: one new query per slot against that slot's cached keys, with per-slot lengths.
Prefill: a chunk of queries of one slot against its cache (the cached prefix plus the chunk,
already written), causal. Grouped-query attention: H query heads share K kv heads (G = H / K).
Optional sliding window (gemma3's local layers): key s is visible to query p when
p - window < s <= p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry

_NEG = -1e30


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    # q_pos [..., 1], k_pos [S]; window 0 = unlimited
    causal = k_pos <= q_pos
    windowed = jnp.where(window > 0, k_pos > q_pos - window, True)
    return causal & windowed


def attention_decode_reference(
    q: jax.Array,  # [B, H, D]
    k_cache: jax.Array,  # [B, S, K, D]
    v_cache: jax.Array,  # [B, S, K, D]
    positions: jax.Array,  # [B] int32, the query's position (its key is already in the cache)
    scale: float,
    window: jax.Array | int = 0,
) -> jax.Array:  # [B, H, D] f32
    b, h, d = q.shape
    s, kh = k_cache.shape[1], k_cache.shape[2]
    g = h // kh
    qg = q.astype(jnp.float32).reshape(b, kh, g, d)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k_cache.astype(jnp.float32), precision="highest") * scale
    mask = _visible(positions[:, None], jnp.arange(s)[None, :], window)  # [B, S]
    scores = jnp.where(mask[:, None, None, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v_cache.astype(jnp.float32), precision="highest")
    return out.reshape(b, h, d)


def attention_prefill_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [S, K, D] (one slot)
    v_cache: jax.Array,  # [S, K, D]
    start_pos: jax.Array,  # [] int32: position of q[0]
    scale: float,
    window: jax.Array | int = 0,
) -> jax.Array:  # [T, H, D] f32
    t, h, d = q.shape
    s, kh = k_cache.shape[0], k_cache.shape[1]
    g = h // kh
    qg = q.astype(jnp.float32).reshape(t, kh, g, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k_cache.astype(jnp.float32), precision="highest") * scale
    q_pos = start_pos + jnp.arange(t)
    mask = _visible(q_pos[:, None], jnp.arange(s)[None, :], window)  # [T, S]
    scores = jnp.where(mask[None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs, v_cache.astype(jnp.float32), precision="highest")
    return out.reshape(t, h, d)


registry.register("attention_decode", "reference", attention_decode_reference)
registry.register("attention_prefill", "reference", attention_prefill_reference)
