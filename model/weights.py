"""The weight table: GGUF tensors -> a params pytree on the device, still quantized.

Each matrix is repacked once (`pallas_kernels.quant.repack`) into the planes the kernels read
and put on the device one at a time, so the host never holds the model twice. Layers whose
tensors share formats and shapes are stacked along a leading [L] axis so the forward pass can
`lax.scan` over them (one compiled layer body); otherwise layers stay a list and are unrolled.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.gguf_file import GGUFFile, GGUFLoadError, TensorInfo
from pallas_kernels import quant

log = logging.getLogger(__name__)

# layer tensor name -> key in the layer dict; (required, is_matrix)
_LAYER_TENSORS: dict[str, tuple[str, bool, bool]] = {
    "attn_norm.weight": ("attn_norm", True, False),
    "attn_q.weight": ("wq", True, True),
    "attn_k.weight": ("wk", True, True),
    "attn_v.weight": ("wv", True, True),
    "attn_q.bias": ("bq", False, False),
    "attn_k.bias": ("bk", False, False),
    "attn_v.bias": ("bv", False, False),
    "attn_q_norm.weight": ("q_norm", False, False),
    "attn_k_norm.weight": ("k_norm", False, False),
    "attn_output.weight": ("wo", True, True),
    "post_attention_norm.weight": ("post_attn_norm", False, False),
    "ffn_norm.weight": ("ffn_norm", True, False),
    "ffn_gate.weight": ("w_gate", True, True),
    "ffn_up.weight": ("w_up", True, True),
    "ffn_down.weight": ("w_down", True, True),
    "post_ffw_norm.weight": ("post_ffn_norm", False, False),
}


@dataclasses.dataclass
class Params:
    """Device weights. `layers` is one dict of [L]-stacked leaves, or a list of per-layer dicts."""

    embed: quant.QuantizedTensor  # [V, E]
    output: quant.QuantizedTensor | None  # [V, E]; None when tied to embed
    output_norm: jax.Array  # [E]
    rope_freqs: jax.Array | None  # [D/2] llama3 frequency factors
    layers: Any
    is_stacked: bool

    def tree_flatten(self):  # noqa: D401 - pytree protocol
        return (self.embed, self.output, self.output_norm, self.rope_freqs, self.layers), self.is_stacked

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, is_stacked=aux)


jax.tree_util.register_pytree_node(Params, Params.tree_flatten, Params.tree_unflatten)


def _float_vector(info: TensorInfo) -> np.ndarray:
    if info.ggml_type.name not in ("F32", "F16", "BF16"):
        raise GGUFLoadError(f"tensor {info.name!r}: expected a float vector, got {info.ggml_type.name}")
    arr = np.asarray(info.data)
    if info.ggml_type.name == "BF16":
        arr = arr.view(np.uint16).astype(np.uint32) << 16
        arr = arr.view(np.float32)
    return arr.astype(np.float32).reshape(-1)


def _matrix(info: TensorInfo) -> quant.QuantizedTensor:
    if len(info.shape) != 2:
        raise GGUFLoadError(f"tensor {info.name!r}: expected a matrix, got shape {info.shape}")
    try:
        return quant.repack(np.asarray(info.data), info.ggml_type, info.shape)
    except NotImplementedError as e:
        raise GGUFLoadError(f"tensor {info.name!r}: unsupported tensor type {info.ggml_type.name} ({e})") from e


def _signature(qt: quant.QuantizedTensor | np.ndarray) -> tuple:
    if isinstance(qt, np.ndarray):
        return ("vec", qt.shape)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    return (treedef, tuple((x.shape, x.dtype) for x in leaves))


# Matrices that read the same input, fused into one along N when their formats match: one
# kernel launch and one pass over x instead of two or three (the forward pass splits the output).
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def _fuse(layer: dict[str, Any]) -> None:
    for fused, parts in FUSED.items():
        ws = [layer.get(p) for p in parts]
        if all(isinstance(w, quant.QuantizedTensor) for w in ws) and len({(w.fmt, w.shape[1]) for w in ws}) == 1:
            layer[fused] = quant.concat_rows(ws)
            for p in parts:
                del layer[p]


def load_params(gf: GGUFFile, cfg: ModelConfig, fuse: bool = True) -> Params:
    """Repacks and uploads every tensor of `gf`; stacks layers when they are uniform. With
    `fuse`, q/k/v and gate/up matrices of one format become one matrix each (`FUSED`);
    tensor parallelism shards them one by one and loads with fuse=False."""
    host_layers: list[dict[str, Any]] = []
    for i in range(cfg.num_layers):
        layer: dict[str, Any] = {}
        for suffix, (key, required, is_matrix) in _LAYER_TENSORS.items():
            name = f"blk.{i}.{suffix}"
            if name not in gf.tensors:
                if required:
                    raise GGUFLoadError(f"missing tensor {name!r}")
                continue
            info = gf.tensors[name]
            layer[key] = _matrix(info) if is_matrix else _float_vector(info)
        if fuse:
            _fuse(layer)
        host_layers.append(layer)

    signatures = [{k: _signature(v) for k, v in layer.items()} for layer in host_layers]
    is_stacked = all(s == signatures[0] for s in signatures[1:])
    if is_stacked:
        layers = jax.tree_util.tree_map(lambda *xs: jnp.asarray(np.stack(xs)), *host_layers)
    else:
        differing = sorted({k for s in signatures[1:] for k in s if s[k] != signatures[0].get(k)})
        log.info("layers differ in %s: unrolling the layer loop", ", ".join(differing))
        layers = [jax.tree_util.tree_map(jnp.asarray, layer) for layer in host_layers]
    del host_layers

    embed = jax.tree_util.tree_map(jnp.asarray, _matrix(gf.tensor("token_embd.weight")))
    output = None
    if not cfg.tied_output:
        output = jax.tree_util.tree_map(jnp.asarray, _matrix(gf.tensor("output.weight")))
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = jnp.asarray(_float_vector(gf.tensors["rope_freqs.weight"]))
    return Params(
        embed=embed,
        output=output,
        output_norm=jnp.asarray(_float_vector(gf.tensor("output_norm.weight"))),
        rope_freqs=rope_freqs,
        layers=layers,
        is_stacked=is_stacked,
    )


def params_nbytes(params: Params) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
