"""The weight table: GGUF tensors -> a params pytree on the device, still quantized.

Each matrix is repacked once (`pallas_kernels.quant.repack`) into the planes the kernels read
and put on the device one at a time, so the host never holds the model twice. Layers whose
tensors share formats and shapes are stacked along a leading [L] axis so the forward pass can
`lax.scan` over them (one compiled layer body). Otherwise layers stay a list, in which runs
that repeat with a short period become `LayerGroup`s, scanned too: llama.cpp's Q4_K_M gives
Q6_K to `attn_v` and `ffn_down` in the first and last eighth of the layers and in every third
one between, so a 32-layer file is 4 + 8 x 3 + 4 layers, five layer bodies instead of 32.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.gguf_file import GGUFFile, GGUFLoadError, TensorInfo
from pallas_kernels import legacy_split, mgpu_tuning, q4_k_split, q5_k_split, q6_k_split, quant

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
    """Device weights. `layers` is one dict of [L]-stacked leaves, or a list of per-layer dicts
    and `LayerGroup`s in layer order."""

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


@dataclasses.dataclass
class LayerGroup:
    """Layers start .. start + period x repeats - 1 of a list of layers, where layer start +
    r x period + j has the signature of layer start + j: `phases[j]` is the dict of those
    layers' leaves stacked on a leading [repeats] axis."""

    phases: list[dict[str, Any]]
    start: int
    repeats: int

    @property
    def period(self) -> int:
        return len(self.phases)

    def layer(self, r: int, j: int) -> int:
        """The model's index of phase j's layer in repeat r."""
        return self.start + r * self.period + j

    def tree_flatten(self):  # noqa: D401 - pytree protocol
        return (self.phases,), (self.start, self.repeats)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


jax.tree_util.register_pytree_node(LayerGroup, LayerGroup.tree_flatten, LayerGroup.tree_unflatten)

def numbered(layers: list[Any]) -> Iterator[tuple[int, Any]]:
    """A list of layers (per-layer dicts and `LayerGroup`s, `Params.layers` unstacked) with each
    entry's first layer index in the model."""
    i = 0
    for entry in layers:
        group = isinstance(entry, LayerGroup)
        assert not group or entry.start == i, (entry.start, i)
        yield i, entry
        i += entry.period * entry.repeats if group else 1


MAX_PERIOD = 4  # the longest period `layer_runs` looks for (Q4_K_M's is 3)


def layer_runs(signatures: list[Any], max_period: int | None = None) -> list[tuple[int, int, int]]:
    """(start, period, repeats) covering the layers in order: from each layer, the period (up to
    `max_period`) whose repeats cover the most layers, where each layer of a repeat has the
    signature of the same phase of the first (ties: the shorter period); a run of one repeat is
    a single layer, (start, 1, 1). `max_period` defaults to MAX_PERIOD (0: no runs)."""
    max_period = MAX_PERIOD if max_period is None else max_period
    runs = []
    start, n = 0, len(signatures)
    while start < n:
        best = (1, 1)  # (period, repeats)
        for period in range(1, max_period + 1):
            repeats = 1
            while (start + (repeats + 1) * period <= n and all(
                    signatures[start + repeats * period + j] == signatures[start + j] for j in range(period))):
                repeats += 1
            if repeats > 1 and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        runs.append((start, *best))
        start += best[0] * best[1]
    return runs


def _float_vector(info: TensorInfo) -> np.ndarray:
    if info.ggml_type.name not in ("F32", "F16", "BF16"):
        raise GGUFLoadError(f"tensor {info.name!r}: expected a float vector, got {info.ggml_type.name}")
    arr = np.asarray(info.data)
    if info.ggml_type.name == "BF16":
        arr = arr.view(np.uint16).astype(np.uint32) << 16
        arr = arr.view(np.float32)
    return arr.astype(np.float32).reshape(-1)


# Formats split at load for other kernels (EngineConfig.split_q4_k, split_q5_k, split_q6_k,
# split_legacy): the GGML format -> (the derived format, the split). Q6_K has two: the 8-bit
# split under "q6_k", the 6-bit one under Q6_K_SPLIT6, which a set of splits holds in place of
# "q6_k" (EngineConfig.q6_k_split_bits; `split_key`).
Q6_K_SPLIT6 = "q6_k6"
SPLITS = {"q4_k": ("q4_k_split", q4_k_split.split_q4_k), "q5_k": ("q5_k_split", q5_k_split.split_q5_k),
          "q6_k": ("q6_k_split", q6_k_split.split_q6_k), Q6_K_SPLIT6: ("q6_k_split6", q6_k_split.split_q6_k6),
          "q4_1": ("q4_1_split", legacy_split.split_q4_1), "q5_0": ("q8_0", legacy_split.q5_0_as_q8_0),
          "q5_1": ("q5_1_split", legacy_split.split_q5_1)}
_SPLITS_JIT = {fmt: jax.jit(fn) for fmt, (_, fn) in SPLITS.items()}


# Q4_1, Q5_0 and Q5_1 are split only where the Mosaic GPU matmul takes the shape: they have Triton
# kernels of their own (Q5_0 as Q8_0 would read 55% more bytes through Triton's Q8_0 kernel).
# SmolLM2's K of 576 and Gemma 3 270M's 640 are not multiples of the decode kernel's K step (256).
# Q6_K's split needs N in 64s (of the other GPU kernels only the forced jax-triton variant serves
# it, and it keeps that rule); Q4_K's and Q5_K's go to the Triton
# Q4_0 / Q8_0 kernels where the Mosaic one refuses them.
_SPLIT_WHERE_MOSAIC_TAKES = ("q4_1", "q5_0", "q5_1")


def split_key(fmt: str, splits: frozenset[str]) -> str:
    """The `SPLITS` entry a matrix of GGML format `fmt` would take under `splits`."""
    return Q6_K_SPLIT6 if fmt == "q6_k" and Q6_K_SPLIT6 in splits else fmt


def is_split(fmt: str, n: int, k: int, splits: frozenset[str]) -> bool:
    """Whether a matrix of format `fmt` and shape [N, K] is split, given the formats to split."""
    if split_key(fmt, splits) not in splits:
        return False
    if fmt == "q6_k":
        return q6_k_split.takes(n)
    return fmt not in _SPLIT_WHERE_MOSAIC_TAKES or mgpu_tuning.takes_shape(n, k)


def _split(w: quant.QuantizedTensor, splits: frozenset[str], jit: bool = False) -> quant.QuantizedTensor:
    if not is_split(w.fmt, w.shape[0], w.shape[1], splits):
        return w
    key = split_key(w.fmt, splits)
    return (_SPLITS_JIT[key] if jit else SPLITS[key][1])(w)


def _matrix(info: TensorInfo, splits: frozenset[str] = frozenset()) -> quant.QuantizedTensor:
    _format(info)  # a matrix of a supported type, or GGUFLoadError
    return _split(quant.repack(np.asarray(info.data), info.ggml_type, info.shape), splits)


# Matrices that read the same input, fused into one along N when their formats match: one
# kernel launch and one pass over x instead of two or three (the forward pass splits the output).
# In order: q and k alone where v's format differs (Q4_K_M's Q6_K v in half the layers).
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"), "wqk": ("wq", "wk")}

# (where, key, host value) -> device value: where a loaded tensor goes. `where` names it for
# errors ("blk.*" for a stack of layers, "blk.3", "token_embd", ...); key is its Params key
# (a layer dict key, or "embed", "output", "output_norm", "rope_freqs").
Place = Callable[[str, str, Any], Any]


def _to_device(where: str, key: str, value: Any) -> Any:
    del where, key
    return jax.tree_util.tree_map(jnp.asarray, value)


def _splitting_after(place: Place, split_embed: bool, splits: frozenset[str]) -> Place:
    """`place`, then every matrix of the placed value in a format of `splits` split on its
    device (the embedding only with `split_embed`)."""
    def placed(where: str, key: str, value: Any) -> Any:
        value = place(where, key, value)
        if key == "embed" and not split_embed:
            return value
        return jax.tree_util.tree_map(
            lambda t: _split(t, splits, jit=True) if isinstance(t, quant.QuantizedTensor) else t,
            value, is_leaf=lambda t: isinstance(t, quant.QuantizedTensor))
    return placed


class _Entry(NamedTuple):
    """One layer tensor to load: a vector, a matrix, or matrices fused along N."""

    is_matrix: bool
    infos: tuple[TensorInfo, ...]
    splits: frozenset[str] = frozenset()  # formats split at load (`SPLITS`)

    def signature(self) -> tuple:
        """What the loaded value's shapes and dtypes depend on (read from the header alone)."""
        if not self.is_matrix:
            return ("vec", int(np.prod(self.infos[0].shape)))
        rows = sum(int(i.shape[0]) for i in self.infos)
        return ("mat", _format(self.infos[0], self.splits, rows), rows, int(self.infos[0].shape[1]))

    def load(self) -> Any:
        if not self.is_matrix:
            return _float_vector(self.infos[0])
        ws = [_matrix(info) for info in self.infos]
        # split after fusing, as the device split does (whether Q6_K splits depends on the rows)
        return _split(ws[0] if len(ws) == 1 else quant.concat_rows(ws), self.splits)


def _format(info: TensorInfo, splits: frozenset[str] = frozenset(), rows: int | None = None) -> str:
    """The repacked format of a matrix tensor (from the header alone); `rows`: of the matrix it
    is fused into."""
    if len(info.shape) != 2:
        raise GGUFLoadError(f"tensor {info.name!r}: expected a matrix, got shape {info.shape}")
    try:
        name = quant.format_for(info.ggml_type).name
    except NotImplementedError as e:
        raise GGUFLoadError(f"tensor {info.name!r}: unsupported tensor type {info.ggml_type.name} ({e})") from e
    n = int(info.shape[0]) if rows is None else rows
    return SPLITS[split_key(name, splits)][0] if is_split(name, n, int(info.shape[1]), splits) else name


def _layer_entries(gf: GGUFFile, i: int, fuse: bool, splits: frozenset[str] = frozenset()) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for suffix, (key, required, is_matrix) in _LAYER_TENSORS.items():
        name = f"blk.{i}.{suffix}"
        if name not in gf.tensors:
            if required:
                raise GGUFLoadError(f"missing tensor {name!r}")
            continue
        entries[key] = _Entry(is_matrix, (gf.tensors[name],), splits)
    if fuse:
        for fused, parts in FUSED.items():
            es = [entries.get(p) for p in parts]
            if all(e is not None and e.is_matrix for e in es):
                kinds = {(_format(e.infos[0]), int(e.infos[0].shape[1])) for e in es}
                if len(kinds) == 1:
                    entries[fused] = _Entry(True, tuple(e.infos[0] for e in es), splits)
                    for p in parts:
                        del entries[p]
    return entries


def _stacked(entries: list[_Entry]) -> Any:
    """The layers' values of one key, stacked on a leading [L] axis in one preallocated host
    buffer (no list of per-layer copies beside it)."""
    leaves, treedef = jax.tree_util.tree_flatten(entries[0].load())
    out = [np.empty((len(entries), *a.shape), a.dtype) for a in leaves]
    for i, entry in enumerate(entries):
        for dst, src in zip(out, leaves if i == 0 else jax.tree_util.tree_leaves(entry.load())):
            dst[i] = src
    return jax.tree_util.tree_unflatten(treedef, out)


def load_params(gf: GGUFFile, cfg: ModelConfig, fuse: bool = True, place: Place | None = None,
                splits: frozenset[str] | set[str] = frozenset()) -> Params:
    """Repacks and uploads every tensor of `gf`; stacks layers when they are uniform. With
    `fuse`, q/k/v and gate/up matrices of one format become one matrix each (`FUSED`; q and k
    alone where v's format differs);
    tensor parallelism shards them one by one and loads with fuse=False.

    Tensors are read, repacked and placed one layer key at a time (a stacked key: all layers of
    it), so the host holds at most one key's stack beside the memory-mapped file, never the
    model. `place` puts each value on its device(s) (tensor parallelism: each device receives
    only its shards; default: the default device). Matrices of the formats in `splits` ("q4_k",
    "q5_k", "q6_k", "q4_1", "q5_0", "q5_1") are split for other kernels (`SPLITS`;
    EngineConfig.split_q4_k, split_q5_k, split_q6_k, split_legacy)."""
    # Splits: jitted on the device after placement where the params go whole to the default
    # device (numpy on the host took 0.34 s per 4096 x 11008 Q4_K matrix); on the host where
    # `place` shards them as it places them. The embedding is split only when it is also the
    # output matrix (otherwise it is only gathered from).
    splits = frozenset(splits)
    host_splits = splits if place is not None else frozenset()
    if splits and place is None:
        place = _splitting_after(_to_device, cfg.tied_output, splits)
    place = place or _to_device
    entries = [_layer_entries(gf, i, fuse, host_splits) for i in range(cfg.num_layers)]
    signatures = [{k: e.signature() for k, e in layer.items()} for layer in entries]
    is_stacked = all(sig == signatures[0] for sig in signatures[1:])
    if is_stacked:
        layers: Any = {key: place("blk.*", key, _stacked([layer[key] for layer in entries])) for key in entries[0]}
    else:
        differing = sorted({k for sig in signatures[1:] for k in sig if sig[k] != signatures[0].get(k)})
        runs = layer_runs(signatures)
        layers = []
        for start, period, repeats in runs:
            if repeats == 1:
                layers.append({key: place(f"blk.{start}", key, e.load()) for key, e in entries[start].items()})
                continue
            phases = []
            for j in range(period):
                members = [entries[start + r * period + j] for r in range(repeats)]
                where = f"blk.{start + j}+{period}x{repeats}"
                phases.append({key: place(where, key, _stacked([m[key] for m in members])) for key in members[0]})
            layers.append(LayerGroup(phases, start, repeats))
        log.info("layers differ in %s: layer runs (start, period, repeats) %s", ", ".join(differing),
                 [run for run in runs if run[2] > 1] or "none")

    embed = place("token_embd", "embed",
                  _matrix(gf.tensor("token_embd.weight"), host_splits if cfg.tied_output else frozenset()))
    output = None
    if not cfg.tied_output:
        output = place("output", "output", _matrix(gf.tensor("output.weight"), host_splits))
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = place("rope_freqs", "rope_freqs", _float_vector(gf.tensors["rope_freqs.weight"]))
    return Params(
        embed=embed,
        output=output,
        output_norm=place("output_norm", "output_norm", _float_vector(gf.tensor("output_norm.weight"))),
        rope_freqs=rope_freqs,
        layers=layers,
        is_stacked=is_stacked,
    )


def params_nbytes(params: Params) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))


def map_layers(params: Params, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Params:
    """params with every layer dict (the stacked one, each of a list's, each phase of a
    LayerGroup's) replaced by fn(dict)."""
    def layer(lp):
        if isinstance(lp, LayerGroup):
            return LayerGroup([fn(phase) for phase in lp.phases], lp.start, lp.repeats)
        return fn(lp)

    layers = layer(params.layers) if params.is_stacked else [layer(lp) for lp in params.layers]
    return dataclasses.replace(params, layers=layers)


@functools.partial(jax.jit, static_argnames=("axis", "start"), donate_argnums=0)
def permute_plane(plane: jax.Array, index: jax.Array, axis: int, start: int) -> jax.Array:
    """plane with its rows [start, start + len(index)) along `axis` replaced by rows
    start + index (in place where the plane is donated)."""
    rows = jax.lax.slice_in_dim(plane, start, start + index.shape[0], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(plane, jnp.take(rows, index, axis=axis), start, axis=axis)


def permute_rows(w: quant.QuantizedTensor, start: int, index: np.ndarray) -> quant.QuantizedTensor:
    """w (stacked or not) with its rows [start, start + len(index)) replaced by rows start + index,
    in every plane; the old planes donated."""
    fmt = w.format
    planes = {name: permute_plane(p, index, p.ndim + fmt.n_axis(name), start) for name, p in w.planes.items()}
    return quant.QuantizedTensor(planes, w.fmt, w.shape)
