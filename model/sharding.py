"""Tensor parallelism: where each array of the engine lives on a one-axis device mesh ("tp").

Megatron-style layout, applied by `model/loader.py` (params) and `model/runner.py` (KV cache,
slot state) with `jax.device_put` when `EngineConfig.tensor_parallel` > 1. The step programs
stay the single-device code: `jax.jit` runs them SPMD and XLA's partitioner inserts the
collectives (one all-reduce after each row-parallel matmul, and the embedding lookup's); the
vocab-sharded logits are gathered once, inside the output head's shard_map, so that sampling
runs whole on every device.

- column-parallel wq/wk/wv, w_gate/w_up: rows N (output features: heads, ffn) are sharded, so
  each device holds whole heads; their biases shard with N.
- row-parallel wo, w_down: the input features K are sharded. A QuantizedTensor plane is
  [*L, N, X] with X a per-row packing of K (or [*L, X, N] for a transposed plane, see
  pallas_kernels/quant.py), so X is sharded; that cuts rows into whole blocks only when K / tp
  is a multiple of the format's block size (checked).
- vocab-parallel embedding and output head: rows N = vocab are sharded.
- norms and rope factors, slot state and sampling arrays: replicated.
- KV cache [L, B, S, K, D]: sharded over its kv-head axis K, beside the heads that read it.

Query head h reads kv head h // (H / K), so contiguous shards of H and of K line up.

A Pallas (Triton / Mosaic GPU) kernel is an opaque custom call to XLA's partitioner, which
would gather its operands onto every device. So `shard_kernels` wraps the matmul and attention
ops in `jax.shard_map` over the "tp" axis: each device runs the chosen kernel on its own shard
(N/tp rows of a column-parallel matrix, K/tp of a row-parallel one followed by an explicit
`psum`, H/tp query heads against its K/tp kv heads of the cache), whatever the implementation
(the references too, so the CPU tests run the same wrapping). The forward pass says how each
matrix splits (`split`); everything between the ops (norms, rope, residuals, sampling) stays
ordinary SPMD code that XLA partitions. The embedding lookup is the XLA reference.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.forward import Kernels, KVCache
from model.weights import LayerGroup, Params, numbered
from pallas_kernels.quant import QuantizedTensor

log = logging.getLogger(__name__)

TP_AXIS = "tp"

# layer dict key -> how it shards (see the module docstring)
_COLUMN = frozenset({"wq", "wk", "wv", "w_gate", "w_up"})
ROW_SPLIT = frozenset({"wo", "w_down"})  # public: model/kernels.py probes these on their K split
_COLUMN_BIAS = frozenset({"bq", "bk", "bv"})
_REPLICATED = frozenset({"attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"})


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first `tp` devices (all hosts' devices after
    `jax.distributed.initialize`)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1:
        raise ValueError(f"tensor parallel degree must be >= 1, got {tp}")
    if tp > len(devices):
        raise ValueError(f"tensor parallel {tp} needs {tp} devices; {len(devices)} visible ({devices[0].platform})")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError unless every sharded model dimension divides by `tp`."""
    for what, size in (
        ("attention heads", cfg.num_heads),
        ("kv heads", cfg.num_kv_heads),
        ("ffn size", cfg.ffn_dim),
        ("vocabulary size", cfg.vocab_size),
    ):
        if size % tp:
            raise ValueError(f"tensor parallel {tp} does not divide the model's {what} ({size})")


def _split_planes(w: QuantizedTensor, split: str) -> QuantizedTensor:
    """The PartitionSpec of each plane: a column split shards each plane's N axis, a row split its
    X axis (which divides with K); a transposed plane holds them the other way round."""
    fmt = w.format
    lead = (None,) * len(w.stack_shape)

    def spec(name: str) -> P:
        axis = fmt.n_axis(name) if split == "column" else fmt.x_axis(name)
        return P(*lead, *((TP_AXIS, None) if axis == -2 else (None, TP_AXIS)))

    return QuantizedTensor({name: spec(name) for name in w.planes}, w.fmt, w.shape)


def _column_spec(name: str, w: QuantizedTensor, tp: int) -> QuantizedTensor:
    n = w.shape[0]
    if n % tp:
        raise ValueError(f"{name}: {n} output rows do not split over tensor parallel {tp}")
    return _split_planes(w, "column")


def _row_spec(name: str, w: QuantizedTensor, tp: int) -> QuantizedTensor:
    k, block = w.shape[1], w.format.block_size
    if k % tp or (k // tp) % block:
        raise ValueError(
            f"{name} ({w.fmt}): row length K={k} split over tensor parallel {tp} gives {k / tp:g} per device, "
            f"not a multiple of the {block}-element block"
        )
    return _split_planes(w, "row")


def _layer_specs(lp: Mapping[str, Any], tp: int, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, leaf in lp.items():
        name = f"{where}.{key}"
        if key in _COLUMN:
            out[key] = _column_spec(name, leaf, tp)
        elif key in ROW_SPLIT:
            out[key] = _row_spec(name, leaf, tp)
        elif key in _COLUMN_BIAS:  # [*L, N]
            if leaf.shape[-1] % tp:
                raise ValueError(f"{name}: {leaf.shape[-1]} entries do not split over tensor parallel {tp}")
            out[key] = P(*(None,) * (leaf.ndim - 1), TP_AXIS)
        elif key in _REPLICATED:
            out[key] = P()
        else:
            raise ValueError(f"{name}: no tensor-parallel rule for this layer tensor")
    return out


def tensor_spec(where: str, key: str, value: Any, tp: int) -> Any:
    """The PartitionSpec pytree of one Params entry (`model.weights.Place`'s arguments: a layer
    dict key, or "embed", "output", "output_norm", "rope_freqs"). Raises ValueError for a
    matrix that does not split."""
    if key in ("embed", "output"):  # vocab-parallel
        return _column_spec(where, value, tp)
    if key in ("output_norm", "rope_freqs"):
        return P()
    return _layer_specs({key: value}, tp, where)[key]


def param_specs(params: Params, tp: int) -> Params:
    """A Params-shaped pytree of PartitionSpec over the "tp" axis, one per leaf (leaves may be
    numpy or jax arrays: only shapes are read). Raises ValueError for a matrix that does not split."""
    if params.is_stacked:
        layers: Any = _layer_specs(params.layers, tp, "blk.*")
    else:
        layers = []
        for i, lp in numbered(params.layers):
            if isinstance(lp, LayerGroup):
                layers.append(LayerGroup([_layer_specs(ph, tp, f"blk.{i + j}+{lp.period}x{lp.repeats}")
                                          for j, ph in enumerate(lp.phases)], i, lp.repeats))
            else:
                layers.append(_layer_specs(lp, tp, f"blk.{i}"))
    return Params(
        embed=tensor_spec("token_embd", "embed", params.embed, tp),
        output=None if params.output is None else tensor_spec("output", "output", params.output, tp),
        output_norm=tensor_spec("output_norm", "output_norm", params.output_norm, tp),
        rope_freqs=None if params.rope_freqs is None else tensor_spec("rope_freqs", "rope_freqs", params.rope_freqs, tp),
        layers=layers,
        is_stacked=params.is_stacked,
    )


def placer(mesh: Mesh) -> Callable[[str, str, Any], Any]:
    """A `model.weights.Place` that puts each tensor on the mesh by the rules above as it is
    loaded: `jax.device_put` of the host array with its NamedSharding sends every device only
    its shards, so no device (and no host buffer beyond one tensor's) ever holds the model."""
    tp = mesh.shape[TP_AXIS]

    def place(where: str, key: str, value: Any) -> Any:
        spec = tensor_spec(where, key, value, tp)
        return jax.device_put(value, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec))

    return place


CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # k and v [L, B, S, K, D]: split over the kv heads K


def cache_shardings(mesh: Mesh) -> KVCache:
    """KVCache-shaped shardings of k and v."""
    kv = NamedSharding(mesh, CACHE_SPEC)
    return KVCache(k=kv, v=kv)


def create_cache(cfg: ModelConfig, num_slots: int, max_context: int, dtype: Any, mesh: Mesh) -> KVCache:
    """A zeroed KV cache made in place on the mesh: no device ever holds the whole of it."""
    make = jax.jit(lambda: KVCache.create(cfg, num_slots, max_context, dtype), out_shardings=cache_shardings(mesh))
    return make()


def step_out_shardings(mesh: Mesh) -> tuple[KVCache, NamedSharding, NamedSharding]:
    """out_shardings of a runner step (cache, slot state, outputs): the layout the inputs came
    in, so the donated cache is updated in place and the next call matches the compiled one."""
    return cache_shardings(mesh), replicated(mesh), replicated(mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _local(w: QuantizedTensor, split: str, tp: int) -> QuantizedTensor:
    """The matrix a device holds inside shard_map: planes are already the local shards, the
    static (N, K) is fixed up to match them."""
    n, k = w.shape
    shape = (n // tp, k) if split == "column" else (n, k // tp)
    return QuantizedTensor(w.planes, w.fmt, shape)


def shard_kernels(kern: Kernels, mesh: Mesh) -> Kernels:
    """`kern` with matmul and attention run per device under `jax.shard_map` (module docstring)."""
    tp = mesh.shape[TP_AXIS]

    def smap(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def scalars(*values):
        """Traced scalars travel as replicated shard_map operands; static ones (a window of 0,
        which lets the kernels drop their window masks) are closed over. Returns (args, specs,
        rebuild: operands -> values)."""
        traced = [i for i, v in enumerate(values) if v is not None and not isinstance(v, (int, float))]

        def rebuild(ops):
            out = list(values)
            for i, op in zip(traced, ops):
                out[i] = op
            return out

        return [jnp.asarray(values[i], jnp.int32) for i in traced], [P()] * len(traced), rebuild

    def matmul(x, w: QuantizedTensor, layer=None, split: str | None = None, elementwise_x: bool = False):
        if split not in ("column", "row", "vocab"):
            raise ValueError(f"a tensor-parallel matmul needs split='column', 'row' or 'vocab', got {split!r}")
        w_spec = (_row_spec if split == "row" else _column_spec)("matmul", w, tp)
        args, specs, rebuild = scalars(layer)
        local_split = "row" if split == "row" else "column"

        def local(x, w, *ops):
            (layer_,) = rebuild(ops)
            y = kern.matmul(x, _local(w, local_split, tp), layer_, local_split, elementwise_x)
            if split == "row":  # partial sums over K
                return jax.lax.psum(y, TP_AXIS)
            if split == "vocab":  # the whole logits on every device: one gather
                return jax.lax.all_gather(y, TP_AXIS, axis=y.ndim - 1, tiled=True)
            return y

        in_x = P(None, TP_AXIS) if split == "row" else P()
        out = P(None, TP_AXIS) if split == "column" else P()
        return smap(local, (in_x, w_spec, *specs), out)(x, w, *args)

    heads = P(None, TP_AXIS, None)  # q [B or T, H, D] and outputs: query heads split

    def attention_decode(q, k_cache, v_cache, positions, scale, window=0, *, layer=None, span=None,
                         write_pos=None, **plan):
        cache = CACHE_SPEC if k_cache.ndim == 5 else P(None, None, TP_AXIS, None)
        args, specs, rebuild = scalars(window, layer)
        if write_pos is None:
            def local(q, k, v, pos, *ops):
                window_, layer_ = rebuild(ops)
                return kern.attention_decode(q, k, v, pos, scale, window_, layer=layer_, span=span, **plan)

            return smap(local, (heads, cache, cache, P(), *specs), heads)(q, k_cache, v_cache, positions, *args)

        # q packed per kv head (pack_decode_write): split like the heads; each device writes its
        # own kv heads' new keys and values into its shard of the caches
        def local_write(q, k, v, pos, wpos, *ops):
            window_, layer_ = rebuild(ops)
            return kern.attention_decode(q, k, v, pos, scale, window_, layer=layer_, span=span, write_pos=wpos,
                                         **plan)

        return smap(local_write, (heads, cache, cache, P(), P(), *specs), (heads, cache, cache))(
            q, k_cache, v_cache, positions, write_pos, *args)

    def attention_prefill(q, k_cache, v_cache, start_pos, scale, window=0, *, layer=None, slot=None, span=None):
        cache = CACHE_SPEC if k_cache.ndim == 5 else P(None, TP_AXIS, None)
        args, specs, rebuild = scalars(start_pos, window, layer, slot)

        def local(q, k, v, *ops):
            start_, window_, layer_, slot_ = rebuild(ops)
            return kern.attention_prefill(q, k, v, start_, scale, window_, layer=layer_, slot=slot_, span=span)

        return smap(local, (heads, cache, cache, *specs), heads)(q, k_cache, v_cache, *args)

    return Kernels(matmul=matmul, embed=kern.embed, attention_decode=attention_decode,
                   attention_prefill=attention_prefill, decode_few_rows_limit=kern.decode_few_rows_limit,
                   decode_writes_cache=kern.decode_writes_cache)
