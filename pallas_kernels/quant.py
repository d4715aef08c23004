"""Quantized weight formats: the GGML format table, the `QuantizedTensor` pytree, the host-side
`repack` from GGUF blocks to byte-aligned planes, and the plain-jnp reference dequantization.

Data flow: the GGUF reader hands over each weight as raw blocks (uint8 [N, K/block*type_size])
or as a float array [N, K]; `repack` splits the blocks into numpy planes (one array per field,
e.g. `qs`, `d`), losslessly, so that a GPU kernel can read each field with wide aligned loads.
The loader device_puts the planes; `pallas_kernels.matmul` and the model read them.

Weight convention: [N, K] = [out_features, in_features] (GGUF `ne = [K, N]`). A plane is
[*S, N, X]: an optional leading stack S (layers stacked for lax.scan), then one row per output
feature; or, for the planes a format lists as `transposed`, [*S, X, N]. The static shape stays
(N, K) per matrix, so `jax.tree.map(lambda p: p[i], qt)` gives layer i's tensor. Code that
slices, gathers or splits rows goes through `QuantFormat.n_axis`.

Transposed planes: the per-block scales `d` of Q4_0 and Q8_0, [*S, K/32, N]. The Mosaic GPU
decode kernel (pallas_kernels/matmul_mgpu.py) scales each 32-block's [64 rows, M] result by
the block's 64 scales as one row vector, which it loads from a contiguous run; it cannot load a
column of a [64, K/32] tile in that layout, and a transposed copy made per call cost about
0.8 ms per decode step of a 7B model on the H200.

`dequantize_reference` follows llama.cpp's math (gguf-py `gguf/quants.py`, `ggml-quants.c`)
element for element; it is the specification the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256  # elements per K-quant super-block


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One GGML type. Plane `planes[i]` has dtype `dtypes[i]` and `per_block[i]` entries per
    block, i.e. shape [N, K / block_size * per_block[i]]."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    block_size: int  # elements per block
    type_size: int  # bytes per block in the GGUF file
    planes: tuple[str, ...]
    dtypes: tuple[str, ...]
    per_block: tuple[int, ...]
    transposed: tuple[str, ...] = ()  # planes held [*S, X, N] rather than [*S, N, X]

    def __post_init__(self) -> None:
        if not len(self.planes) == len(self.dtypes) == len(self.per_block):
            raise ValueError(f"{self.name}: planes, dtypes and per_block differ in length")
        if not set(self.transposed) <= set(self.planes):
            raise ValueError(f"{self.name}: transposed planes {self.transposed} are not all planes")

    def n_axis(self, plane: str) -> int:
        """The axis of a plane's output rows N: -2 ([*S, N, X]) or -1 for a transposed plane."""
        return -1 if plane in self.transposed else -2

    def x_axis(self, plane: str) -> int:
        """The axis of a plane's packed per-row entries X (it divides with K)."""
        return -2 if plane in self.transposed else -1

    @property
    def is_float(self) -> bool:
        return self.block_size == 1

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def plane_shapes(self, n: int, k: int) -> dict[str, tuple[int, int]]:
        check_k(self, k)
        shapes = {p: (n, k // self.block_size * w) for p, w in zip(self.planes, self.per_block)}
        return {p: shape[::-1] if p in self.transposed else shape for p, shape in shapes.items()}

    def plane_dtypes(self) -> dict[str, np.dtype]:
        return {p: np.dtype(_DTYPES[d]) for p, d in zip(self.planes, self.dtypes)}


_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "u8": np.uint8, "i8": np.int8}


def _fmt(name: str, qtype: Q, *planes: tuple[str, str, int], transposed: tuple[str, ...] = ()) -> QuantFormat:
    block_size, type_size = {
        Q.F32: (1, 4), Q.F16: (1, 2), Q.BF16: (1, 2),
        Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34),
        Q.Q2_K: (256, 84), Q.Q3_K: (256, 110), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210),
    }[qtype]  # written out (not read from gguf) so that a test can hold them against GGML_QUANT_SIZES
    names, dtypes, widths = zip(*planes)
    return QuantFormat(name, qtype, block_size, type_size, names, dtypes, widths, transposed)


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        _fmt("f32", Q.F32, ("w", "f32", 1)),
        _fmt("f16", Q.F16, ("w", "f16", 1)),
        _fmt("bf16", Q.BF16, ("w", "bf16", 1)),
        _fmt("q8_0", Q.Q8_0, ("qs", "i8", 32), ("d", "f16", 1), transposed=("d",)),
        _fmt("q4_0", Q.Q4_0, ("qs", "u8", 16), ("d", "f16", 1), transposed=("d",)),
        _fmt("q4_1", Q.Q4_1, ("qs", "u8", 16), ("d", "f16", 1), ("m", "f16", 1)),
        _fmt("q5_0", Q.Q5_0, ("qs", "u8", 16), ("qh", "u8", 4), ("d", "f16", 1)),
        _fmt("q5_1", Q.Q5_1, ("qs", "u8", 16), ("qh", "u8", 4), ("d", "f16", 1), ("m", "f16", 1)),
        _fmt("q2_k", Q.Q2_K, ("qs", "u8", 64), ("sc", "u8", 16), ("d", "f16", 1), ("dmin", "f16", 1)),
        _fmt("q3_k", Q.Q3_K, ("hmask", "u8", 32), ("qs", "u8", 64), ("sc", "i8", 16), ("d", "f16", 1)),
        _fmt("q4_k", Q.Q4_K, ("qs", "u8", 128), ("sc", "u8", 8), ("m", "u8", 8), ("d", "f16", 1),
             ("dmin", "f16", 1)),
        _fmt("q5_k", Q.Q5_K, ("qs", "u8", 128), ("qh", "u8", 32), ("sc", "u8", 8), ("m", "u8", 8), ("d", "f16", 1),
             ("dmin", "f16", 1)),
        _fmt("q6_k", Q.Q6_K, ("ql", "u8", 128), ("qh", "u8", 64), ("sc", "i8", 16), ("d", "f16", 1)),
    )
}
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}

# Formats of our own, made at load from a GGML one (never read from a file): "q4_k_split" is
# Q4_K as Q4_0's codes and block scales plus an offset per block and row, `c`, scales and offsets
# rounded to f16 and then bf16 (pallas_kernels/q4_k_split.py), so that Q4_0's kernels can serve
# it; "q6_k_split" is Q6_K as int8 codes and an f16 scale per 16 weights
# (pallas_kernels/q6_k_split.py), for the Mosaic GPU matmul's 8-bit path, and "q6_k_split6" the
# same with the codes in 6 bits (a nibble plane `qs` and a plane of the high two bits `qh`, laid
# out for the Mosaic kernel's 6-bit path); "q5_k_split" is Q5_K
# as Q8_0's codes and block scales plus an f16 offset per block and row, `c`
# (pallas_kernels/q5_k_split.py), for the same path; "q4_1_split" and "q5_1_split" are Q4_1 and
# Q5_1 in q4_k_split's (bf16 scales and offsets) and q5_k_split's (f16) forms
# (pallas_kernels/legacy_split.py).
DERIVED_FORMATS: dict[str, QuantFormat] = {
    "q4_k_split": QuantFormat("q4_k_split", Q.Q4_K, 32, 16 + 2 + 2, ("qs", "d", "c"), ("u8", "bf16", "bf16"),
                              (16, 1, 1), transposed=("d", "c")),
    "q6_k_split": QuantFormat("q6_k_split", Q.Q6_K, 16, 16 + 2, ("qs", "d"), ("i8", "f16"), (16, 1),
                              transposed=("d",)),
    "q6_k_split6": QuantFormat("q6_k_split6", Q.Q6_K, 64, 32 + 16 + 8, ("qs", "qh", "d"), ("u8", "u8", "f16"),
                               (32, 16, 4), transposed=("d",)),
    "q5_k_split": QuantFormat("q5_k_split", Q.Q5_K, 32, 32 + 2 + 2, ("qs", "d", "c"), ("i8", "f16", "f16"),
                              (32, 1, 1), transposed=("d", "c")),
    "q4_1_split": QuantFormat("q4_1_split", Q.Q4_1, 32, 16 + 2 + 2, ("qs", "d", "c"), ("u8", "bf16", "bf16"),
                              (16, 1, 1), transposed=("d", "c")),
    "q5_1_split": QuantFormat("q5_1_split", Q.Q5_1, 32, 32 + 2 + 2, ("qs", "d", "c"), ("i8", "f16", "f16"),
                              (32, 1, 1), transposed=("d", "c")),
}
ALL_FORMATS: dict[str, QuantFormat] = {**FORMATS, **DERIVED_FORMATS}


def format_for(ggml_type: int | gguf.GGMLQuantizationType | str) -> QuantFormat:
    """The format of a GGML type (enum, its int value, or our lower-case name)."""
    if isinstance(ggml_type, str):
        if ggml_type not in ALL_FORMATS:
            raise NotImplementedError(f"unsupported weight format {ggml_type!r}; supported: {', '.join(ALL_FORMATS)}")
        return ALL_FORMATS[ggml_type]
    try:
        qtype = Q(int(ggml_type))
    except ValueError:
        raise NotImplementedError(f"unknown GGML type {ggml_type!r}") from None
    if qtype not in _BY_TYPE:
        raise NotImplementedError(f"unsupported GGML type {qtype.name}; supported: {', '.join(FORMATS)}")
    return _BY_TYPE[qtype]


def check_k(fmt: QuantFormat, k: int) -> None:
    if k <= 0 or k % fmt.block_size:
        raise ValueError(f"{fmt.name}: row length K={k} is not a positive multiple of the block size "
                         f"{fmt.block_size}")


@jax.tree_util.register_pytree_with_keys_class
class QuantizedTensor:
    """A weight matrix [N, K] in format `fmt`, stored as planes (name -> array [*S, N, X], or
    [*S, X, N] for the format's `transposed` planes).

    Children: the planes (numpy or jax arrays). Static aux data: (fmt, shape), shape = (N, K)
    of one matrix whatever the leading stack S.
    """

    __slots__ = ("planes", "fmt", "shape")

    def __init__(self, planes: Mapping[str, Any], fmt: str, shape: tuple[int, int]):
        fmt_obj = format_for(fmt)
        if set(planes) != set(fmt_obj.planes):
            raise ValueError(f"{fmt}: planes {sorted(planes)} != expected {sorted(fmt_obj.planes)}")
        n, k = (int(s) for s in shape)
        check_k(fmt_obj, k)
        self.planes = {name: planes[name] for name in fmt_obj.planes}
        self.fmt = fmt_obj.name
        self.shape = (n, k)

    @property
    def format(self) -> QuantFormat:
        return ALL_FORMATS[self.fmt]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack dims S shared by every plane (() for a single matrix)."""
        return tuple(next(iter(self.planes.values())).shape[:-2])

    def tree_flatten_with_keys(self):
        children = [(jax.tree_util.DictKey(name), self.planes[name]) for name in ALL_FORMATS[self.fmt].planes]
        return children, (self.fmt, self.shape)

    def tree_flatten(self):
        return [self.planes[name] for name in ALL_FORMATS[self.fmt].planes], (self.fmt, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No validation: JAX rebuilds pytrees with placeholder leaves (None, object()).
        obj = object.__new__(cls)
        obj.fmt, obj.shape = aux
        obj.planes = dict(zip(ALL_FORMATS[obj.fmt].planes, children))
        return obj

    def __repr__(self) -> str:
        planes = ", ".join(f"{k}={getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}"
                           for k, v in self.planes.items())
        return f"QuantizedTensor({self.fmt}, shape={self.shape}, {planes})"


def array_module(qt: QuantizedTensor) -> Any:
    """numpy where every plane is a numpy array (the loader's host planes), else jax.numpy: what
    a transformation of the planes (e.g. a split at load) computes with."""
    return np if all(isinstance(p, np.ndarray) for p in qt.planes.values()) else jnp


def check_layer(qt: QuantizedTensor, layer: jax.Array | int | None) -> None:
    """Raises ValueError unless `layer` fits `qt`: None for a single matrix, an index (traced or
    not) for a one-dim stack [L, N, K]."""
    stack = qt.stack_shape
    if layer is None and stack:
        raise ValueError(f"a stack {stack} of matrices needs a layer index")
    if layer is not None and len(stack) != 1:
        raise ValueError(f"a layer index needs a one-dim stack of matrices, got stack {stack}")


def layer_of(qt: QuantizedTensor, layer: jax.Array | int | None) -> QuantizedTensor:
    """Matrix `layer` of a one-dim stack [L, N, K] (a traced index is fine), or `qt` itself
    when `layer` is None (then it must be a single matrix)."""
    check_layer(qt, layer)
    if layer is None:
        return qt
    planes = {k: jax.lax.dynamic_index_in_dim(p, layer, axis=0, keepdims=False) for k, p in qt.planes.items()}
    return QuantizedTensor(planes, qt.fmt, qt.shape)


def concat_rows(tensors: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """One matrix [N1 + N2 + ..., K] from matrices of one format and K (each plane is per row,
    so the planes concatenate along their N axis). Works on numpy or jax planes, stacked or not."""
    first = tensors[0]
    if any(t.fmt != first.fmt or t.shape[1] != first.shape[1] or t.stack_shape != first.stack_shape for t in tensors):
        raise ValueError("concat_rows needs matrices of one format, K and stack")
    fmt = first.format
    xp = np if all(isinstance(p, np.ndarray) for t in tensors for p in t.planes.values()) else jnp
    planes = {k: xp.concatenate([t.planes[k] for t in tensors], axis=fmt.n_axis(k)) for k in first.planes}
    return QuantizedTensor(planes, first.fmt, (sum(t.shape[0] for t in tensors), first.shape[1]))


def slice_rows(qt: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Rows [start, stop) of a matrix (stacked or not) as a QuantizedTensor [stop - start, K]."""
    fmt = qt.format
    planes = {}
    for name, p in qt.planes.items():
        axis = p.ndim + fmt.n_axis(name)
        planes[name] = p[(slice(None),) * axis + (slice(start, stop),)]
    return QuantizedTensor(planes, qt.fmt, (stop - start, qt.shape[1]))


def num_bytes(qt: QuantizedTensor) -> int:
    """Bytes held by the planes (all stacked matrices)."""
    return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in qt.planes.values())


# ---------------------------------------------------------------------------------------------
# repack: GGUF blocks -> planes (numpy, host side)

# Plane -> byte range [start, stop) within a GGUF block and its dtype; planes not listed here
# are unpacked by the functions in _UNPACK.
_BYTES: dict[str, dict[str, tuple[int, int, str]]] = {
    "q8_0": {"d": (0, 2, "f16"), "qs": (2, 34, "i8")},
    "q4_0": {"d": (0, 2, "f16"), "qs": (2, 18, "u8")},
    "q4_1": {"d": (0, 2, "f16"), "m": (2, 4, "f16"), "qs": (4, 20, "u8")},
    "q5_0": {"d": (0, 2, "f16"), "qh": (2, 6, "u8"), "qs": (6, 22, "u8")},
    "q5_1": {"d": (0, 2, "f16"), "m": (2, 4, "f16"), "qh": (4, 8, "u8"), "qs": (8, 24, "u8")},
    "q2_k": {"sc": (0, 16, "u8"), "qs": (16, 80, "u8"), "d": (80, 82, "f16"), "dmin": (82, 84, "f16")},
    "q3_k": {"hmask": (0, 32, "u8"), "qs": (32, 96, "u8"), "d": (108, 110, "f16")},
    "q4_k": {"d": (0, 2, "f16"), "dmin": (2, 4, "f16"), "qs": (16, 144, "u8")},
    "q5_k": {"d": (0, 2, "f16"), "dmin": (2, 4, "f16"), "qh": (16, 48, "u8"), "qs": (48, 176, "u8")},
    "q6_k": {"ql": (0, 128, "u8"), "qh": (128, 192, "u8"), "sc": (192, 208, "i8"), "d": (208, 210, "f16")},
}


def _unpack_q3_k_scales(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # 16 6-bit scales in 12 bytes: low nibbles in bytes 0..7 (scale s: byte s % 8, nibble s // 8),
    # high 2 bits in bytes 8..11 (scale s: byte 8 + s % 4, bits 2 * (s // 4)).
    raw = blocks[..., 96:108]
    low = (raw[..., None, 0:8] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # [..., 2, 8]
    high = (raw[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # [..., 4, 4]
    sc = low.reshape(*raw.shape[:-1], 16) | (high.reshape(*raw.shape[:-1], 16) << 4)
    return {"sc": (sc.astype(np.int8) - np.int8(32))}


def _unpack_k_scale_min(blocks: np.ndarray) -> dict[str, np.ndarray]:
    # Q4_K/Q5_K: 8 6-bit scales and 8 6-bit mins in 12 bytes (see ggml's get_scale_min_k4).
    raw = blocks[..., 4:16]
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return {"sc": sc, "m": mn}


_UNPACK: dict[str, Callable[[np.ndarray], dict[str, np.ndarray]]] = {
    "q3_k": _unpack_q3_k_scales,
    "q4_k": _unpack_k_scale_min,
    "q5_k": _unpack_k_scale_min,
}


def repack(data: np.ndarray, ggml_type: int | gguf.GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedTensor:
    """GGUF tensor data -> QuantizedTensor with numpy planes (lossless; the caller device_puts).

    data: raw blocks uint8 [*S, N, K/block*type_size] (as the gguf reader gives them), or for
    float types an array [*S, N, K] of the file's dtype. shape: (N, K) of one matrix.
    """
    fmt = format_for(ggml_type)
    n, k = (int(s) for s in shape)
    check_k(fmt, k)
    row_bytes = k // fmt.block_size * fmt.type_size
    data = np.ascontiguousarray(data)
    if data.ndim < 2 or data.shape[-2] != n or data.shape[-1] * data.dtype.itemsize != row_bytes:
        raise ValueError(f"{fmt.name} [{n}, {k}]: data {data.dtype}{list(data.shape)} does not hold rows of "
                         f"{row_bytes} bytes")
    stack = data.shape[:-2]
    raw = data.view(np.uint8).reshape(*stack, n, row_bytes)
    if fmt.is_float:
        return QuantizedTensor({"w": raw.view(fmt.plane_dtypes()["w"])}, fmt.name, (n, k))

    blocks = raw.reshape(*stack, n, k // fmt.block_size, fmt.type_size)
    planes: dict[str, np.ndarray] = {}
    for name, (start, stop, dtype) in _BYTES[fmt.name].items():
        planes[name] = np.ascontiguousarray(blocks[..., start:stop]).view(_DTYPES[dtype])
    if fmt.name in _UNPACK:
        planes.update(_UNPACK[fmt.name](blocks))
    dtypes = fmt.plane_dtypes()
    out = {}
    for name in fmt.planes:
        plane = planes[name]
        plane = plane.reshape(*stack, n, -1).astype(dtypes[name], copy=False)
        out[name] = np.ascontiguousarray(np.swapaxes(plane, -1, -2) if name in fmt.transposed else plane)
    return QuantizedTensor(out, fmt.name, (n, k))


# ---------------------------------------------------------------------------------------------
# reference dequantization (plain jnp; planes may be numpy or jax arrays with any leading dims)
#
# GGUF packs 2 (nibbles), 4 (2-bit fields) or 8 (bits) elements per byte, the elements of one
# byte 16 or more apart in a row. A row is seen as [G groups, P phases, g] (`layout`): phase p
# of every group is unpacked from its bytes with one constant shift (`dequantize_phase`, f32
# [*S, N, G, g]), and `dequantize_reference` interleaves the phases into the natural order.
# Constant shifts are what XLA on CPU vectorizes; a shift amount that varies along a major axis
# was 2-4x slower. The interleave is cheap for the K-quants' 32-element chunks but doubles the
# cost of the 32-blocks' 16-element halves, so for those the matmul contracts each phase with
# the matching slice of x instead (pallas_kernels/matmul.py).


def _f32(p: jax.Array) -> jax.Array:
    return jnp.asarray(p).astype(jnp.float32)


def _rows(p: jax.Array, *shape: int) -> jax.Array:
    """Reshapes the last axis of plane p [..., X] to `shape`."""
    p = jnp.asarray(p)
    return jnp.reshape(p, (*p.shape[:-1], *shape))


def _sub_scaled(
    q: jax.Array, d: jax.Array, sc: jax.Array, chunk: int, dmin: jax.Array | None = None, m: jax.Array | None = None
) -> jax.Array:
    """q [.., S, 32] ints: chunk `chunk` of every super-block; d, dmin [.., S]; sc, m [.., S * n_sub]
    the sub-block scales and mins (n_sub = 16 or 8 per super-block) -> f32 d sc q - dmin m."""
    num_super = q.shape[-2]
    per_chunk = sc.shape[-1] // num_super // (QK_K // 32)  # sub-blocks in one chunk: 2 or 1

    def scaled(d, sc):  # [.., S, per_chunk, 1]
        sc = _rows(sc, num_super, QK_K // 32, per_chunk)[..., chunk, :]
        return (_f32(d)[..., None] * _f32(sc))[..., None]

    dl = scaled(d, sc)
    if per_chunk == 1:  # no size-1 axis on q: XLA would copy q to lay it out
        w = dl[..., 0] * _f32(q)
        return w if dmin is None else w - scaled(dmin, m)[..., 0]
    w = dl * _f32(_rows(q, per_chunk, 32 // per_chunk))
    w = w if dmin is None else w - scaled(dmin, m)
    return jnp.reshape(w, q.shape)


def layout(fmt: str, k: int) -> tuple[int, int, int]:
    """(P, G, g): phases, groups and group width of a row of K elements in format `fmt`."""
    num_phases, width = {
        "q4_0": (2, 16), "q4_1": (2, 16), "q5_0": (2, 16), "q5_1": (2, 16), "q8_0": (1, 32), "q4_k_split": (2, 16),
        "q6_k_split": (1, 16), "q6_k_split6": (1, 16),
        "q5_k_split": (1, 32), "q4_1_split": (2, 16), "q5_1_split": (1, 32),
        "q2_k": (8, 32), "q3_k": (8, 32), "q4_k": (8, 32), "q5_k": (8, 32), "q6_k": (8, 32),
    }.get(fmt, (1, k))
    return num_phases, k // (num_phases * width), width


def row_major_planes(qt: QuantizedTensor) -> dict[str, jax.Array]:
    """The planes, each [*S, N, X] (transposed ones swapped back)."""
    fmt = qt.format
    return {k: jnp.swapaxes(jnp.asarray(p), -1, -2) if k in fmt.transposed else p for k, p in qt.planes.items()}


def dequantize_phase(qt: QuantizedTensor, ph: int) -> jax.Array:
    """f32 [*S, N, G, g]: element (ph, l) of every group of every row (see `layout`)."""
    p, f = row_major_planes(qt), qt.fmt
    _, num_groups, width = layout(f, qt.shape[1])
    if f in ("f32", "f16", "bf16"):
        return _f32(p["w"])[..., None, :]
    if f in ("q8_0", "q6_k_split", "q6_k_split6", "q5_k_split", "q5_1_split"):  # G = block of 32 or 16, one scale
        codes = p["qs"]
        if f == "q6_k_split6":  # its codes' two planes in natural order
            from pallas_kernels.q6_k_split import codes6

            codes = codes6(p, qt.shape[1])
        w = _f32(p["d"])[..., None] * _f32(_rows(codes, num_groups, width))
        return w + _f32(p["c"])[..., None] if "c" in p else w
    # G = block; qs byte l: element l (low nibble), 16 + l
    if f in ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_split", "q4_1_split"):
        q = (_rows(p["qs"], num_groups, 16) >> (4 * ph)) & 0x0F
        if f in ("q5_0", "q5_1"):  # qh bit j (byte j / 8, bit j % 8) -> element j = 16 ph + l
            qh = _rows(p["qh"], num_groups, 4)[..., 2 * ph : 2 * ph + 2, None]  # [.., B, 2, 1]
            h = (qh >> np.arange(8, dtype=np.uint8)) & 0x01  # [.., B, 2, 8]
            q = q | (jnp.reshape(h, q.shape) << 4)
        d = _f32(p["d"])[..., None]
        if f == "q4_0":
            return d * _f32(q.astype(jnp.int8) - jnp.int8(8))
        if f in ("q4_k_split", "q4_1_split"):
            return d * _f32(q.astype(jnp.int8) - jnp.int8(8)) + _f32(p["c"])[..., None]
        if f == "q5_0":
            return d * _f32(q.astype(jnp.int8) - jnp.int8(16))
        return d * _f32(q) + _f32(p["m"])[..., None]
    # K-quants: phase ph = chunk ph of 32 elements of each super-block (G = super-blocks).
    if f in ("q2_k", "q3_k"):  # qs: 32 bytes per half super-block c, bits 2 j of byte l -> element 32 (4 c + j) + l
        c, j = divmod(ph, 4)
        q = (_rows(p["qs"], num_groups, 2, 32)[..., c, :] >> (2 * j)) & 0x03  # [.., S, 32]
        if f == "q2_k":
            sc = jnp.asarray(p["sc"])
            return _sub_scaled(q, p["d"], sc & 0x0F, ph, p["dmin"], sc >> 4)
        # hmask byte l bit ph -> element 32 ph + l; a clear bit subtracts 4
        h = (_rows(p["hmask"], num_groups, 32) >> ph) & 0x01
        q = q.astype(jnp.int8) - ((h ^ 1) << 2).astype(jnp.int8)
        return _sub_scaled(q, p["d"], p["sc"], ph)
    if f in ("q4_k", "q5_k"):  # qs: 32 bytes per quarter c, nibble j of byte l -> element 32 (2 c + j) + l
        c, j = divmod(ph, 2)
        q = (_rows(p["qs"], num_groups, 4, 32)[..., c, :] >> (4 * j)) & 0x0F  # [.., S, 32]
        if f == "q5_k":  # qh byte l bit ph -> element 32 ph + l
            q = q | (((_rows(p["qh"], num_groups, 32) >> ph) & 0x01) << 4)
        return _sub_scaled(q, p["d"], p["sc"], ph, p["dmin"], p["m"])
    if f == "q6_k":  # half c of a super-block: ql byte 64 c + 32 i + l nibble n, qh byte 32 c + l bits 2 (2 n + i)
        c, rest = divmod(ph, 4)
        n, i = divmod(rest, 2)
        ql = (_rows(p["ql"], num_groups, 4, 32)[..., 2 * c + i, :] >> (4 * n)) & 0x0F  # [.., S, 32]
        qh = (_rows(p["qh"], num_groups, 2, 32)[..., c, :] >> (2 * rest)) & 0x03
        q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)
        return _sub_scaled(q, p["d"], p["sc"], ph)
    raise NotImplementedError(f"no reference dequantization for {f}")


def dequantize_reference(qt: QuantizedTensor) -> jax.Array:
    """f32 [*S, N, K]: llama.cpp's dequantization of every element, in natural order."""
    num_phases = layout(qt.fmt, qt.shape[1])[0]
    w = jnp.stack([dequantize_phase(qt, ph) for ph in range(num_phases)], axis=-2)  # [*S, N, G, P, g]
    return jnp.reshape(w, (*w.shape[:-3], qt.shape[1]))


def take_rows(qt: QuantizedTensor, ids: jax.Array) -> QuantizedTensor:
    """The rows `ids` [T] of a single matrix as a QuantizedTensor [T, K] (planes gathered).

    Out-of-range ids gather NaN scales (jnp.take's fill mode), so they show as NaN rows.
    """
    if qt.stack_shape:
        raise ValueError(f"take_rows needs a single matrix, got stack {qt.stack_shape}")
    ids = jnp.asarray(ids)
    fmt = qt.format
    planes = {name: jnp.take(jnp.asarray(p), ids, axis=fmt.n_axis(name), mode="fill") for name, p in qt.planes.items()}
    return QuantizedTensor(planes, qt.fmt, (ids.shape[0], qt.shape[1]))


def take_rows_reference(qt: QuantizedTensor, ids: jax.Array) -> jax.Array:
    """f32 [T, K]: dequantized rows `ids` [T] int32 (embedding lookup)."""
    return dequantize_reference(take_rows(qt, ids))
