"""The decode step's new keys and values written into the cache as one Pallas kernel lowered
through Triton (GPU; `interpret=True` runs it on CPU): `write_decode_rows_triton`, which the
decode attention implementation "triton" offers as its `write_rows` (`attention_triton.py`),
for the engine's speculative decode (`model/forward.py`), whose rows must all be in the cache
before any row's attention reads them.

Dimension letters as in `attention_triton.py`: B rows, L layers, S cache positions, K kv heads,
G = H / K, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# As in attention_triton.py: the compiler params' and masked store's names differ across jax.
_TritonParams = plt.CompilerParams if hasattr(plt, "CompilerParams") else plt.TritonCompilerParams
_store = plt.store if hasattr(plt, "store") else pl.store


def _write_rows_kernel(layer_ref, slots_ref, wpos_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref,
                       v_out_ref, *, s_max: int):
    """One (row, kv head): the row's new key and value [1, D] into its slot's cache row at its
    write position, of the layer (nowhere for a position outside [0, S))."""
    del k_in_ref, v_in_ref  # the caches, aliased to the outputs
    row = pl.program_id(0)
    wpos = wpos_ref[row]
    d = k_new_ref.shape[-1]
    mask = jnp.broadcast_to((wpos >= 0) & (wpos < s_max), (1, d))
    at = (layer_ref[0], slots_ref[row], pl.ds(lax.clamp(0, wpos, s_max - 1), 1), slice(None))
    _store(k_out_ref.at[at], k_new_ref[...].astype(k_out_ref.dtype), mask=mask)
    _store(v_out_ref.at[at], v_new_ref[...].astype(v_out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_rows(packed, k_cache, v_cache, write_pos, slots, layer, *, interpret):
    b, _, d = packed.shape
    num_layers, b_cache, s_max, kh, _ = k_cache.shape
    g = packed.shape[1] // kh - 2
    kv_spec = pl.BlockSpec((num_layers, b_cache, s_max, None, d), lambda i, j: (0, 0, 0, j, 0))
    return pl.pallas_call(
        functools.partial(_write_rows_kernel, s_max=s_max),
        grid=(b, kh),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((b,), lambda i, j: (0,)),
            pl.BlockSpec((b,), lambda i, j: (0,)),
            pl.BlockSpec((None, 1, d), lambda i, j: (i, j * (g + 2) + g, 0)),  # the row's key for kv head j
            pl.BlockSpec((None, 1, d), lambda i, j: (i, j * (g + 2) + g + 1, 0)),  # and its value
            kv_spec,
            kv_spec,
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=_TritonParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_decode_rows",
    )(layer, slots.astype(jnp.int32), write_pos.astype(jnp.int32), packed, packed, k_cache, v_cache)


def write_decode_rows_triton(
    packed: jax.Array,  # [B, K * (G + 2), D]: `pack_decode_write(q, k, v)`, as the write_pos call takes it
    k_cache: jax.Array,  # [L, B_cache, S, K, D]
    v_cache: jax.Array,
    write_pos: jax.Array,  # [B] int32; outside [0, S): nothing written
    slots: jax.Array,  # [B] int32: each row's cache row (rows may share one, at distinct positions)
    *,
    layer: jax.Array | int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """What `KVCache.write_decode(layer, slots, write_pos, k, v, distinct=False)` does with the
    packed keys and values (rounded to the cache's dtype), as one kernel for both caches (their
    buffers aliased; the forward pass donates them) where XLA makes two scatters: the
    speculative decode writes every row's key before its attention call reads them, one launch
    fewer per layer (the two scatters took 182 us of a 2.4 ms Llama-2-7B step on the H200)."""
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or packed.ndim != 3:
        raise ValueError(f"want packed [B, K * (G + 2), D] and caches [L, B, S, K, D]; got {packed.shape}, "
                         f"{k_cache.shape}, {v_cache.shape}")
    b, rows, d = packed.shape
    kh = k_cache.shape[3]
    if rows % kh or rows // kh < 3 or d != k_cache.shape[4] or write_pos.shape != (b,) or slots.shape != (b,):
        raise ValueError(f"want packed [B, K * (G + 2), D] with K = {kh}, D = {k_cache.shape[4]} and write_pos, "
                         f"slots [B]; got {packed.shape}, {write_pos.shape}, {slots.shape}")
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return _write_rows(packed, k_cache, v_cache, write_pos, slots, layer_arr, interpret=interpret)
