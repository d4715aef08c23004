"""Attention ops as Pallas kernels lowered through Triton: implementation "triton" of ops
"attention_decode" (here) and "attention_prefill" (`pallas_kernels/attention_triton_prefill.py`,
which shares this module's helpers), GPU only; `interpret=True` runs them on CPU.

Inputs come from the model's forward pass (`model/forward.py`), exactly as the plain-jnp
references in `pallas_kernels/attention.py` take them: the whole cache [L, B, S_max, K, D] with
a traced `layer` (and, for prefill, `slot`), read in place (a slice handed to a kernel would be
a copy every layer), and a static `span`, the power-of-two context bucket [0, S) attended. A
plain [B, S, K, D] (decode) or [S, K, D] (one slot, prefill) cache is a stack of one. Positions /
start_pos and the sliding window are traced int32 values. Outputs are f32, as the references'
are; decode's may be asked in the activations' dtype (`out_dtype`), which the engine's next op
takes.

Decode is flash decoding (split-K): one program per (slot row, kv head, split) loads [block_s,
D] tiles of K and V of its kv head once for all G = H / K query heads of that head (the G
queries padded to >= 16 rows, the smallest Triton dot). A row's keys are taken in chunks of
`min_split_keys` from key 0 (whole tiles): each chunk's online softmax in f32 starts afresh
(`_chunk_step`), and the row's result is its chunks' partials (max, sum, unnormalised output)
folded in key order (`_fold`), then its new key's. One split folds them in its registers and
writes the output; several splits each take a run of whole chunks and write each chunk's
partial, and the last of a (row, kv head)'s programs to finish, counted with an atomic add,
folds them all with the same operations (`_merge_if_last`). So a row's output is bitwise the
same however its chunks are spread over programs: whatever the plan, the other rows and the
span (the context bucket), the engine's batch invariance. The grid's splits are static
(`DecodeAttentionConfig.plan`: enough to fill about `target_programs` programs with all B rows);
by default a row divides its chunks among them by its own length. The plan for few busy rows
(`few_rows`; the engine runs it for up to `few_rows_limit` busy slots) fills them with one row
and gives each row splits in proportion to its share of all rows' tiles, so a lone long row
beside idle slots spreads over many programs, with the same output. Splits without tiles write
only their count. Each program loops only over tiles that hold visible keys of its row (its
position and window), so short and inactive rows read nothing past their last key. With
`write_pos` (the forward pass's decode step) the call also writes each row's new key and value
into the caches, aliased in and out, instead of two XLA scatters before it. With `slots` each
query row names its cache row, so that rows may share one at consecutive positions (the
speculative decode, which writes all rows' keys and values before the call in a kernel of its
own, `pallas_kernels/kv_write_triton.py`, offered as `attention_decode_triton.write_rows`).

Prefill is flash attention: one program per (block of queries, query head) loops over key
tiles up to the causal limit of its last query (and from the window start of its first),
with the masks applied only on the tiles that straddle a boundary.

Scores use base-2 exponentials: the kernels multiply q by scale * log2(e) in f32 (then round
it to the dots' dtype, `_dot_dtype`) and compute exp2(s - m); partial maxima are base-2 as well.
bf16/f16 caches use tensor-core dots with f32 accumulation; an 8-bit float (e4m3) cache's tiles
become f16 after their load, and q and the softmax weights are rounded to f16 for its dots; f32
caches use IEEE f32 dots (`Precision.HIGHEST`; Triton's default would be tf32). A cache length
not a multiple of the tile is read with masked loads on the last tile. Dimension letters: B
slots, T queries, S cache positions, H query heads, K kv heads, G = H / K, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import registry
from pallas_kernels.kv_write_triton import write_decode_rows_triton

# jax renamed TritonCompilerParams to CompilerParams; pick whichever this jax has.
_TritonParams = plt.CompilerParams if hasattr(plt, "CompilerParams") else plt.TritonCompilerParams
# Masked loads/stores moved from `pl` to the Triton module.
_load = plt.load if hasattr(plt, "load") else pl.load
_store = plt.store if hasattr(plt, "store") else pl.store

_NEG = -1e30  # finite: a fully masked row never computes inf - inf
_LOG2E = math.log2(math.e)
_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16
# The longest default decode tile: 512 keys, bf16's at D = 16; an 8-bit cache's would be 1024
# there, a [G, 1024] f32 score tile and two [1024, 16] f16 tiles in registers.
MAX_DEFAULT_BLOCK_S = 512
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_MERGE_GROUP = 16  # chunks whose partials the merge loads at once
_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), _FP8)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_pow2(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (not _is_pow2(value) or value < minimum):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def _g_pad(groups: int) -> int:  # a kv head's query rows as the dots take them
    return max(_MIN_DOT, _pow2_at_least(groups))


def _partials(num_tiles: int, chunk_tiles: int, writes: bool, b: int, kh: int, groups: int, d: int) -> list:
    """Several splits' partials acc, m, l: per chunk of the span (and new key), row and kv head."""
    shape = (-(-num_tiles // chunk_tiles) + writes, b, kh, _g_pad(groups))
    return [jax.ShapeDtypeStruct((*shape, d), jnp.float32), *[jax.ShapeDtypeStruct(shape, jnp.float32)] * 2]


def _check_launch(num_warps: int | None, num_stages: int | None) -> None:
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps}")
    if num_stages is not None and not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages must be in [1, 8], got {num_stages}")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What one decode call runs: keys per tile, the most splits of a row's keys per (row, kv
    head) (the grid's third axis), warps, and how a row takes its splits: by its own length
    (batch-invariant) or by its share of all rows' tiles (`by_share`, the few-rows plan)."""

    block_s: int
    num_splits: int
    num_warps: int
    by_share: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    # Keys per tile. None: an 8 KiB K tile (32 keys at D = 128 in bf16, 64 in fp8) for one query
    # per kv head (G = 1), a 16 KiB one otherwise (64 keys at D = 128 in bf16, 128 in fp8, 32 in
    # f32); at least 16 and at most MAX_DEFAULT_BLOCK_S keys.
    block_s: int | None = None
    # The most splits of a row's visible keys (the grid's third axis). None: enough for about
    # `target_programs` programs over the rows the call is planned for (all B, or one with
    # `few_rows`; see `plan`), at most `max_splits`. A row uses as many as its chunks allow.
    num_splits: int | None = None
    # On the H200 (bench/results, sessions 10, 11 and 20): 8 busy rows x 32 kv heads (Llama-2-7B,
    # 256 programs) ran fastest in one split at 200, 1000 and 4000 keys (32.8 against 36.5 us at
    # 1000 keys, 10.0 against 11.0 at 200). One busy row of the 8 took 23.7 us at 1000 keys in
    # one split and 12.1 sharing 8, 89.6 against 28.9 at 4000 keys: the few-rows plan.
    target_programs: int = 256
    # Keys per chunk (rounded up to whole tiles): the unit a split takes and of the fold's order,
    # so part of what a row's output rounds like (the same in every plan). Each chunk costs the
    # fold's few vector operations in one program, or a partial's store and load with splits.
    min_split_keys: int = 128
    max_splits: int = 16
    # None: 2 with the 8 KiB tile of one query per kv head, else 4.
    num_warps: int | None = None
    num_stages: int = 3
    # Splits write a partial per chunk of the span for every row and kv head (f32, G_pad rows);
    # where those buffers would pass this many bytes the call runs one split, the same bits.
    max_partial_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        _check_pow2("block_s", self.block_s, _MIN_DOT)
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.target_programs < 1:
            raise ValueError(f"target_programs must be >= 1, got {self.target_programs}")
        if self.min_split_keys < 1:
            raise ValueError(f"min_split_keys must be >= 1, got {self.min_split_keys}")
        if self.max_splits < 1:
            raise ValueError(f"max_splits must be >= 1, got {self.max_splits}")
        _check_launch(self.num_warps, self.num_stages)

    def plan(self, num_rows: int, num_kv_heads: int, groups: int, head_dim: int, itemsize: int, span: int,
             few_rows: bool = False) -> DecodePlan:
        """The tile, the most splits and the warps of a call over `span` keys of `num_rows`
        rows; `few_rows`: planned for a lone busy row, rows sharing the splits by length; one
        split where the partials would pass `max_partial_bytes`. A row's output is the same
        under every plan (the chunks): a plan sets the speed only. One query per kv head (G = 1,
        the query rows padded 16x for the dot) takes half-size tiles and 2 warps: 10.1 against
        11.2 us at 8 x 32 programs and 200 keys on the H200, 10.9 against 12.1 for one busy row
        at 1000 keys in 8 splits; with G = 4 the full tile and 4 warps were faster (6.3 against
        7.1 us)."""
        small = groups == 1
        # An 8-bit cache's tiles hold twice the keys of bf16's (the same bytes per load), though
        # they become f16 in registers: on the H200 (7B, 3,900 keys) its attention took 3,095
        # against 3,501 us per step with 8 busy rows and 3,297 against 3,468 with one, where
        # tiles sized as bf16's (bench/results, thirteenth session).
        block_s = self.block_s or max(_MIN_DOT, min(MAX_DEFAULT_BLOCK_S,
                                                    (8192 if small else 16384) // (head_dim * itemsize)))
        rows = 1 if few_rows else num_rows
        if self.num_splits is not None:
            splits = self.num_splits
        else:
            splits = min(self.max_splits, -(-self.target_programs // (rows * num_kv_heads)))
        num_tiles = -(-span // block_s)
        if few_rows:  # no more splits than the span holds at min_split_keys each
            splits = min(splits, max(1, (num_tiles * block_s) // self.min_split_keys), num_tiles)
        parts = _partials(num_tiles, self.min_split_tiles(block_s), True, num_rows, num_kv_heads, groups, head_dim)
        if sum(math.prod(p.shape) * p.dtype.itemsize for p in parts) > self.max_partial_bytes:
            splits = 1
        num_warps = self.num_warps or (2 if small and self.block_s is None else 4)
        return DecodePlan(block_s, max(1, splits), num_warps, by_share=few_rows)

    def few_rows_limit(self, num_rows: int, num_kv_heads: int, groups: int, head_dim: int, itemsize: int,
                       span: int) -> int:
        """The most busy rows of `num_rows` for which the few-rows plan should run instead of the
        plan for all of them (where an engine opts in), from a span of 8 splits' keys and where the
        lone row's plan splits further; else 0. One query per kv head: as many as keep the busy rows'
        programs under the plan for all rows below half of `target_programs`, none where the few-rows
        plan has 4 x `target_programs` programs or more (idle rows' too) per chunk of the span; GQA:
        a quarter of the rows from a span over 16 chunks; at least one. As measured on an H100 at
        900-3,000 keys, 8-64 rows (bench/results, sessions 65-67); at 512 one split ran faster (H200)."""
        if span < 8 * self.min_split_keys:
            return 0
        few = self.plan(num_rows, num_kv_heads, groups, head_dim, itemsize, span, few_rows=True)
        every = self.plan(num_rows, num_kv_heads, groups, head_dim, itemsize, span)
        if few.num_splits <= every.num_splits:
            return 0
        if groups > 1:  # several queries a program: to 16 chunks the plan for all rows ran faster
            return max(1, num_rows // 4) if span > 16 * self.min_split_keys else 0
        if num_rows * num_kv_heads * few.num_splits >= 4 * self.target_programs * (span // self.min_split_keys):
            return 0  # 32 rows of 32 heads x 8 splits at 1,024 keys, 64 rows at 2,048: its idle programs lost
        return max(1, (self.target_programs // 2 - 1) // (num_kv_heads * every.num_splits))

    def min_split_tiles(self, block_s: int) -> int:
        """The tiles of a chunk: the fewest a split of a row takes while the row has that many."""
        return max(1, -(-self.min_split_keys // block_s))


DEFAULT_DECODE_CONFIG = DecodeAttentionConfig()


# ---------------------------------------------------------------------------------------------
# input checks shared by both ops


def _static_window(window: jax.Array | int) -> int | None:
    """The window as a Python int when it is static, None when it is traced."""
    return None if isinstance(window, jax.core.Tracer) else int(window)


def _check_inputs(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, seq_axis: int) -> tuple[int, int, int]:
    """(S, K, G) after checking what the kernels can take."""
    if k_cache.shape != v_cache.shape:
        raise NotImplementedError(f"K and V caches differ in shape: {k_cache.shape} vs {v_cache.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise NotImplementedError(f"K and V caches differ in dtype: {k_cache.dtype} vs {v_cache.dtype}")
    if jnp.dtype(k_cache.dtype) not in _KV_DTYPES:
        raise NotImplementedError(f"KV dtype {k_cache.dtype} is not one of {[str(d) for d in _KV_DTYPES]}")
    d = q.shape[-1]
    if d not in _HEAD_DIMS or k_cache.shape[-1] != d:
        raise NotImplementedError(f"head dim {d} (cache {k_cache.shape[-1]}) is not one of {_HEAD_DIMS}")
    s, kh = k_cache.shape[seq_axis], k_cache.shape[seq_axis + 1]
    h = q.shape[-2]
    if h % kh:
        raise ValueError(f"{h} query heads are not a multiple of {kh} kv heads")
    if s < 1:
        raise ValueError("empty cache")
    return s, kh, h // kh


def _scalar_inputs(scale, window, static_scale: float | None, static_window: int | None):
    """[1] f32 scale * log2(e) and [1] int32 window for the kernels: constants when static
    (no device op), else built from the traced values."""
    if static_scale is not None:
        scale_arr = np.asarray([static_scale * _LOG2E], np.float32)
    else:
        scale_arr = jnp.reshape(jnp.asarray(scale, jnp.float32) * _LOG2E, (1,))
    if static_window is not None:
        win_arr = np.asarray([static_window], np.int32)
    else:
        win_arr = jnp.reshape(jnp.asarray(window, jnp.int32), (1,))
    return scale_arr, win_arr


def _static_scale(scale: float | jax.Array) -> float | None:
    return None if isinstance(scale, jax.core.Tracer) else float(scale)


def _dot_dtype(kv_dtype) -> jnp.dtype:
    """The dtype of the dots' operands: the cache's, or f16 for an 8-bit float cache, whose
    tiles are converted after their load (and q and p rounded to f16, not to 8 bits). f16, not
    bf16: e4m3 values (saturated at +-448) are exact in both, but Hopper converts e4m3 pairs to
    f16 in one instruction and to bf16 only by way of f32; q, scaled, and p stay far inside
    f16's range and keep 3 more bits than in bf16."""
    return jnp.dtype(jnp.float16) if jnp.dtype(kv_dtype) == _FP8 else jnp.dtype(kv_dtype)


def _tile_for_dot(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return x if x.dtype == dtype else x.astype(dtype)


def _scale_q(q: jax.Array, scale_ref, dtype) -> jax.Array:
    # Scale (and log2(e), for exp2) in f32, then round to the dots' dtype (`_dot_dtype`).
    return (q.astype(jnp.float32) * scale_ref[0]).astype(dtype)


def _dot_precision(dtype: jnp.dtype):
    # f32 operands: IEEE f32 (Triton would otherwise use tf32); bf16/f16: tensor cores.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _dot_nt(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [M, D] . b [N, D]^T -> [M, N] f32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot_nn(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [M, N] . b [N, D] -> [M, D] f32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _load_tile(ref, start, block: int, num_keys: int, is_ragged: bool, lead: tuple = ()):
    """[block, D] rows [start, start + block) of ref [*lead, S, D] at the leading indices
    `lead` (one indexer: the Triton lowering takes no chained ones); rows past `num_keys` read
    as 0 (only the last tile of a cache whose length is not a multiple of the tile has them)."""
    rows = pl.ds(start, block)
    if not is_ragged:
        return ref[(*lead, rows, slice(None))]
    keys = start + jnp.arange(block, dtype=jnp.int32)
    mask = jnp.broadcast_to((keys < num_keys)[:, None], (block, ref.shape[-1]))
    return _load(ref.at[(*lead, rows, slice(None))], mask=mask, other=jnp.zeros((), ref.dtype))


def _visible_tiles(q_first, q_last, num_keys: int, win_ref, has_window: bool, block: int):
    """(first_key, last_key, lo, hi, win) for queries at positions [q_first, q_last]: the keys
    any of them sees (causal, below `num_keys`, from the window's start for the first query)
    and the tiles [lo, hi) of `block` keys that hold them; win, the window (win_ref[0], <= 0:
    none), or None without one."""
    last_key = lax.min(q_last, num_keys - 1)
    first_key, win = jnp.int32(0), None
    if has_window:
        win = win_ref[0]
        first_key = jnp.where(win > 0, lax.max(q_first - win + 1, 0), 0)
    return first_key, last_key, lax.div(first_key, block), lax.div(last_key, block) + 1, win


def _online_softmax_step(carry, s, visible, v, precision):
    """One key tile of the online softmax. s [M, N] base-2 scores, visible [M, N] or None
    (all visible), v [N, D]; carry (acc [M, D], m [M], l [M]) in f32."""
    acc, m, l = carry
    if visible is not None:
        s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if visible is not None:
        # A row with no visible key yet (prefill, window) has m_new = _NEG and exp2(0) = 1 on its
        # masked scores; a later correction exp2(_NEG - m) = 0 would clear that, but not if a
        # masked key's cache row holds inf/NaN (0 * NaN). Zero them here instead.
        p = jnp.where(visible, p, 0.0)
    corr = jnp.exp2(m - m_new)
    l = l * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + _dot_nn(p.astype(v.dtype), v, precision)
    return acc, m_new, l


# ---------------------------------------------------------------------------------------------
# decode


def _fold(total, part):
    """A chunk's partial `part` (acc [M, D], m [M], l [M]) added to a row's running `total`,
    both rescaled to the larger max. One program's registers and the merge of several programs'
    chunks (`_merge_if_last`) fold alike, so a row's output is bitwise the same however its
    chunks were spread. The larger max's side keeps a scale of exactly 1: each sum is one
    product and one add, which a compiler contracts into an FMA alike in both places (two
    products summed could contract either way). An empty part (0, _NEG, 0) changes nothing."""
    acc, m, l = total
    part_acc, part_m, part_l = part
    part_wins = part_m > m
    m_new = jnp.maximum(m, part_m)
    # the smaller max's side rescaled: exp2 of (smaller - larger), <= 1
    scale = jnp.exp2(jnp.where(part_wins, m - part_m, part_m - m))
    wins = part_wins[:, None]
    acc = jnp.where(wins, part_acc + acc * scale[:, None], acc + part_acc * scale[:, None])
    l = jnp.where(part_wins, part_l + l * scale, l + part_l * scale)
    return acc, m_new, l


def _chunk_step(carry, s, visible, v, precision, is_start):
    """One key tile of a chunk's online softmax (`_online_softmax_step`), the chunk's state
    (acc, m, l) starting afresh where `is_start` (a traced bool: the tile opens a chunk)."""
    acc, m, l = carry
    s = jnp.where(visible, s, _NEG)
    m = jnp.where(is_start, _NEG, m)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)
    corr = jnp.where(is_start, 0.0, jnp.exp2(m - m_new))
    l = l * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + _dot_nn(p.astype(v.dtype), v, precision)
    return acc, m_new, l


def _decode_kernel(
    pos_ref,  # [B] int32, whole array
    work_ref,  # [1] int32: the tiles all rows hold up to their positions (windows aside)
    win_ref,  # [1] int32
    scale_ref,  # [1] f32: scale * log2(e)
    layer_ref,  # [1] int32: the layer of the cache stack to read
    q_ref,  # [H, D] this row's queries (all heads); with `writes` [K * (G + 2), D]: per kv head its
    #         G queries, then its new key and value
    k_ref,  # [L, S, D] this row's keys of this kv head, every layer (read in place)
    v_ref,  # [L, S, D]
    # with `writes`: wpos_ref [B] int32 (where each row's new key goes; outside [0, S): nowhere);
    # with `by_slot`: slots_ref [B] int32, the cache row each query row reads (and writes), and
    # k_ref / v_ref (and k_out_ref / v_out_ref) [L, B_cache, S, D], every cache row of this kv head;
    # with several splits: the counts [B, K] int32 (the output count_ref's buffer);
    # then the outputs: o_ref [H, D] (f32 or `out_dtype`); with several splits, the whole acc_ref
    # [P, B, K, G_pad, D], m_ref, l_ref [P, B, K, G_pad] (P: the span's chunks, and the new key's
    # with `writes`), count_ref [B, K]; with `writes`, k_out_ref, v_out_ref [L, S, D] (aliased)
    *refs,
    writes: bool,
    by_slot: bool,
    block_s: int,
    num_splits: int,
    by_share: bool,
    target_rows: int,
    chunk_tiles: int,
    num_keys: int,
    num_groups: int,
    g_pad: int,
    has_window: bool,
    is_ragged: bool,
    interpret: bool,
):
    out_refs = list(refs)
    wpos_ref = out_refs.pop(0) if writes else None
    slots_ref = out_refs.pop(0) if by_slot else None
    if num_splits > 1:
        out_refs.pop(0)  # the counts as input: the output `count_ref` is the same buffer
    if writes:
        *out_refs, k_out_ref, v_out_ref = out_refs
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    lead = (layer, slots_ref[row]) if by_slot else (layer,)  # the row's [S, D] keys in k_ref
    pos = pos_ref[row]
    # Only tiles holding visible keys of this row: nothing past its position is read.
    first_key, last_key, lo, hi, win = _visible_tiles(pos, pos, num_keys, win_ref, has_window, block_s)
    # The row's chunks [c_lo, c_hi): runs of `chunk_tiles` tiles from key 0, whatever the plan.
    last_tile, has_tiles = hi - 1, lo < hi
    c_lo, c_hi = lax.div(lo, chunk_tiles), lax.div(hi + chunk_tiles - 1, chunk_tiles)
    if num_splits > 1:
        wanted = num_splits
        if by_share:
            # This row's share of the splits: its tiles against all rows' (`work`), scaled so
            # that `target_rows` rows' worth of programs run.
            wanted = lax.div((hi - lo) * target_rows + work_ref[0] - 1, work_ref[0])
            wanted = lax.max(lax.min(wanted, num_splits), 1)
        # consecutive runs of `per` whole chunks (the last run may be shorter)
        per = lax.div(c_hi - c_lo + wanted - 1, wanted)
        first = c_lo + split * per
        lo = lax.max(lo, first * chunk_tiles)
        hi = lax.min(hi, (first + per) * chunk_tiles)

    # The G queries of this kv head, padded to g_pad rows (zeros) for the dot.
    d = q_ref.shape[1]
    q_at = head * (num_groups + 2 if writes else num_groups)
    q_rows = pl.ds(q_at, g_pad)
    row_mask = None
    if num_groups < g_pad:
        row_mask = jnp.broadcast_to((jnp.arange(g_pad, dtype=jnp.int32) < num_groups)[:, None], (g_pad, d))
        q = _load(q_ref.at[q_rows, :], mask=row_mask, other=jnp.zeros((), q_ref.dtype))
    else:
        q = q_ref[q_rows, :]
    dot_dtype = _dot_dtype(k_ref.dtype)
    q = _scale_q(q, scale_ref, dot_dtype)  # [G_pad, D]
    precision = _dot_precision(dot_dtype)
    s_max = k_ref.shape[-2]  # the cache's extent; attention reads [0, num_keys) of it
    if writes:
        # The new key and value: one more partial after the row's chunks (`_new_key_part`),
        # written into the caches by the program whose run of tiles holds the row's last tile
        # (wherever the position lies in the cache, as a scatter would; nowhere for one outside
        # it: an idle row). Taken from q, not from a tile: a select in the tile before the dot
        # kept Triton from pipelining the loads (8 -> 12 us per layer, H200). Their loads and the
        # score come before the loop, to overlap it; the stores after it (before it, they slowed
        # the loop by a third at 1,000 keys).
        wpos = wpos_ref[row]
        new_k = q_ref[pl.ds(q_at + num_groups, 1), :].astype(k_ref.dtype)  # [1, D]
        new_v = q_ref[pl.ds(q_at + num_groups + 1, 1), :].astype(v_ref.dtype)
        owns = jnp.where(has_tiles, (lo <= last_tile) & (last_tile < hi), split == 0)
        new_part = _new_key_part(q, new_k, new_v, (wpos >= first_key) & (wpos <= last_key), g_pad, d)

    single = num_splits == 1
    if not single:
        o_ref, acc_ref, m_ref, l_ref, count_ref = out_refs

    def body(t, carry):
        start = pl.multiple_of(t * block_s, block_s)
        keys = start + jnp.arange(block_s, dtype=jnp.int32)
        k = _load_tile(k_ref, start, block_s, s_max, is_ragged, lead)  # [block_s, D]
        s = _dot_nt(q, _tile_for_dot(k, dot_dtype), precision)  # [G_pad, block_s]
        visible = keys <= last_key
        if has_window:
            visible = visible & ((win <= 0) | (keys > pos - win))
        if writes:  # the cache's stale row at wpos: the new key is attended after the chunks
            visible = visible & (keys != wpos)
        visible = jnp.broadcast_to(visible[None, :], s.shape)
        v = _load_tile(v_ref, start, block_s, s_max, is_ragged, lead)
        in_chunk = lax.rem(t, chunk_tiles)
        is_end = (in_chunk == chunk_tiles - 1) | (t == hi - 1)
        chunk, total = carry
        chunk = _chunk_step(chunk, s, visible, _tile_for_dot(v, dot_dtype), precision, in_chunk == 0)
        if single:  # this program holds all of the row's chunks: fold each as it ends (a branch: as
            # selects on every tile the fold took a lone row's 1,000 keys 24 -> 33 us, H100)
            total = lax.cond(is_end, _fold, lambda total, _: total, total, chunk)
        else:  # each chunk's partial for the merge, at its place in the row's order
            _store_part(acc_ref, m_ref, l_ref, (lax.div(t, chunk_tiles), row, head), chunk, row_mask, is_end)
        return chunk, total

    empty = _empty_part(g_pad, d)
    _, total = lax.fori_loop(lo, hi, body, (empty, empty if single else ()))
    if writes:  # the cache write
        mask = jnp.broadcast_to(owns & (wpos >= 0) & (wpos < s_max), (1, d))
        at = (*lead, pl.ds(lax.clamp(0, wpos, s_max - 1), 1), slice(None))
        _store(k_out_ref.at[at], new_k, mask=mask)
        _store(v_out_ref.at[at], new_v, mask=mask)
    if single:  # the final output, straight into [B, H, D] (in its dtype)
        if writes:
            total = _fold(total, new_part)
        (o_ref,) = out_refs
        _store_out(o_ref, pl.ds(head * num_groups, g_pad), total, row_mask)
        return
    # Several splits: the new key's partial after the chunks', then the last program of this
    # (row, kv head) to arrive merges them all.
    num_parts = acc_ref.shape[0]
    if writes:
        _store_part(acc_ref, m_ref, l_ref, (jnp.int32(num_parts - 1), row, head), new_part, row_mask, owns)
    _merge_if_last(o_ref, acc_ref, m_ref, l_ref, count_ref, (row, head), (c_lo, c_hi), num_parts - writes,
                   writes, num_splits, num_groups, interpret)


def _new_key_part(q, new_k, new_v, attend, g_pad: int, d: int):
    """The new key's partial for the G_pad query rows: its score and value where attended."""
    s_new = jnp.sum(q.astype(jnp.float32) * jnp.broadcast_to(new_k.astype(jnp.float32), (g_pad, d)), axis=1)
    return (jnp.where(attend, jnp.broadcast_to(new_v.astype(jnp.float32), (g_pad, d)), 0.0),
            jnp.where(attend, s_new, _NEG), jnp.broadcast_to(jnp.where(attend, jnp.float32(1), jnp.float32(0)), (g_pad,)))


def _empty_part(rows: int, d: int):
    return jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32)


def _store_part(acc_ref, m_ref, l_ref, at, part, row_mask, when):
    """Store a partial at `at` = (part, row, kv head) where `when` (acc's padding rows: never)."""
    acc, m, l = part
    g_pad, d = acc.shape
    mask = jnp.broadcast_to(when, (g_pad, d))
    if row_mask is not None:
        mask = mask & row_mask
    _store(acc_ref.at[(*at, slice(None), slice(None))], acc, mask=mask)
    _store(m_ref.at[(*at, slice(None))], m, mask=jnp.broadcast_to(when, (g_pad,)))
    _store(l_ref.at[(*at, slice(None))], l, mask=jnp.broadcast_to(when, (g_pad,)))


def _store_out(o_ref, rows, total, row_mask):
    acc, _, l = total
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    if row_mask is None:
        o_ref[rows, :] = out
    else:
        _store(o_ref.at[rows, :], out, mask=row_mask)


def _merge_if_last(o_ref, acc_ref, m_ref, l_ref, count_ref, at, chunks, num_chunk_parts: int, writes: bool,
                   num_splits: int, num_groups: int, interpret: bool):
    """Each split's program counts itself in `count_ref[row, kv head]` (0 at the call) once
    its partials are written; the last to count folds the row's chunks [c_lo, c_hi) in order,
    then the new key's partial (`writes`), as one program does in its registers. The barrier
    makes every thread's stores precede the count (one thread's atomic add, acquire-release at
    GPU scope); the partials are read as volatile loads, past the L1. Chunks come in groups of
    `_MERGE_GROUP` whose loads issue together (one at a time: 17.2 against 11.4 us, a lone
    Llama-3-8B row at 4k keys, H200). Interpreted (programs in turn): no barrier."""
    row, head = at
    c_lo, c_hi = chunks
    if not interpret:
        plt.debug_barrier()
    ticket = plt.atomic_add(count_ref, (row, head), jnp.int32(1))

    @pl.when(ticket == num_splits - 1)
    def _merge():
        d = acc_ref.shape[-1]
        g_p = _pow2_at_least(num_groups)  # the query rows, padded to a power of two only

        def load(c, live):  # a part where `live`, else an empty one
            at_c = (c, row, head, pl.ds(0, g_p))
            ml_mask = jnp.broadcast_to(live, (g_p,))
            m = _load(m_ref.at[at_c], mask=ml_mask, other=jnp.full((), _NEG, jnp.float32), volatile=True)
            l = _load(l_ref.at[at_c], mask=ml_mask, other=jnp.zeros((), jnp.float32), volatile=True)
            acc = _load(acc_ref.at[(*at_c, slice(None))], mask=jnp.broadcast_to(live, (g_p, d)),
                        other=jnp.zeros((), jnp.float32), volatile=True)
            return acc, m, l

        def group(i, total):
            first = i * _MERGE_GROUP
            parts = [load(first + j, (first + j >= c_lo) & (first + j < c_hi)) for j in range(_MERGE_GROUP)]
            for part in parts:
                total = _fold(total, part)
            return total

        total = lax.fori_loop(lax.div(c_lo, _MERGE_GROUP), lax.div(c_hi + _MERGE_GROUP - 1, _MERGE_GROUP), group,
                              _empty_part(g_p, d))
        if writes:
            total = _fold(total, load(jnp.int32(num_chunk_parts), jnp.bool_(True)))
        live = None
        if g_p > num_groups:
            live = jnp.broadcast_to((jnp.arange(g_p, dtype=jnp.int32) < num_groups)[:, None], (g_p, d))
        _store_out(o_ref, pl.ds(head * num_groups, g_p), total, live)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "static_scale", "static_window", "span",
                                             "few_rows", "out_dtype"))
def _decode(q, k_cache, v_cache, positions, scale, window, layer, write_pos, slots, *, config, interpret,
            static_scale, static_window, span, few_rows, out_dtype):
    """k_cache, v_cache [L, B_cache, S_max, K, D]; keys [0, span) of layer `layer` are attended.
    write_pos: None, or [B] int32 with q packed as [B, K * (G + 2), D] (see
    `attention_decode_triton`); then the result is (out, k_cache, v_cache). slots: None (row b
    reads cache row b), or [B] int32, the cache row of each query row."""
    b, h, d = q.shape
    s_max, kh = k_cache.shape[2], k_cache.shape[3]
    if write_pos is not None:
        h -= 2 * kh  # the packed rows: G queries, a key and a value per kv head
    g = h // kh
    s = span
    g_pad = _g_pad(g)
    plan = config.plan(b, kh, g, d, k_cache.dtype.itemsize, s, few_rows=few_rows)
    block_s, num_splits = plan.block_s, plan.num_splits
    num_tiles = -(-s // block_s)
    scale_arr, win_arr = _scalar_inputs(scale, window, static_scale, static_window)
    if num_splits > 1 and plan.by_share:
        # The tiles all rows hold up to their positions (XLA computes it once per step).
        work = jnp.sum(lax.div(jnp.clip(positions.astype(jnp.int32), 0, s - 1), block_s) + 1, keepdims=True)
    else:
        work = np.ones((1,), np.int32)

    chunk_tiles = config.min_split_tiles(block_s)
    writes = write_pos is not None
    kernel = functools.partial(
        _decode_kernel,
        writes=writes,
        by_slot=slots is not None,
        block_s=block_s,
        num_splits=num_splits,
        by_share=plan.by_share,
        target_rows=-(-config.target_programs // kh),
        chunk_tiles=chunk_tiles,
        num_keys=s,
        num_groups=g,
        g_pad=g_pad,
        has_window=static_window != 0,
        is_ragged=num_tiles * block_s > s_max,  # the last tile would cross the cache's end
        interpret=interpret,
    )
    num_layers = k_cache.shape[0]
    if slots is None:
        kv_spec = pl.BlockSpec((num_layers, None, s_max, None, d), lambda i, j, p: (0, i, 0, j, 0))
    else:  # every cache row of the kv head: the kernel picks the row's own (a block index cannot read slots)
        kv_spec = pl.BlockSpec((num_layers, k_cache.shape[1], s_max, None, d), lambda i, j, p: (0, 0, 0, j, 0))
    out_specs = [pl.BlockSpec((None, h, d), lambda i, j, p: (i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, d), out_dtype)]
    if num_splits > 1:  # then the partials and the counts, whole
        out_specs += [pl.BlockSpec() for _ in range(4)]
        out_shape += [*_partials(num_tiles, chunk_tiles, writes, b, kh, g, d), jax.ShapeDtypeStruct((b, kh), jnp.int32)]
    in_specs = [
        pl.BlockSpec((b,), lambda i, j, p: (0,)),
        pl.BlockSpec((1,), lambda i, j, p: (0,)),
        pl.BlockSpec((1,), lambda i, j, p: (0,)),
        pl.BlockSpec((1,), lambda i, j, p: (0,)),
        pl.BlockSpec((1,), lambda i, j, p: (0,)),
        pl.BlockSpec((None, q.shape[1], d), lambda i, j, p: (i, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    args = [positions.astype(jnp.int32), work.astype(jnp.int32), win_arr, scale_arr, layer, q, k_cache, v_cache]
    aliases = {}
    num_outs = len(out_shape)
    if writes:
        in_specs.append(pl.BlockSpec((b,), lambda i, j, p: (0,)))
        args.append(write_pos.astype(jnp.int32))
        out_specs += [kv_spec, kv_spec]
        out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        aliases.update({6: num_outs, 7: num_outs + 1})
    if slots is not None:
        in_specs.append(pl.BlockSpec((b,), lambda i, j, p: (0,)))
        args.append(slots.astype(jnp.int32))
    if num_splits > 1:  # the counts, 0 at each call
        in_specs.append(pl.BlockSpec())
        args.append(jnp.zeros((b, kh), jnp.int32))
        aliases[len(args) - 1] = num_outs - 1
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_TritonParams(num_warps=plan.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="attention_decode",
    )(*args)
    return (outs[0], *outs[num_outs:]) if writes else outs[0]


def _layer_arr(layer) -> jax.Array:
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))


def _span(span: int | None, s: int) -> int:
    if span is None:
        return s
    if not 1 <= span <= s:
        raise ValueError(f"span {span} outside the cache's [1, {s}]")
    return int(span)


def attention_decode_triton(
    q: jax.Array,  # [B, H, D]
    k_cache: jax.Array,  # [B, S, K, D], or [L, B, S, K, D] with `layer`
    v_cache: jax.Array,  # same shape as k_cache
    positions: jax.Array,  # [B] int32 >= 0: the query's position (its key is already in the cache)
    scale: float,
    window: jax.Array | int = 0,  # 0 = unlimited; may be traced (gemma3 alternates per layer)
    *,
    layer: jax.Array | int | None = None,  # the layer of a stacked cache (may be traced): read in place
    span: int | None = None,  # static: only cache positions [0, span) are attended (default S)
    few_rows: bool = False,  # static: plan for a lone busy row (`DecodeAttentionConfig.few_rows_limit`)
    # [B] int32: q is packed [B, K * (G + 2), D], per kv head its G queries then the row's new key
    # and value for that head, which the call writes into the caches at these positions (of
    # `layer`); a position outside [0, S) writes nothing
    write_pos: jax.Array | None = None,
    # [B] int32: the cache row (slot) each query row reads, and writes with `write_pos` (None: row
    # b's is b). Several rows may share a slot (the engine's speculative decode: a slot's next
    # token and its drafts at consecutive positions; their keys must be in the cache already)
    slots: jax.Array | None = None,
    config: DecodeAttentionConfig | None = None,  # None: DEFAULT_DECODE_CONFIG as it is at the call
    interpret: bool = False,
    # The output's dtype: f32 (the reference's), or the activations' (bf16) where the next op
    # takes them: one split writes it from the kernel, saving a conversion kernel per layer
    out_dtype: jnp.dtype = jnp.float32,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:  # [B, H, D] out_dtype (with write_pos: and the caches)
    """Same contract as `attention_decode_reference`. Positions must lie in [0, span); a
    position past it attends to the whole span, as the reference does. A row's output is
    bitwise the same whatever the other rows, the span and `few_rows` (its chunks are folded
    in key order whichever programs hold them).

    With `write_pos`, the call also does what `KVCache.write_decode` would before it: the new
    keys and values (rounded to the cache's dtype) land at write_pos, and each row attends its
    new key (where visible) as one more key after those of the cache, taken from q rather than
    read back (the cache's stale row there is masked). The caches come back updated in place
    (their buffers aliased; the forward pass donates them). That saves the step the scatter
    kernels of a separate write, and packing lets XLA make the queries, keys and values (RoPE
    included) in one kernel. The result equals writing first within f32 rounding (the new key's
    terms are added last), and a row's output still depends on nothing but the row."""
    want = 4 if layer is None else 5
    rows_ok = k_cache.shape[-4] == q.shape[0] if slots is None else slots.shape == (q.shape[0],)
    if q.ndim != 3 or k_cache.ndim != want or positions.shape != (q.shape[0],) or not rows_ok:
        raise ValueError(
            f"want q [B, H, D], caches {'[B, S, K, D]' if layer is None else '[L, B, S, K, D]'}, positions [B]"
            f"{', slots [B]' if slots is not None else ''}; got {q.shape}, {k_cache.shape}, {positions.shape}"
            f"{'' if slots is None else f', {slots.shape}'}"
        )
    if write_pos is not None:
        kh = k_cache.shape[-2]
        if write_pos.shape != (q.shape[0],) or q.shape[1] % kh or q.shape[1] // kh < 3:
            raise ValueError(f"write_pos [B] wants q packed as [B, K * (G + 2), D] with K = {kh}; got q {q.shape}, "
                             f"write_pos {write_pos.shape}")
        queries = jax.ShapeDtypeStruct((q.shape[0], q.shape[1] - 2 * kh, q.shape[2]), q.dtype)
        s, _, _ = _check_inputs(queries, k_cache, v_cache, seq_axis=k_cache.ndim - 3)
    else:
        s, _, _ = _check_inputs(q, k_cache, v_cache, seq_axis=k_cache.ndim - 3)
    stacked = layer is not None
    if not stacked:
        k_cache, v_cache = k_cache[None], v_cache[None]
    result = _decode(
        q, k_cache, v_cache, positions, scale, window, _layer_arr(layer), write_pos, slots,
        config=config or DEFAULT_DECODE_CONFIG, interpret=interpret, static_scale=_static_scale(scale),
        static_window=_static_window(window),
        span=_span(span, s), few_rows=few_rows, out_dtype=jnp.dtype(out_dtype),
    )
    if write_pos is None or stacked:
        return result
    out, k_cache, v_cache = result
    return out, k_cache[0], v_cache[0]


# The optional protocol of a decode attention implementation whose speed depends on how many
# rows are busy (model/kernels.py reads it): the most busy rows for which its `few_rows=True`
# call should run; 0: no such call. (DEFAULT_DECODE_CONFIG's, read at each call: bench/common.py
# may replace it.)
attention_decode_triton.few_rows_limit = lambda *a, **k: DEFAULT_DECODE_CONFIG.few_rows_limit(*a, **k)
# It takes the decode step's cache write (`write_pos=`, q packed): the forward pass hands it over.
attention_decode_triton.writes_cache = True
# It writes its output in the activations' dtype when asked (`out_dtype=`, model/kernels.py).
attention_decode_triton.takes_out_dtype = True
# It takes each row's cache row (`slots=`): the engine's speculative decode.
attention_decode_triton.takes_slots = True
# ... and writes every row's key and value first in one kernel (model/forward.py's speculative decode).
attention_decode_triton.write_rows = write_decode_rows_triton


def is_available() -> bool:
    return jax.default_backend() == "gpu"


# Above the reference (priority 0): chosen wherever a GPU is present.
registry.register("attention_decode", "triton", attention_decode_triton, is_available=is_available, priority=10)
