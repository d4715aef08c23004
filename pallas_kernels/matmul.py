"""Quantized matmul and embedding lookup: the plain-jnp references, registered as implementation
"reference" of ops "matmul" and "embed".

Inputs come from the model's forward pass: activations x [..., K] and a `QuantizedTensor`
weight [N, K] whose planes `pallas_kernels.quant.repack` built at load time. The reference is
the specification the GPU kernels are tested against, and the CPU path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.quant import (
    QuantizedTensor, dequantize_phase, dequantize_reference, layer_of, layout, slice_rows, take_rows_reference,
)


@dataclasses.dataclass(frozen=True)
class ReferenceMatmulConfig:
    # The weight is dequantized in tiles of rows of at most this many f32 bytes, one tile at a
    # time inside a scan. Dequantizing a large matrix whole (e.g. a 49152x576 output head, 113 MB
    # of f32) takes several times as long on CPU (fresh pages, no cache reuse): 36 ms against
    # 13 ms with 2 MiB tiles for x [8, 576] (2 Xeon cores, jax 0.11.2).
    tile_bytes: int = 2 << 20

    def __post_init__(self) -> None:
        if self.tile_bytes <= 0:
            raise ValueError(f"tile_bytes must be > 0, got {self.tile_bytes}")


DEFAULT_CONFIG = ReferenceMatmulConfig()


def _dense_matmul(x: jax.Array, w: QuantizedTensor) -> jax.Array:
    """x [..., K] f32 @ dequant(w [N, K]).T -> [..., N] f32."""
    num_phases, num_groups, width = layout(w.fmt, w.shape[1])
    if num_phases > 1 and width < 32:
        # 32-blocks with nibbles 16 apart: contract each phase of the weight with the matching
        # slice of x rather than interleave the weight (2x faster on CPU, see quant.layout).
        x_groups = jnp.reshape(x, (*x.shape[:-1], num_groups, num_phases, width))
        x_phases = [jnp.reshape(x_groups[..., ph, :], (*x.shape[:-1], -1)) for ph in range(num_phases)]
        w_phases = [jnp.reshape(dequantize_phase(w, ph), (w.shape[0], -1)) for ph in range(num_phases)]
    else:
        x_phases, w_phases = [x], [dequantize_reference(w)]
    y = None
    for x_ph, w_ph in zip(x_phases, w_phases):  # [..., K/P] @ [N, K/P].T
        y_ph = jax.lax.dot_general(
            x_ph, w_ph, (((x_ph.ndim - 1,), (1,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )
        y = y_ph if y is None else y + y_ph
    return y


def qmatmul_reference(
    x: jax.Array,  # [..., K] any float dtype
    w: QuantizedTensor,  # [N, K], or a stack [L, N, K] with `layer`
    config: ReferenceMatmulConfig = DEFAULT_CONFIG,
    *,
    layer: jax.Array | int | None = None,  # which matrix of a stacked w (may be traced)
) -> jax.Array:  # [..., N] f32
    """x @ dequant(w).T in f32 (HIGHEST precision)."""
    w = layer_of(w, layer)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {list(x.shape)} does not match weight [{n}, {k}]")
    x = x.astype(jnp.float32)
    tile = max(1, config.tile_bytes // (4 * k))
    # Tiling pays on the CPU (cache reuse); on a GPU it only adds a loop of small launches.
    if n <= tile or jax.default_backend() != "cpu":
        return _dense_matmul(x, w)

    num_tiles, n_full = n // tile, n // tile * tile
    tiled = {}
    for name, p in slice_rows(w, 0, n_full).planes.items():  # [N, X] or [X, N] -> [tiles, ...]
        axis = p.ndim + w.format.n_axis(name)
        tiled[name] = jnp.moveaxis(jnp.reshape(p, (*p.shape[:axis], num_tiles, tile, *p.shape[axis + 1:])), axis, 0)

    def one_tile(_, planes):
        return None, _dense_matmul(x, QuantizedTensor(planes, w.fmt, (tile, k)))  # [..., tile]

    _, y = jax.lax.scan(one_tile, None, tiled)  # [num_tiles, ..., tile]
    y = jnp.reshape(jnp.moveaxis(y, 0, -2), (*y.shape[1:-1], n_full))
    if n_full < n:
        y = jnp.concatenate([y, _dense_matmul(x, slice_rows(w, n_full, n))], axis=-1)
    return y


def embed_reference(
    w: QuantizedTensor,  # [V, E]
    ids: jax.Array,  # [T] int32
) -> jax.Array:  # [T, E] f32
    """Rows `ids` of the embedding table, dequantized (only those rows are read)."""
    return take_rows_reference(w, ids)


registry.register("matmul", "reference", qmatmul_reference)
registry.register("embed", "reference", embed_reference)
