"""Prefill attention as a Pallas kernel lowered through Triton: implementation "triton" of op
"attention_prefill" (GPU only; `interpret=True` runs it on CPU).

Flash attention over a chunk of one slot's queries: one program per (block of queries, query
head) loops over key tiles up to the causal limit of its last query (and from the window start
of its first), with the masks applied only on the tiles that straddle a boundary. Inputs,
scores in base 2, dtypes and the helpers it shares with the decode kernel: see
`pallas_kernels/attention_triton.py`, whose module docstring covers both ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import registry
from pallas_kernels.attention_triton import (
    _MIN_DOT,
    _NEG,
    _check_inputs,
    _check_launch,
    _check_pow2,
    _dot_dtype,
    _dot_nt,
    _dot_precision,
    _load_tile,
    _online_softmax_step,
    _pow2_at_least,
    _scalar_inputs,
    _scale_q,
    _span,
    _static_scale,
    _static_window,
    _store,
    _tile_for_dot,
    _TritonParams,
    _visible_tiles,
    is_available,
)


@dataclasses.dataclass(frozen=True)
class PrefillAttentionConfig:
    # None: by head dim and KV itemsize (see `resolve`): 128 queries x 64 keys, 8 warps,
    # 3 stages up to D = 128; 64 x 64, 2 stages at D = 256; half the keys for f32 (shared memory).
    block_t: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        _check_pow2("block_t", self.block_t, _MIN_DOT)
        _check_pow2("block_k", self.block_k, _MIN_DOT)
        _check_launch(self.num_warps, self.num_stages)

    def resolve(self, head_dim: int, itemsize: int) -> tuple[int, int, int, int]:
        """(block_t, block_k, num_warps, num_stages) for this head dim and KV itemsize."""
        if head_dim <= 64:
            auto = (128, 64, 4, 3)
        elif head_dim <= 128:
            auto = (128, 64 if itemsize <= 2 else 32, 8, 3)
        else:
            auto = (64, 64 if itemsize <= 2 else 32, 8, 2)
        given = (self.block_t, self.block_k, self.num_warps, self.num_stages)
        return tuple(g if g is not None else a for g, a in zip(given, auto))  # type: ignore[return-value]


DEFAULT_PREFILL_CONFIG = PrefillAttentionConfig()


def _prefill_kernel(
    start_ref,  # [1] int32: position of query 0
    win_ref,  # [1] int32
    scale_ref,  # [1] f32: scale * log2(e)
    where_ref,  # [2] int32: (layer, slot) of the cache stack to read
    q_ref,  # [T, D] this head's queries
    k_ref,  # [L, B, S, D] its kv head's keys, every layer and slot (read in place)
    v_ref,  # [L, B, S, D]
    o_ref,  # [T, D] f32
    *,
    block_t: int,
    block_k: int,
    num_queries: int,
    num_keys: int,
    num_q_blocks: int,
    has_window: bool,
):
    lead = (where_ref[0], where_ref[1])
    s_max = k_ref.shape[2]
    # Heaviest (latest) query blocks first: causal work grows with the block index.
    qb = num_q_blocks - 1 - pl.program_id(0)
    start = start_ref[0]
    row0 = qb * block_t
    q = _load_tile(q_ref, row0, block_t, num_queries, num_queries % block_t != 0)
    dot_dtype = _dot_dtype(k_ref.dtype)
    q = _scale_q(q, scale_ref, dot_dtype)  # [block_t, D]
    precision = _dot_precision(dot_dtype)
    q_pos = start + row0 + jnp.arange(block_t, dtype=jnp.int32)  # [block_t]
    q_first = start + row0
    q_last = start + lax.min(row0 + block_t, num_queries) - 1  # last real query of the block
    _, _, lo, hi, win = _visible_tiles(q_first, q_last, num_keys, win_ref, has_window, block_k)
    # Tiles every query of the block sees whole: keys <= q_first (causal), keys > q_last - win
    # (window), keys < S. They skip the masks. [full_lo, full_hi) may be empty.
    full_hi = lax.min(lax.div(q_first + 1, block_k), num_keys // block_k)
    full_lo = jnp.int32(0)
    if has_window:
        full_lo = jnp.where(win > 0, lax.div(lax.max(q_last - win + 1, 0) + block_k - 1, block_k), 0)
    mid_lo = lax.min(lax.max(full_lo, lo), hi)
    mid_hi = lax.min(lax.max(full_hi, mid_lo), hi)
    # A tile crossing the cache's end needs a masked load (the mask below hides keys >= num_keys).
    is_ragged = -(-num_keys // block_k) * block_k > s_max

    def body(t, carry, masked: bool):
        kstart = pl.multiple_of(t * block_k, block_k)
        k = _load_tile(k_ref, kstart, block_k, s_max, is_ragged and masked, lead)  # [block_k, D]
        s = _dot_nt(q, _tile_for_dot(k, dot_dtype), precision)  # [block_t, block_k]
        visible = None
        if masked:
            keys = kstart + jnp.arange(block_k, dtype=jnp.int32)
            visible = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < num_keys)
            if has_window:
                visible = visible & ((win <= 0) | (keys[None, :] > q_pos[:, None] - win))
        v = _load_tile(v_ref, kstart, block_k, s_max, is_ragged and masked, lead)
        return _online_softmax_step(carry, s, visible, _tile_for_dot(v, dot_dtype), precision)

    d = q.shape[1]
    carry = (
        jnp.zeros((block_t, d), jnp.float32),
        jnp.full((block_t,), _NEG, jnp.float32),
        jnp.zeros((block_t,), jnp.float32),
    )
    carry = lax.fori_loop(lo, mid_lo, functools.partial(body, masked=True), carry)  # window edge
    carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(mid_hi, hi, functools.partial(body, masked=True), carry)  # diagonal
    acc, _, l = carry
    # l = 0 only for a padding query past the cache with a window; keep it finite.
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    rows = pl.ds(row0, block_t)
    if num_queries % block_t:
        mask = (row0 + jnp.arange(block_t, dtype=jnp.int32) < num_queries)[:, None]
        _store(o_ref.at[rows, :], out, mask=jnp.broadcast_to(mask, out.shape))
    else:
        o_ref[rows, :] = out


@functools.partial(jax.jit, static_argnames=("config", "interpret", "static_scale", "static_window", "span"))
def _prefill(q, k_cache, v_cache, start_pos, scale, window, where, *, config, interpret, static_scale, static_window,
             span):
    """k_cache, v_cache [L, B, S_max, K, D]; keys [0, span) of (layer, slot) = `where` are attended."""
    t, h, d = q.shape
    s, kh = span, k_cache.shape[3]
    g = h // kh
    block_t, block_k, num_warps, num_stages = config.resolve(d, k_cache.dtype.itemsize)
    # A chunk shorter than a block: shrink the block (still >= 16, Triton's smallest dot).
    block_t = min(block_t, max(_MIN_DOT, _pow2_at_least(t)))
    num_q_blocks = -(-t // block_t)
    kernel = functools.partial(
        _prefill_kernel,
        block_t=block_t,
        block_k=block_k,
        num_queries=t,
        num_keys=s,
        num_q_blocks=num_q_blocks,
        has_window=static_window != 0,
    )
    scale_arr, win_arr = _scalar_inputs(scale, window, static_scale, static_window)
    num_layers, num_slots, s_max = k_cache.shape[:3]
    kv_spec = pl.BlockSpec((num_layers, num_slots, s_max, None, d), lambda i, j: (0, 0, 0, lax.div(j, g), 0))
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, h),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((2,), lambda i, j: (0,)),
            pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0)),
        out_shape=jax.ShapeDtypeStruct((t, h, d), jnp.float32),
        compiler_params=_TritonParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="attention_prefill",
    )(jnp.reshape(jnp.asarray(start_pos, jnp.int32), (1,)), win_arr, scale_arr, where, q, k_cache, v_cache)


def attention_prefill_triton(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [S, K, D] (one slot; the chunk's keys already written), or [L, B, S, K, D]
    v_cache: jax.Array,  # same shape as k_cache
    start_pos: jax.Array,  # [] int32 >= 0: position of q[0]
    scale: float,
    window: jax.Array | int = 0,  # 0 = unlimited; may be traced
    *,
    layer: jax.Array | int | None = None,  # with `slot`: the row of a stacked cache, read in place
    slot: jax.Array | int | None = None,
    span: int | None = None,  # static: only cache positions [0, span) are attended (default S)
    config: PrefillAttentionConfig = DEFAULT_PREFILL_CONFIG,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D] f32
    """Same contract as `attention_prefill_reference` for queries at positions < span (padding
    queries past it get finite junk, never read by the forward pass)."""
    stacked = layer is not None
    if stacked != (slot is not None):
        raise ValueError("layer and slot go together (a stacked [L, B, S, K, D] cache) or not at all")
    if q.ndim != 3 or k_cache.ndim != (5 if stacked else 3) or jnp.ndim(start_pos) != 0:
        raise ValueError(
            f"want q [T, H, D], caches {'[L, B, S, K, D]' if stacked else '[S, K, D]'}, start_pos []; "
            f"got {q.shape}, {k_cache.shape}, {jnp.shape(start_pos)}"
        )
    s, _, _ = _check_inputs(q, k_cache, v_cache, seq_axis=k_cache.ndim - 3)
    if not stacked:
        k_cache, v_cache = k_cache[None, None], v_cache[None, None]
    where = jnp.stack([jnp.asarray(0 if layer is None else layer, jnp.int32),
                       jnp.asarray(0 if slot is None else slot, jnp.int32)])
    return _prefill(
        q, k_cache, v_cache, start_pos, scale, window, where,
        config=config, interpret=interpret, static_scale=_static_scale(scale), static_window=_static_window(window),
        span=_span(span, s),
    )


# Above the reference (priority 0): chosen wherever a GPU is present.
registry.register("attention_prefill", "triton", attention_prefill_triton, is_available=is_available, priority=10)
