"""Value rows permuted at load into the order the output projection reads its x in.

A matmul kernel may read x in a column order of its own (the Mosaic GPU kernel's Q4_0 codes
unpack each 32-block's even weights, then its odd ones: `pallas_kernels.matmul_mgpu.x_order`),
and then permutes x itself on every call: in the decode step an XLA kernel per layer between the
attention and the output projection, which also turns the attention's output into bf16 (about 2
us a layer on the H200). Attention's output for head h, dimension j is a weighted sum of the
values' dimension j of h's kv head, so permuting the value rows of each kv head (the rows of
`wv`, or of the value part of the fused `wqkv`, and its bias) permutes the attention's output the
same way, for every query head of that kv head. Where the permutation the output projection wants
is one order of the head's dimensions repeated for every head, the values are stored in it at load
(`order_values`), the attention writes its output in that order and in the activations' dtype, and
the output projection takes that x as it is (`x_in_order`): no kernel between them.

Nothing else reads the values: the cache holds them permuted, and every reader (decode and
prefill attention) gives its output in the same order. The numbers are those of the plain path
(each output dimension is the same sum), so tokens do not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.config import ModelConfig
from model.weights import Params, map_layers, permute_plane, permute_rows
from pallas_kernels.quant import QuantizedTensor


def head_order(order: np.ndarray | None, num_heads: int, head_dim: int) -> np.ndarray | None:
    """The order [head_dim] of one head's dimensions when `order` (of all heads' [H * D]
    columns) is that order repeated in every head; None when it is not, or is no permutation."""
    if order is None or order.shape != (num_heads * head_dim,):
        return None
    per_head = np.reshape(order, (num_heads, head_dim)) - np.arange(num_heads)[:, None] * head_dim
    first = per_head[0]
    if not (per_head == first).all() or not np.array_equal(np.sort(first), np.arange(head_dim)):
        return None
    if np.array_equal(first, np.arange(head_dim)):
        return None
    return first


def value_order(cfg: ModelConfig, kern: Any, wo: QuantizedTensor) -> np.ndarray | None:
    """The order of a head's dimensions the output projection `wo` reads its x in
    (`Kernels.x_order`), where values can be stored in it; None: x as it is."""
    return head_order(kern.x_order(wo), cfg.num_heads, cfg.head_dim)


def wo_key(wo: QuantizedTensor) -> tuple[str, int, int]:
    """What `Kernels.ordered_values` holds of an output projection whose values were ordered."""
    return (wo.fmt, *wo.shape)


def labels(ordered: frozenset) -> list[str]:
    """`Kernels.ordered_values` as the load's log and /health name them: "q4_0 4096x4096"."""
    return [f"{f} {n}x{k}" for f, n, k in sorted(ordered)]


def _ordered(cfg: ModelConfig, kern: Any, lp: dict[str, Any], done: set) -> dict[str, Any]:
    order = value_order(cfg, kern, lp["wo"])
    if order is None:
        return lp
    done.add(wo_key(lp["wo"]))
    d, kv_dim = cfg.head_dim, cfg.kv_dim
    index = (np.arange(cfg.num_kv_heads)[:, None] * d + order[None, :]).reshape(-1).astype(np.int32)
    lp = dict(lp)
    if "wv" in lp:
        lp["wv"] = permute_rows(lp["wv"], 0, index)
    elif "wqkv" in lp:
        lp["wqkv"] = permute_rows(lp["wqkv"], cfg.q_dim + kv_dim, index)
    else:
        raise ValueError(f"a layer without value rows: {sorted(lp)}")
    if "bv" in lp:
        lp["bv"] = permute_plane(lp["bv"], index, lp["bv"].ndim - 1, 0)
    return lp


def order_values(cfg: ModelConfig, params: Params, kern: Any) -> tuple[Params, Any]:
    """`params` with every layer's value rows in the order its output projection reads x in
    (where that is one order per head, `value_order`), and `kern` told which output projections
    that was done for (`Kernels.ordered_values`, decided here once): the forward pass hands them
    the attention's output as it is. The old value planes are donated (rewritten in place where
    the backend can)."""
    done: set[tuple[str, int, int]] = set()

    params = map_layers(params, lambda lp: _ordered(cfg, kern, lp, done))
    return params, dataclasses.replace(kern, ordered_values=frozenset(done))
