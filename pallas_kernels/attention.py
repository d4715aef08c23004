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


def _cache_rows(k_cache, v_cache, lead: tuple, span: int | None, seq_axis: int):
    """The cache at leading (possibly traced) indices `lead`, cut to positions [0, span)."""
    for i in lead:
        k_cache = jax.lax.dynamic_index_in_dim(k_cache, i, axis=0, keepdims=False)
        v_cache = jax.lax.dynamic_index_in_dim(v_cache, i, axis=0, keepdims=False)
    if span is not None:
        if not 1 <= span <= k_cache.shape[seq_axis]:
            raise ValueError(f"span {span} outside the cache's [1, {k_cache.shape[seq_axis]}]")
        k_cache = jax.lax.slice_in_dim(k_cache, 0, span, axis=seq_axis)
        v_cache = jax.lax.slice_in_dim(v_cache, 0, span, axis=seq_axis)
    return k_cache, v_cache


def attention_decode_reference(
    q: jax.Array,  # [B, H, D]
    k_cache: jax.Array,  # [B, S, K, D], or [L, B, S, K, D] with `layer`
    v_cache: jax.Array,  # same shape as k_cache
    positions: jax.Array,  # [B] int32, the query's position (its key is already in the cache)
    scale: float,
    window: jax.Array | int = 0,
    *,
    layer: jax.Array | int | None = None,  # the layer of a stacked cache (may be traced)
    span: int | None = None,  # static: only cache positions [0, span) are attended (default S)
    # [B] int32: the cache row (slot) of each query row (None: row b's is b); rows may share one
    slots: jax.Array | None = None,
) -> jax.Array:  # [B, H, D] f32
    k_cache, v_cache = _cache_rows(k_cache, v_cache, () if layer is None else (layer,), span, 1)
    if slots is not None:
        k_cache, v_cache = k_cache[slots], v_cache[slots]
    b, h, d = q.shape
    s, kh = k_cache.shape[1], k_cache.shape[2]
    g = h // kh
    # One query per slot: products summed along D and S rather than dots, whose batch axes (B,
    # K) are not leading in the cache: XLA's CPU dots copied each layer's K and V into
    # transposed buffers first, and at 8 slots these sums take 70-80% of the dots' time
    # (bucket 1,024 and 4,096, SmolLM2's 3 x 3 heads of 64, 2 Xeon cores).
    qg = q.astype(jnp.float32).reshape(b, 1, kh, g, d)
    scores = jnp.sum(qg * k_cache.astype(jnp.float32)[:, :, :, None, :], axis=-1) * scale  # [B, S, K, G]
    mask = _visible(positions[:, None], jnp.arange(s)[None, :], window)  # [B, S]
    scores = jnp.where(mask[:, :, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(probs[..., None] * v_cache.astype(jnp.float32)[:, :, :, None, :], axis=1)  # [B, K, G, D]
    return out.reshape(b, h, d)


def attention_prefill_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [S, K, D] (one slot), or [L, B, S, K, D] with `layer` and `slot`
    v_cache: jax.Array,  # same shape as k_cache
    start_pos: jax.Array,  # [] int32: position of q[0]
    scale: float,
    window: jax.Array | int = 0,
    *,
    layer: jax.Array | int | None = None,  # with `slot`: the row of a stacked cache (may be traced)
    slot: jax.Array | int | None = None,
    span: int | None = None,  # static: only cache positions [0, span) are attended (default S)
) -> jax.Array:  # [T, H, D] f32
    if (layer is None) != (slot is None):
        raise ValueError("layer and slot go together (a stacked [L, B, S, K, D] cache) or not at all")
    k_cache, v_cache = _cache_rows(k_cache, v_cache, () if layer is None else (layer, slot), span, 0)
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


def pack_decode_write(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [B, H, D], a decode step's new keys and values k, v [B, K, D] -> [B, K * (G + 2), D]:
    per kv head its G queries, then its key, then its value (the `write_pos` call of a decode
    implementation that writes the cache itself; the f32 values: the kernel rounds k and v to
    the cache's dtype). Per-kv-head order keeps a tensor-parallel split of the kv heads a split
    of this axis."""
    b, h, d = q.shape
    kh = k.shape[1]
    parts = [q.reshape(b, kh, h // kh, d), k[:, :, None].astype(q.dtype), v[:, :, None].astype(q.dtype)]
    return jnp.concatenate(parts, axis=2).reshape(b, kh * (h // kh + 2), d)


attention_decode_reference.takes_slots = True  # (model/forward.py's speculative decode)
registry.register("attention_decode", "reference", attention_decode_reference)
registry.register("attention_prefill", "reference", attention_prefill_reference)
