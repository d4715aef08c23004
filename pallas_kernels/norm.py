"""Op "add_norm": a decode layer's residual add of a matmul's K-split partial sums followed by the
next RMS norm, in one kernel, its output already in the column order the next matmul reads.

    x_new = x + sum_p parts[p]                     (f32, the residual stream)
    h     = x_new * rsqrt(mean(x_new^2) + eps) * w (the next matmul's input, in `order`)

w may be the [L, E] stack of every layer's norm weights with `layer` (read in place).

Between the Mosaic GPU matmuls of a decode step, XLA runs the split-K sum with the residual add
and the norm as two kernels (a reduction over the splits feeding one over the row does not fuse),
1.6 and 1.8 us on the H200 for a few KiB of work; this kernel takes both, but is slower: 4.2-4.4
us per call in the engine's decode step (bench/results, tenth session), so it is a variant to
force (`--kernels add_norm=triton`), not the default. `order` is the column order
the consuming matmul kernel wants its x in (`input_order` of the chosen matmul): "natural", or
"words" for the Mosaic q4_0 kernel's word unpacking (`matmul_mgpu.permute_x_words`), which the
kernel then no longer applies itself.

Implementations: "reference" (plain jnp, the specification and the CPU path) and "triton"
(Pallas through Triton, GPU; `interpret=True` runs it on CPU). The Triton kernel runs one
program per row of x, its loads and stores contiguous (E a power of two: Triton's block dims);
the words order is a swap of the last two axes of the row seen as [E/32, 16, 2], in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import registry
from pallas_kernels.matmul_mgpu import permute_x_words

NATURAL, WORDS = "natural", "words"
ORDERS = (NATURAL, WORDS)

_TritonParams = plt.CompilerParams if hasattr(plt, "CompilerParams") else plt.TritonCompilerParams


def to_order(x: jax.Array, order: str) -> jax.Array:
    """x [M, E] in `order` (see the module docstring)."""
    if order == NATURAL:
        return x
    if order == WORDS:
        return permute_x_words(x)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _check(x: jax.Array, parts: jax.Array, w: jax.Array, order: str, layer) -> None:
    w_ok = w.shape == x.shape[-1:] if layer is None else (w.ndim == 2 and w.shape[1:] == x.shape[-1:])
    if x.ndim != 2 or parts.ndim != 3 or parts.shape[1:] != x.shape or not w_ok:
        raise ValueError(f"want x [M, E], parts [P, M, E], w [E] (or [L, E] with a layer); got {x.shape}, "
                         f"{parts.shape}, {w.shape}, layer {layer}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == WORDS and x.shape[-1] % 32:
        raise ValueError(f"the words order needs E a multiple of 32, got {x.shape[-1]}")


def add_norm_reference(
    x: jax.Array,  # [M, E] f32: the residual stream
    parts: jax.Array,  # [P, M, E] f32: a matmul's K-split partial sums (P = 1: its result)
    w: jax.Array,  # [E]: the norm's weight
    eps: float,
    order: str = NATURAL,
    out_dtype=jnp.bfloat16,
    *,
    layer: jax.Array | int | None = None,  # w [L, E]: the norm weights of every layer, this one's row read
) -> tuple[jax.Array, jax.Array]:  # (x_new [M, E] f32, h [M, E] out_dtype in `order`)
    _check(x, parts, w, order, layer)
    if layer is not None:
        w = lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    x_new = x.astype(jnp.float32) + jnp.sum(parts.astype(jnp.float32), axis=0)
    h = x_new * lax.rsqrt(jnp.mean(x_new * x_new, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
    return x_new, to_order(h, order).astype(out_dtype)


def _kernel(layer_ref, x_ref, parts_ref, w_ref, xo_ref, h_ref, *, num_parts: int, eps: float, words: bool):
    """One row, contiguous: x_ref, xo_ref, h_ref [E]; parts_ref [P, E]; w_ref [L, E], row
    layer_ref[0] read (a stack's row passed as its own operand would be a copy per call). The
    words order is a swap of the last two axes of the row seen as [E/32, 16, 2] (registers)."""
    s = parts_ref[0, :]
    for p in range(1, num_parts):
        s = s + parts_ref[p, :]
    r = x_ref[:] + s
    xo_ref[:] = r
    size = r.shape[0]
    inv = lax.rsqrt(jnp.sum(r * r) / size + eps)
    h = r * inv * w_ref[layer_ref[0], :].astype(jnp.float32)
    if words:
        h = jnp.reshape(jnp.swapaxes(jnp.reshape(h, (size // 32, 16, 2)), 1, 2), (size,))
    h_ref[:] = h.astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "order", "out_dtype", "num_warps", "interpret"))
def _add_norm_triton(x, parts, w, layer, *, eps, order, out_dtype, num_warps, interpret):
    m, e = x.shape
    p, num_layers = parts.shape[0], w.shape[0]
    row = pl.BlockSpec((None, e), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, num_parts=p, eps=eps, words=order == WORDS),
        grid=(m,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), row, pl.BlockSpec((p, None, e), lambda i: (0, i, 0)),
                  pl.BlockSpec((num_layers, e), lambda i: (0, 0))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((m, e), jnp.float32), jax.ShapeDtypeStruct((m, e), out_dtype)],
        compiler_params=_TritonParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_norm",
    )(layer, x.astype(jnp.float32), parts.astype(jnp.float32), w)


def add_norm_triton(
    x: jax.Array,
    parts: jax.Array,
    w: jax.Array,
    eps: float,
    order: str = NATURAL,
    out_dtype=jnp.bfloat16,
    *,
    layer: jax.Array | int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as `add_norm_reference`. Refuses (NotImplementedError) a row E that is not a
    power of two of at least 32 (Triton block dims: 4096 for Llama 2 and 3 and Mistral; Qwen2.5-7B's
    3584 is not)."""
    _check(x, parts, w, order, layer)
    e = x.shape[-1]
    if e < 32 or e & (e - 1):
        raise NotImplementedError(f"add_norm triton: E={e} is not a power of two >= 32")
    stack = w if layer is not None else w[None]
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return _add_norm_triton(x, parts, stack, layer_arr, eps=float(eps), order=order, out_dtype=jnp.dtype(out_dtype),
                            num_warps=num_warps, interpret=interpret)


def _gpu() -> bool:
    return jax.default_backend() == "gpu"


# The Triton kernel ranks below the reference, so the fusion is off unless forced
# (`--kernels add_norm=triton`): on the H200 it took 4.2-4.4 us per call in the engine's decode
# step where XLA's two kernels took 3.4 (bench/results, tenth session), its one program per row
# bound by latency.
registry.register("add_norm", "reference", add_norm_reference)
registry.register("add_norm", "triton", add_norm_triton, is_available=_gpu, priority=-10)
