"""Tensor parallelism: where each array of the engine lives on a one-axis device mesh ("tp").

Megatron-style layout, applied by `model/loader.py` (params) and `model/runner.py` (KV cache,
slot state) with `jax.device_put` when `EngineConfig.tensor_parallel` > 1. The step programs
stay the single-device code: `jax.jit` runs them SPMD and XLA's partitioner inserts the
collectives (one all-reduce after each row-parallel matmul, gathers of the vocab-sharded
logits for sampling).

- column-parallel wq/wk/wv, w_gate/w_up: rows N (output features: heads, ffn) are sharded, so
  each device holds whole heads; their biases shard with N.
- row-parallel wo, w_down: the input features K are sharded. A QuantizedTensor plane is
  [*L, N, X] with X a per-row packing of K, so X is sharded; that cuts rows into whole blocks
  only when K / tp is a multiple of the format's block size (checked).
- vocab-parallel embedding and output head: rows N = vocab are sharded.
- norms and rope factors, slot state and sampling arrays: replicated.
- KV cache [L, B, S, K, D]: sharded over its kv-head axis K, beside the heads that read it.

Query head h reads kv head h // (H / K), so contiguous shards of H and of K line up.

The ops that run sharded are the plain-jnp references, which XLA partitions itself. A Pallas
(Triton / Mosaic GPU) kernel is an opaque custom call to the partitioner: it would gather its
operands onto every device. GPU kernels under tensor parallelism need each op wrapped in
`jax.shard_map` over the "tp" axis (per-shard shapes: H/tp heads, N/tp or K/tp of each matrix,
an explicit `psum` after row-parallel matmuls); until then `forced_kernels` pins the references.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.forward import KVCache
from model.weights import Params
from pallas_kernels.quant import QuantizedTensor

log = logging.getLogger(__name__)

TP_AXIS = "tp"

# layer dict key -> how it shards (see the module docstring)
_COLUMN = frozenset({"wq", "wk", "wv", "w_gate", "w_up"})
_ROW = frozenset({"wo", "w_down"})
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


def _column_spec(name: str, w: QuantizedTensor, tp: int) -> P:
    n = w.shape[0]
    if n % tp:
        raise ValueError(f"{name}: {n} output rows do not split over tensor parallel {tp}")
    return P(*(None,) * len(w.stack_shape), TP_AXIS, None)


def _row_spec(name: str, w: QuantizedTensor, tp: int) -> P:
    k, block = w.shape[1], w.format.block_size
    if k % tp or (k // tp) % block:
        raise ValueError(
            f"{name} ({w.fmt}): row length K={k} split over tensor parallel {tp} gives {k / tp:g} per device, "
            f"not a multiple of the {block}-element block"
        )
    return P(*(None,) * len(w.stack_shape), None, TP_AXIS)


def _planes(w: QuantizedTensor, spec: P) -> QuantizedTensor:
    return jax.tree_util.tree_map(lambda _: spec, w)


def _layer_specs(lp: Mapping[str, Any], tp: int, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, leaf in lp.items():
        name = f"{where}.{key}"
        if key in _COLUMN:
            out[key] = _planes(leaf, _column_spec(name, leaf, tp))
        elif key in _ROW:
            out[key] = _planes(leaf, _row_spec(name, leaf, tp))
        elif key in _COLUMN_BIAS:  # [*L, N]
            if leaf.shape[-1] % tp:
                raise ValueError(f"{name}: {leaf.shape[-1]} entries do not split over tensor parallel {tp}")
            out[key] = P(*(None,) * (leaf.ndim - 1), TP_AXIS)
        elif key in _REPLICATED:
            out[key] = P()
        else:
            raise ValueError(f"{name}: no tensor-parallel rule for this layer tensor")
    return out


def param_specs(params: Params, tp: int) -> Params:
    """A Params-shaped pytree of PartitionSpec over the "tp" axis, one per leaf (leaves may be
    numpy or jax arrays: only shapes are read). Raises ValueError for a matrix that does not split."""
    if params.is_stacked:
        layers: Any = _layer_specs(params.layers, tp, "blk.*")
    else:
        layers = [_layer_specs(lp, tp, f"blk.{i}") for i, lp in enumerate(params.layers)]
    return Params(
        embed=_planes(params.embed, _column_spec("token_embd", params.embed, tp)),
        output=None if params.output is None else _planes(params.output, _column_spec("output", params.output, tp)),
        output_norm=P(),
        rope_freqs=None if params.rope_freqs is None else P(),
        layers=layers,
        is_stacked=params.is_stacked,
    )


def param_shardings(params: Params, mesh: Mesh) -> Params:
    """`param_specs` bound to the mesh: a Params-shaped pytree of NamedSharding."""
    specs = param_specs(params, mesh.shape[TP_AXIS])
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def shard_params(params: Params, mesh: Mesh, cfg: ModelConfig) -> Params:
    """Params placed on the mesh; raises ValueError for a model that does not split."""
    check_divisible(cfg, mesh.shape[TP_AXIS])
    return jax.device_put(params, param_shardings(params, mesh))


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


def forced_kernels(forced: Mapping[str, str], ops: Sequence[str]) -> dict[str, str]:
    """The kernel choice under tensor parallelism: the XLA-partitioned references for every op.

    A GPU kernel would need a shard_map wrapper (see the module docstring), so forcing one with
    tp > 1 is an error rather than a kernel that silently gathers whole weights.
    """
    others = {op: impl for op, impl in forced.items() if impl != "reference"}
    if others:
        raise ValueError(
            f"tensor parallel runs the reference ops only (kernels are not yet sharded with shard_map); "
            f"forced: {others}"
        )
    log.info("tensor parallel: every op runs its reference implementation, partitioned by XLA")
    return {**{op: "reference" for op in ops}, **forced}  # unknown forced ops still reach choose_kernels' check
