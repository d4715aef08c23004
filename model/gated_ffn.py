"""The FFN's gated activation made by the gate/up matmul itself, its weight interleaved at load.

In a decode step the fused gate/up matmul wrote [M, 2 F] f32 and an XLA kernel of its own made
act(gate) * up from it, permuted into the order the down projection's matmul reads x in (the
Mosaic GPU kernel's Q4_0 order), in bf16: about 1.9 us a layer of a 7B on the H200. Where the
chosen decode matmul makes that product in its epilogue at no cost to itself
(`Kernels.takes_gated`: the Mosaic GPU kernel, whose K is not split at these widths), each
layer's gate/up rows are interleaved at load (`pallas_kernels.gated.interleave_index`, with the
features in the down projection's x order), the matmul is called with `gated=act` and returns
the product as the down projection reads it (`x_in_order`): no kernel between them. Every other
reader of the matrix (a prompt chunk's matmul without the epilogue) gets the same product from
its output (`pallas_kernels.gated.from_interleaved`).

The sums are the plain path's; the activation is computed in f32 in the kernel rather than by
XLA, which may round its last bit differently (pallas_kernels/gated.py writes it in the ops both
lower).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.config import ModelConfig
from model.weights import Params, map_layers, permute_rows
from pallas_kernels import gated


def ffn_key(lp: dict[str, Any], in_order: bool) -> tuple:
    """What `Kernels.gated_ffn` holds of a layer whose gate/up rows were interleaved: the gate/up
    and down matrices' (format, N, K), and whether the product comes in the down projection's x
    order (`x_in_order`) or as it is."""
    up, down = lp["w_gate_up"], lp["w_down"]
    return ((up.fmt, *up.shape), (down.fmt, *down.shape), in_order)


def layer_key(kern: Any, lp: dict[str, Any]) -> tuple | None:
    """The layer's key in `kern.gated_ffn` when its gate/up rows were interleaved at load, else None."""
    if "w_gate_up" not in lp:
        return None
    for in_order in (True, False):
        if ffn_key(lp, in_order) in kern.gated_ffn:
            return ffn_key(lp, in_order)
    return None


def labels(keys: frozenset) -> list[str]:
    """`Kernels.gated_ffn` as the load's log and /health name it: "q4_0 22016x4096"."""
    return sorted({f"{f} {n}x{k}" for (f, n, k), _, _ in keys})


def _interleaved(cfg: ModelConfig, kern: Any, lp: dict[str, Any], done: set) -> dict[str, Any]:
    up = lp.get("w_gate_up")
    if up is None or up.shape[0] != 2 * cfg.ffn_dim or not kern.takes_gated(up, cfg.activation):
        return lp
    order = kern.x_order(lp["w_down"])
    done.add(ffn_key(lp, order is not None))
    return {**lp, "w_gate_up": permute_rows(up, 0, gated.interleave_index(cfg.ffn_dim, order))}


def interleave_gate_up(cfg: ModelConfig, params: Params, kern: Any) -> tuple[Params, Any]:
    """`params` with the gate/up rows of every layer whose decode matmul makes the gated product
    itself (`Kernels.takes_gated`) interleaved, in the order its down projection reads x in, and
    `kern` told which (`Kernels.gated_ffn`). The old planes are donated."""
    if kern.gated_act is not None:  # an op of its own (--numerics ggml): nothing to fuse
        return params, kern
    done: set[tuple] = set()
    params = map_layers(params, lambda lp: _interleaved(cfg, kern, lp, done))
    return params, dataclasses.replace(kern, gated_ffn=frozenset(done))
