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


# `attention_decode_chunked`'s keys per loop trip. On 2 EPYC cores, SmolLM2's 30 layers at 8
# slots and a 1,024-key span (bench/cpu_decode_attention.py): 17.7 ms at positions of 50-99 and
# 106 ms at 500-999, against the reference's 202-207 ms; chunks of 64 and 256 were slower at
# both (16.8 / 113 and 40.0 / 147 ms against 15.7 / 101, the script's earlier form;
# bench/results/README.md, sixty-eighth session).
DECODE_KEY_CHUNK = 128


def attention_decode_chunked(
    q: jax.Array,  # [B, H, D]
    k_cache: jax.Array,  # [B, S, K, D], or [L, B, S, K, D] with `layer`
    v_cache: jax.Array,
    positions: jax.Array,  # [B] int32 (an idle row: -1, or 0 as the forward pass gives it)
    scale: float,
    window: jax.Array | int = 0,
    *,
    layer: jax.Array | int | None = None,
    span: int | None = None,
    slots: jax.Array | None = None,
) -> jax.Array:  # [B, H, D] f32
    """The reference's attention (same arguments; its f32 math, softmax online) read in chunks
    of DECODE_KEY_CHUNK keys, only the chunks some row sees: the first chunk, then those from
    the earliest key the window of a row past position 0 shows to the latest row's position, in
    a loop whose trip count is traced (the CPU's implementation: its decode reads the keys a
    step needs, not the whole context bucket). An online softmax carries each row's running
    maximum, sum and weighted values across chunks. A span that is not a multiple of the chunk
    ends in a chunk moved back to end at the cache's edge, its keys already read masked.

    A row's output does not depend on the other rows: a chunk wholly before or after the keys a
    row sees leaves its sums bit for bit as they were (its weights are exactly 0, and the
    rescale by exp(0) is exactly 1, or, before the row's first visible key, its placeholder sums
    are multiplied by exactly 0), so the trip count that the other rows set changes nothing.
    Rows at position 0 (the forward pass's idle rows) see only the first chunk, which is always
    read: they do not hold the loop's start back."""
    s_all = k_cache.shape[-3]
    span = s_all if span is None else span
    if not 1 <= span <= s_all:
        raise ValueError(f"span {span} outside the cache's [1, {s_all}]")
    c = min(DECODE_KEY_CHUNK, s_all)
    b, h, d = q.shape
    rows_in_cache, kh = k_cache.shape[-4], k_cache.shape[-2]
    g = h // kh
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    zero = jnp.int32(0)
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, 1, kh, g, d)

    def load(cache, start):  # [B, c, K, D]: each query row's cache row at keys [start, start + c)
        x = jax.lax.dynamic_slice(cache, (*lead, zero, start, zero, zero), (1,) * len(lead) + (rows_in_cache, c, kh, d))
        x = x.reshape(rows_in_cache, c, kh, d)
        return (x if slots is None else x[slots]).astype(f32)

    def body(i, carry):
        top, total, acc = carry  # [B, K, G], [B, K, G], [B, K, G, D]
        start = jnp.minimum(i * c, s_all - c)  # the last chunk of a span short of a multiple: moved back
        keys = start + jnp.arange(c)
        scores = jnp.sum(qg * load(k_cache, start)[:, :, :, None, :], axis=-1) * scale  # [B, c, K, G]
        mask = _visible(positions[:, None], keys[None, :], window) & ((keys >= i * c) & (keys < span))[None, :]
        scores = jnp.where(mask[:, :, None, None], scores, _NEG)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        rescale = jnp.exp(top - new_top)
        weights = jnp.exp(scores - new_top[:, None])
        total = total * rescale + jnp.sum(weights, axis=1)
        acc = acc * rescale[..., None] + jnp.sum(weights[..., None] * load(v_cache, start)[:, :, :, None, :], axis=1)
        return new_top, total, acc

    n_chunks = -(-span // c)
    last = jnp.clip((jnp.max(positions) + c) // c, 1, n_chunks)  # one past the latest row's chunk
    seen_from = jnp.where(jnp.asarray(window) > 0, jnp.maximum(positions - window + 1, 0), 0)
    first = jnp.min(jnp.where(positions > 0, seen_from, span)) // c
    init = (jnp.full((b, kh, g), _NEG, f32), jnp.zeros((b, kh, g), f32), jnp.zeros((b, kh, g, d), f32))
    carry = body(0, init)
    _, total, acc = jax.lax.fori_loop(jnp.maximum(first, 1), last, body, carry)
    return (acc / total[..., None]).reshape(b, h, d)


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
attention_decode_chunked.takes_slots = True
registry.register("attention_decode", "reference", attention_decode_reference)
# The CPU's: a loop of traced length would cost a GPU a host round trip per trip.
registry.register("attention_decode", "chunked", attention_decode_chunked,
                  is_available=lambda: jax.default_backend() == "cpu", priority=5)
registry.register("attention_prefill", "reference", attention_prefill_reference)
