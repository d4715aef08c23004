"""Quantized matmul as Pallas kernels lowered through Triton: implementation "triton" of op "matmul".

Inputs come from the model's forward pass: activations x [..., K] (f32 or bf16) and a
`QuantizedTensor` weight [N, K], or a stack [L, N, K] of the scanned layers with a traced
`layer` that the kernel applies itself (no copy of the matrix), whose planes
`pallas_kernels.quant.repack` built at load time
(read its module docstring: one plane per block field, byte-aligned). Output [..., N] f32, the
same function as `pallas_kernels.matmul.qmatmul_reference`, the specification these kernels are
tested against (tests/pallas_kernels/test_matmul_conformance.py).

Legend: M rows of x (tokens), N output features, K input features; a row of K is cut into U-element
*units* (a 32-block, or a 256-element K-quant super-block), a unit into P *parts* of L elements
(the elements one byte position of the packed planes feeds: the low or the high nibbles of a
32-block, one 32-element chunk of a Q4_K super-block, ...), and parts into *scale groups* that share
one scale d (and one bias). A program reads S units of BN rows per step: each weight byte once.

Two kernels, chosen per call by `TritonMatmulTuning.kernel`:
  * "fma" (decode, few rows of x): dequantized codes times x on the CUDA cores in f32, summed per
    scale group, then scaled. Exact to f32 rounding whatever the dtype of x.
  * "mma" (prefill, or decode with more rows): each part's [BN, S*L] tile is dequantized to
    bf16 in registers and fed to tensor cores (`jax.lax.dot_general` -> Triton `tt.dot`) against
    the matching slice of x, f32 accumulation. With f32 x the dot uses the 3-pass bf16 algorithm
    (BF16_BF16_F32_X3, about f32 accuracy); with bf16 x one bf16 pass (bf16 accuracy).

x is rearranged outside the kernel (it is tiny next to the weights) so that every part's
elements are contiguous: x_parts[p, m, g*L + l] = x[m, g*U + p*L + l]. A part of the weight then
contracts with a contiguous slice of x, and no kernel interleaves nibbles (Triton lowers no
general concatenate).

Codes become floats without int->float conversions (16/clock/SM on Hopper, a quarter of the
integer rate): a b-bit code q (b = 4..6) is shifted within its byte and moved by one byte permute
(PRMT) into bits 16..22 under the exponent of 2.0, which gives the float f = 2 + q/2^(b-1)
exactly. A weight w = scale * (q - zero point) + bias is then a f + b with per-group constants
a, b: one FMA per weight for the tensor cores, and for the fma kernel sum w*x = a sum f*x +
b sum x, the group sums of x computed once outside. 8-bit codes use the 2^23 magic number and
one subtraction. On the GPU the shifts, masks and permutes are inline PTX
(`plt.elementwise_inline_asm`, four codes per 32-bit register); with `interpret=True` (or
`use_asm=False`) the same floats come from plain jnp bit operations, so the
CPU tests check the exact arithmetic the GPU runs, except the PTX itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import q4_k_split, registry
from pallas_kernels.quant import QuantizedTensor, check_layer, row_major_planes

# jax 0.10.2 and 0.11.x name it CompilerParams; older releases TritonCompilerParams. Looked up by
# attribute so that a missing name fails loudly at import, not hidden behind an ImportError.
_TRITON_PARAMS = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams")

KERNELS = ("fma", "mma")
_POW2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731


@dataclasses.dataclass(frozen=True)
class TritonMatmulTuning:
    """Tiling of one call. `block_k` is in weight elements (a multiple of the format's unit:
    32 for the 32-block formats, 256 for K-quants); `block_m` is used by the "mma" kernel only
    (rows of x per program, x padded to a multiple of it)."""

    kernel: str = "fma"
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 1
    use_asm: bool = True  # inline PTX for code->float (GPU only; interpret mode uses the jnp twin)

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        for name in ("block_n", "block_k", "block_m", "num_warps"):  # Triton tensor dims: powers of 2
            value = getattr(self, name)
            if not isinstance(value, int) or not _POW2(value):
                raise ValueError(f"{name} must be a positive power of 2, got {value!r}")
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"split_k must be an int >= 1, got {self.split_k!r}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be >= 32, got {self.block_k}")
        if self.num_warps > 16:
            raise ValueError(f"num_warps must be <= 16, got {self.num_warps}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.kernel == "mma" and (self.block_n < 16 or self.block_m < 16):
            raise ValueError("the mma kernel needs block_n >= 16 and block_m >= 16 (tensor-core tiles)")


# ---------------------------------------------------------------------------------------------
# formats: how a unit splits into parts and scale groups, and how to decode one step


class _Spec(NamedTuple):
    unit: int  # U elements per unit
    num_parts: int  # P
    num_groups: int  # scale groups per unit; each covers P / num_groups consecutive parts
    code_scale: float  # 2^(b-1) for b-bit codes f = 2 + q/2^(b-1) (see _Codes); 1 for int8 codes
    views: Callable[[dict, int, int], dict]  # planes [N, X] -> kernel views (free reshapes)


def _v(**shapes):
    """Views of the planes: name -> function (n, k) -> shape. Reshapes of contiguous row-major
    planes are bitcasts in XLA (no copy)."""

    def views(planes, n, k):
        return {name: jnp.reshape(planes[name], fn(n, k)) for name, fn in shapes.items()}

    return views


_k32 = lambda n, k: (n, k // 32)  # noqa: E731  per 32-block scalar planes
_k256 = lambda n, k: (n, k // 256)  # noqa: E731

SPECS: dict[str, _Spec] = {
    "q8_0": _Spec(32, 1, 1, 1.0, _v(qs=lambda n, k: (n, k // 32, 32), d=_k32)),
    "q4_0": _Spec(32, 2, 1, 8.0, _v(qs=lambda n, k: (n, k // 32, 16), d=_k32)),
    "q4_1": _Spec(32, 2, 1, 8.0, _v(qs=lambda n, k: (n, k // 32, 16), d=_k32, m=_k32)),
    "q5_0": _Spec(32, 2, 1, 16.0, _v(qs=lambda n, k: (n, k // 32, 16), qh=lambda n, k: (n, k // 32, 4), d=_k32)),
    "q5_1": _Spec(32, 2, 1, 16.0,
                  _v(qs=lambda n, k: (n, k // 32, 16), qh=lambda n, k: (n, k // 32, 4), d=_k32, m=_k32)),
    # qs: 4 chunks of 32 bytes per super-block, as rows of a [N, 4 K/256, 32] view
    "q4_k": _Spec(256, 8, 8, 8.0, _v(qs=lambda n, k: (n, k // 64, 32), sc=lambda n, k: (n, k // 256, 8),
                                     m=lambda n, k: (n, k // 256, 8), d=_k256, dmin=_k256)),
    "q5_k": _Spec(256, 8, 8, 16.0, _v(qs=lambda n, k: (n, k // 64, 32), qh=lambda n, k: (n, k // 256, 32),
                                     sc=lambda n, k: (n, k // 256, 8), m=lambda n, k: (n, k // 256, 8),
                                     d=_k256, dmin=_k256)),
    # ql: 8 rows of 16 bytes per super-block, qh: 4 rows of 16; 16 sub-blocks of 16 elements
    "q6_k": _Spec(256, 16, 16, 32.0, _v(ql=lambda n, k: (n, k // 32, 16), qh=lambda n, k: (n, k // 64, 16),
                                       sc=lambda n, k: (n, k // 256, 16), d=_k256)),
}
SUPPORTED_FORMATS = tuple(SPECS)


class _Group(NamedTuple):
    """One scale group of S units x BN rows: w = scale * (q - zero point) + bias for its parts'
    codes q. The parts carry the codes as floats f = 2 + q/c (c = code_scale, see _Codes), and
    `offset` = 2c + zero point, so that w = a f + b with a = c * scale, b = bias - offset * scale:
    one FMA per weight, and sum w*x = a sum f*x + b sum x."""

    scale: jax.Array  # [BN, S] f32
    bias: jax.Array | None  # [BN, S] f32
    offset: float
    parts: list[tuple[int, jax.Array]]  # (part index p, codes [BN, S, L] f32)


def _bits_to_f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def _prmt_asm(setup: str, sel_base: int, post: str = "") -> str:
    """PTX: `t` = setup(inputs); output i = PRMT(t, e, selector with byte i of t at sel_base)."""
    lines = ["{", ".reg .b32 t, e;"]
    lines.append("mov.b32 e, 0x40000000;" if sel_base == 2 else "mov.b32 e, 0x4B000000;")
    lines.append(setup)
    for i in range(4):
        sel = 0x7044 | (i << 8) if sel_base == 2 else 0x7440 | i
        lines.append(f"prmt.b32 ${i}, t, e, {hex(sel)};")
        if post:
            lines.append(post.replace("$i", f"${i}"))
    lines.append("}")
    return "\n".join(lines)


def _asm(asm: str, *args: jax.Array) -> jax.Array:
    # pack=4: each asm instance takes four consecutive uint8 codes in one 32-bit register and
    # writes four f32 registers. One result per call: multi-result inline asm is mis-lowered by
    # Pallas (jax 0.10.2: "2 outvars do not match 1 outvals").
    n_in = len(args)
    constraints = ",".join(["=r"] * 4 + ["r"] * n_in)
    out = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
    return plt.elementwise_inline_asm(asm, args=list(args), constraints=constraints, pack=4,
                                      result_shape_dtypes=[out])[0]


class _Codes:
    """Code -> float conversions, inline PTX on the GPU or the bit-identical jnp twin.

    A b-bit code q (b = 4, 5, 6) becomes f = 2 + q / 2^(b-1): its byte, shifted left by 7 - b,
    is permuted into bits 16..23 under the exponent of 2.0 (bit 23 stays 0). The constant 2 is
    at most 2^b / q_mean ~ 2 times the code term, so removing it later costs about one bit."""

    def __init__(self, use_asm: bool):
        self.use_asm = use_asm

    def code(self, qs: jax.Array, shift: int, qh: jax.Array | None = None, hshift: int = 0,
             hbits: int = 0) -> jax.Array:
        """f32 2 + q/2^(b-1), b = 4 + hbits, for q = ((qs >> shift) & 15) | ((qh >> hshift) & (2^hbits - 1)) << 4,
        elementwise over uint8 codes qs (and qh, same shape)."""
        if self.use_asm:
            return _asm(code_asm(shift, hshift, hbits), *([qs] if qh is None else [qs, qh]))
        q = (qs.astype(jnp.uint32) >> shift) & 0x0F
        if hbits:
            q = q | (((qh.astype(jnp.uint32) >> hshift) & ((1 << hbits) - 1)) << 4)
        return _bits_to_f32((q << (23 - (4 + hbits))) | 0x40000000)

    def signed_byte(self, qs: jax.Array) -> jax.Array:
        """f32 q for int8 codes (exact): bits 2^23 + (q + 128), minus 2^23 + 128."""
        if self.use_asm:
            return _asm(SIGNED_BYTE_ASM, lax.bitcast_convert_type(qs, jnp.uint8))
        return qs.astype(jnp.int32).astype(jnp.float32)


def code_asm(shift: int, hshift: int = 0, hbits: int = 0) -> str:
    """The PTX of `_Codes.code` for one 32-bit register of four codes ($4: qs bytes, $5: qh bytes)."""
    bits = 4 + hbits
    if not hbits:  # 4-bit: shift the nibble straight to bits 3..6 of its byte, then mask
        move = "shl.b32 t, $4, 3;" if shift == 0 else f"shr.b32 t, $4, {shift - 3};"
        return _prmt_asm(f"{move}\nand.b32 t, t, 0x78787878;", 2)
    rep = int.from_bytes(bytes([(1 << hbits) - 1] * 4), "little")
    lines = [
        ".reg .b32 h;",
        "and.b32 t, $4, 0x0F0F0F0F;" if shift == 0 else f"shr.b32 t, $4, {shift};\nand.b32 t, t, 0x0F0F0F0F;",
        f"shr.b32 h, $5, {hshift};" if hshift else "mov.b32 h, $5;",
        f"and.b32 h, h, {hex(rep)};",
        "shl.b32 h, h, 4;",
        "or.b32 t, t, h;",
        f"shl.b32 t, t, {7 - bits};",  # no carry across bytes: q << (7 - b) < 128
    ]
    return _prmt_asm("\n".join(lines), 2)


SIGNED_BYTE_ASM = _prmt_asm("xor.b32 t, $4, 0x80808080;", 23, post="sub.f32 $i, $i, 0f4B000080;")


class _LayerPlanes:
    """The planes of one matrix of a stacked weight, read in place: `planes[name][idx]` loads
    `ref[(layer, *idx)]` from the kernel ref of the whole [L, BN, ...] stack, one indexer (the
    Triton lowering takes no chained indexers). A single matrix is a stack of one (layer 0)."""

    def __init__(self, refs: dict, layer):
        self._refs, self._layer = refs, layer

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def __getitem__(self, name: str) -> "_InLayer":
        return _InLayer(self._refs[name], self._layer)


class _InLayer:
    def __init__(self, ref, layer):
        self._ref, self._layer = ref, layer

    def __getitem__(self, idx):
        return self._ref[(self._layer, *(idx if isinstance(idx, tuple) else (idx,)))]


def _f32(ref_slice: jax.Array) -> jax.Array:
    return ref_slice.astype(jnp.float32)


def _decode(fmt: str, planes: dict, g0, s: int, codes: _Codes) -> Iterator[_Group]:
    """The scale groups of units [g0, g0 + s) of the block's BN rows (planes are kernel refs of
    the views in SPECS). Yields lazily so that each group's codes die before the next is made."""
    ds = pl.ds
    if fmt == "q8_0":
        yield _Group(_f32(planes["d"][:, ds(g0, s)]), None, 0.0,
                     [(0, codes.signed_byte(planes["qs"][:, ds(g0, s), :]))])
    elif fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        qs = planes["qs"][:, ds(g0, s), :]  # [BN, S, 16]: byte l holds elements l and 16 + l
        d = _f32(planes["d"][:, ds(g0, s)])
        bias = _f32(planes["m"][:, ds(g0, s)]) if "m" in planes else None
        if fmt in ("q4_0", "q4_1"):
            parts = [(h, codes.code(qs, 4 * h)) for h in range(2)]
        else:
            # qh: bit j of the block's 32-bit word is the 5th bit of element j. Spread to one
            # byte per element in plain jnp (the 5-bit 32-blocks are not the fast path).
            qh = planes["qh"][:, ds(g0, s), :].astype(jnp.uint32)  # [BN, S, 4]
            word = jnp.sum(qh << (8 * lax.broadcasted_iota(jnp.uint32, (1, 1, 4), 2)), axis=-1)  # [BN, S]
            lane = lax.broadcasted_iota(jnp.uint32, (1, 1, 16), 2)
            parts = []
            for h in range(2):
                hb = ((word[:, :, None] >> (lane + 16 * h)) & 1).astype(jnp.uint8)  # [BN, S, 16]
                parts.append((h, codes.code(qs, 4 * h, hb, 0, 1)))
        # 2^b from the code (see _Codes) plus the zero point of q4_0 (8) and q5_0 (16)
        offset = {"q4_0": 24.0, "q4_1": 16.0, "q5_0": 48.0, "q5_1": 32.0}[fmt]
        yield _Group(d, bias, offset, parts)
    elif fmt in ("q4_k", "q5_k"):
        d = _f32(planes["d"][:, ds(g0, s)])
        dmin = _f32(planes["dmin"][:, ds(g0, s)])
        qh = planes["qh"][:, ds(g0, s), :] if fmt == "q5_k" else None  # [BN, S, 32]: bit p of byte l
        for c in range(4):  # chunk c: low nibbles are sub-block 2c, high nibbles 2c + 1
            qs = planes["qs"][:, ds(4 * g0 + c, s, stride=4), :]  # [BN, S, 32]
            for h in range(2):
                p = 2 * c + h
                scale = d * _f32(planes["sc"][:, ds(g0, s), p])
                bias = -(dmin * _f32(planes["m"][:, ds(g0, s), p]))
                f = codes.code(qs, 4 * h) if qh is None else codes.code(qs, 4 * h, qh, p, 1)
                yield _Group(scale, bias, 16.0 if qh is None else 32.0, [(p, f)])
    elif fmt == "q6_k":
        # Element 128 c + 32 (2 n + i) + 16 hh + l' (c, n, i, hh in {0, 1}, l' < 16) of super-block
        # j is nibble n of byte l' of ql row 8 j + 2 (2 c + i) + hh, with bits 2 (2 n + i) of qh row
        # 4 j + 2 c + hh as its top 2 bits: part p = 2 (4 c + 2 n + i) + hh, sub-block p, scale sc[p].
        d = _f32(planes["d"][:, ds(g0, s)])
        for c in range(2):
            for hh in range(2):
                qh = planes["qh"][:, ds(4 * g0 + 2 * c + hh, s, stride=4), :]  # [BN, S, 16]
                for i in range(2):
                    ql = planes["ql"][:, ds(8 * g0 + 2 * (2 * c + i) + hh, s, stride=8), :]
                    for n in range(2):
                        p = 2 * (4 * c + 2 * n + i) + hh
                        scale = d * _f32(planes["sc"][:, ds(g0, s), p])
                        yield _Group(scale, None, 96.0, [(p, codes.code(ql, 4 * n, qh, 2 * (2 * n + i), 2))])
    else:
        raise NotImplementedError(f"triton matmul: no decoder for {fmt}")


# ---------------------------------------------------------------------------------------------
# kernels


def _fma_kernel(x_ref, xs_ref, layer_ref, *refs, fmt: str, names: Sequence[str], s: int, steps: int, m: int,
                use_asm: bool):
    """x_ref [P, M, G, L] f32 (parts split out), xs_ref [NG, M, G] f32 (sums of x over each scale
    group), layer_ref [1] int32, planes (all layers' block of BN rows), out_ref [M, BN] (this
    split's partial sums)."""
    *plane_refs, out_ref = refs
    planes = _LayerPlanes(dict(zip(names, plane_refs)), layer_ref[0])
    spec = SPECS[fmt]
    codes = _Codes(use_asm)
    block_n = out_ref.shape[-1]
    parts_per_group = spec.num_parts // spec.num_groups
    first = pl.program_id(1) * (steps * s)

    def step(i, accs):
        g0 = pl.multiple_of(first + i * s, s)
        accs = list(accs)
        for group in _decode(fmt, planes, g0, s, codes):
            a = spec.code_scale * group.scale  # w = a f + b
            b = -group.offset * group.scale if group.bias is None else group.bias - group.offset * group.scale
            gi = group.parts[0][0] // parts_per_group
            for r in range(m):
                # sum w x = a sum f x + b sum x; one reduction per part: a sum of products
                # lowers to an FMA chain per thread
                dot = None
                for p, f in group.parts:
                    part = jnp.sum(f * x_ref[p, r, pl.ds(g0, s), :][None], axis=-1)  # [BN, S]
                    dot = part if dot is None else dot + part
                accs[r] = accs[r] + a * dot + b * xs_ref[gi, r, pl.ds(g0, s)][None, :]
        return tuple(accs)

    zeros = tuple(jnp.zeros((block_n, s), jnp.float32) for _ in range(m))
    accs = lax.fori_loop(0, steps, step, zeros)
    for r in range(m):
        out_ref[r, :] = jnp.sum(accs[r], axis=1)


def _mma_kernel(x_ref, layer_ref, *refs, fmt: str, names: Sequence[str], s: int, steps: int, m: int,
                use_asm: bool, f32_x: bool, mask_rows: bool):
    """x_ref [P, BM, K/P] (parts split out; bf16, or f32 for the 3-pass algorithm), layer_ref [1]
    int32, planes (all layers' block of BN rows), out_ref [BM, BN]: rows of x past `m` are
    padding and, if `mask_rows`, not written."""
    *plane_refs, out_ref = refs
    planes = _LayerPlanes(dict(zip(names, plane_refs)), layer_ref[0])
    spec = SPECS[fmt]
    codes = _Codes(use_asm)
    block_m, block_n = out_ref.shape
    lanes = spec.unit // spec.num_parts
    first = pl.program_id(2) * (steps * s)
    if f32_x:
        precision, w_dtype = lax.DotAlgorithmPreset.BF16_BF16_F32_X3, jnp.float32
    else:
        precision, w_dtype = None, x_ref.dtype

    def step(i, acc):
        g0 = pl.multiple_of(first + i * s, s)
        for group in _decode(fmt, planes, g0, s, codes):
            a = spec.code_scale * group.scale  # w = a f + b, one FMA per weight
            b = -group.offset * group.scale if group.bias is None else group.bias - group.offset * group.scale
            for p, f in group.parts:
                w = (f * a[:, :, None] + b[:, :, None]).reshape(block_n, s * lanes).astype(w_dtype)
                xp = x_ref[p, :, pl.ds(g0 * lanes, s * lanes)]  # [BM, S*L]
                # dot + acc (this order) is what Triton folds into the MMA's accumulator input
                acc = lax.dot_general(w, xp, (((1,), (1,)), ((), ())), precision=precision,
                                      preferred_element_type=jnp.float32) + acc  # [BN, BM]
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_n, block_m), jnp.float32))
    out = acc.T  # [BM, BN]
    if mask_rows:
        row = pl.program_id(1) * block_m + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        plt.store(out_ref, out, mask=row < m)
    else:
        out_ref[...] = out


# ---------------------------------------------------------------------------------------------
# wrapper


def _check_supported(w: QuantizedTensor, layer) -> None:
    if w.fmt not in SPECS:
        raise NotImplementedError(f"triton matmul takes {', '.join(SUPPORTED_FORMATS)}; not {w.fmt}")
    check_layer(w, layer)
    n, k = w.shape
    spec = SPECS[w.fmt]
    if k % spec.unit:
        raise NotImplementedError(f"triton matmul {w.fmt}: K={k} is not a multiple of {spec.unit}")
    if n % 16:
        raise NotImplementedError(f"triton matmul: N={n} is not a multiple of 16")


def _largest_pow2_divisor(value: int, cap: int) -> int:
    out = 1
    while out * 2 <= cap and value % (out * 2) == 0:
        out *= 2
    return out


def default_tuning(fmt: str, m: int, n: int, k: int, x_dtype) -> TritonMatmulTuning:
    """A per-shape choice, from what bench/kernels.py --grid measured on the H200.

    Decode is bound by the weight bytes: the fma kernel for one row of bf16 x (up to two rows
    of f32 x, where it is the exact path and the 3-pass MMA is dear), else tensor cores. For
    the MMA decode kernel (M = the engine's 8 slots), short K steps (128 elements of a 32-block
    format) in 4 stages, 64 rows, and split-K to about 2 programs per SM beat every other
    point of a grid of up to 46 tunings per Llama-2-7B shape (Q4_0, 2026-11-29: 12-30% faster than
    256-element steps in 3 stages). The split is any divisor of the K steps (K = 11008 has 43
    steps of 256: powers of 2 left its 64 programs on half the SMs). With f32 x the MMA
    operands are split in three (registers), so its K steps are halved. Q6_K decode is the
    exception: two super-blocks per step in 2 stages where K allows (measured on the 7B output
    head only, M = 8, bf16 x; the same shared memory in flight as one super-block in 4)."""
    spec = SPECS[fmt]
    units = k // spec.unit
    is_f32 = jnp.dtype(x_dtype) == jnp.float32

    def step(elements: int) -> int:  # block_k: about `elements`, a whole number of units dividing K
        return _largest_pow2_divisor(units, max(1, elements // spec.unit)) * spec.unit

    if m > 64:  # prefill: compute-bound, big tensor-core tiles (larger K steps spilled)
        block_k = step((128 if is_f32 else 256) if spec.unit == 32 else (256 if is_f32 else 512))
        if spec.unit == 256:
            # 512-element steps of a stacked K-quant weight (the layer read in place) asked for
            # 311,808 bytes of shared memory on the H200 for Q6_K (limit 232,448); Q4_K and Q5_K
            # failed the same way. One super-block per step fits.
            block_k = spec.unit
        # Three stages of 128x256 bf16 tiles asked for 233,472 bytes of shared memory on the H200
        # (limit 232,448); two fit.
        return TritonMatmulTuning("mma", block_n=_largest_pow2_divisor(n, 128), block_k=block_k,
                                  block_m=64 if is_f32 else 128, num_warps=8, num_stages=2)
    if m <= (2 if is_f32 else 1):
        kernel, block_k, block_m, stages, target = "fma", step(256), 16, 1, 4 * 132
    else:
        kernel, block_k, block_m, stages, target = "mma", step(128), max(16, 1 << (m - 1).bit_length()), 4, 2 * 132
        if fmt == "q6_k" and step(512) == 512:
            # two super-blocks per step in 2 stages: the Llama-2-7B Q6_K output head (32000x4096,
            # M = 8) took 169 us against 215 us with one super-block in 4 stages, the best of 12
            # grid points (bench/results/kernels-2026-11-29-180859.md)
            block_k, stages = 512, 2
    block_n = _largest_pow2_divisor(n, 64)
    steps = units // (block_k // spec.unit)
    # the smallest split reaching `target` programs; at least 2 where that leaves each program
    # 8 steps or more (measured: 22016x4096 split in 2 beat 1 at 344 programs)
    least = 2 if kernel == "mma" and steps % 2 == 0 and steps >= 16 else 1
    split = next((d for d in range(least, steps + 1) if steps % d == 0 and (n // block_n) * d >= target), steps)
    # 2 warps for the wide 32-block matrices (fused gate/up and q/k/v of a 7B): 5-9% faster per
    # call in the served step (bench/trace_step.py --matmul-warps 2); no gain on the others. And
    # for Q6_K matrices of 16k rows or more (output heads; also a Q6_K model's fused gate/up,
    # not measured): 134 us against 167 us with 4 warps on the Llama-2-7B head at M = 8, the
    # best of 16 tunings (bench/results/kernels-2026-11-30-013938.md).
    wide = (spec.unit == 32 and n >= 8192) or (fmt == "q6_k" and n >= 16384)
    warps = 2 if kernel == "mma" and wide else 4
    return TritonMatmulTuning(kernel, block_n=block_n, block_k=block_k, split_k=split, block_m=block_m,
                              num_warps=warps, num_stages=stages)


def check_tiling(fmt: str, n: int, k: int, tuning: TritonMatmulTuning) -> None:
    """Raises ValueError unless `tuning` tiles a [N, K] weight of format `fmt` exactly."""
    unit = SPECS[fmt].unit
    if tuning.block_k % unit:
        raise ValueError(f"{fmt}: block_k={tuning.block_k} is not a multiple of the unit {unit}")
    units, s = k // unit, tuning.block_k // unit
    if n % tuning.block_n or units % (s * tuning.split_k):
        raise ValueError(f"{fmt} [{n}, {k}]: tuning {tuning} does not tile N (block_n) or the "
                         f"{units} units of K (block_k * split_k)")


def _plane_views(w: QuantizedTensor, spec: _Spec) -> dict[str, jax.Array]:
    """The kernel views of the planes with a leading stack dim [L, ...] (L = 1 for a single
    matrix): free reshapes, except for a transposed plane (quant.QuantFormat.transposed: the
    q4_0/q8_0 scales, held [L, K/32, N] for the Mosaic GPU decode kernel), which these kernels
    read row-major: XLA transposes it (for a stack, once per program, hoisted out of the layer
    loop: about 0.25 ms per step of a 7B model on the H200, small beside a prefill chunk)."""
    n, k = w.shape
    stack = w.stack_shape or (1,)
    planes = row_major_planes(w)
    flat = {name: jnp.reshape(p, (-1, *p.shape[-1:])) for name, p in planes.items()}  # [L*N, X]
    views = spec.views(flat, stack[0] * n, k)
    return {name: jnp.reshape(v, (stack[0], n, *v.shape[1:])) for name, v in views.items()}


def _row_spec(a: jax.Array, block_n: int, grid_rank: int) -> pl.BlockSpec:
    """Every layer of a block of BN rows (the kernel picks its layer by index)."""
    trailing = (0,) * (a.ndim - 2)
    block = (a.shape[0], block_n, *a.shape[2:])
    if grid_rank == 2:
        return pl.BlockSpec(block, lambda i, s: (0, i, *trailing))
    return pl.BlockSpec(block, lambda i, j, s: (0, i, *trailing))


def x_parts(x2: jax.Array, unit: int, num_parts: int) -> jax.Array:
    """x [M, K] -> [P, M, K/P] with every part's elements contiguous (the module docstring):
    x_parts[p, m, g*L + l] = x[m, g*U + p*L + l], U = `unit`, P = `num_parts`, L = U/P. For
    Q4_0 (U 32, P 2) part p is what nibble p of each byte of the codes meets."""
    m, k = x2.shape
    lanes = unit // num_parts
    xg = jnp.reshape(x2, (m, k // unit, num_parts, lanes))
    return jnp.reshape(jnp.transpose(xg, (2, 0, 1, 3)), (num_parts, m, k // num_parts))


def qmatmul_triton(
    x: jax.Array,  # [..., K] f32 or bf16
    w: QuantizedTensor,  # [N, K], or a stack [L, N, K] with `layer`
    tuning: TritonMatmulTuning | None = None,
    *,
    layer: jax.Array | int | None = None,  # which matrix of a stacked w (may be traced)
    interpret: bool = False,
) -> jax.Array:  # [..., N] f32
    """x @ dequant(w).T through the Pallas Triton kernels. Raises NotImplementedError for formats
    and shapes it does not take (float weights, q2_k/q3_k, N not a multiple of 16). A stacked w
    is read in place at `layer` (no copy of the matrix is made). "q4_k_split" (Q4_K split at
    load, pallas_kernels/q4_k_split.py) runs as its Q4_0 part plus an XLA dot for its offsets,
    and the other formats of `q4_k_split.OFFSET_FORMS` likewise on their block format's kernel."""
    if w.fmt in q4_k_split.OFFSET_FORMS:
        return q4_k_split.matmul_via(qmatmul_triton, x, w, layer, tuning=tuning, interpret=interpret)
    _check_supported(w, layer)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {list(x.shape)} does not match weight [{n}, {k}]")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise NotImplementedError(f"triton matmul takes f32 or bf16 x, not {x.dtype}")
    lead = x.shape[:-1]
    x2 = jnp.reshape(x, (-1, k))
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    tuning = tuning or default_tuning(w.fmt, m, n, k, x.dtype)
    check_tiling(w.fmt, n, k, tuning)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    y = _qmatmul_jit(x2, w, layer_arr, tuning=tuning, interpret=interpret)
    return jnp.reshape(y, (*lead, n))


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def _qmatmul_jit(
    x2: jax.Array,  # [M, K]
    w: QuantizedTensor,  # [N, K] or [L, N, K]
    layer_arr: jax.Array,  # [1] int32
    tuning: TritonMatmulTuning,
    interpret: bool,
) -> jax.Array:  # [M, N] f32
    # A jit of its own, so that a program with many matmuls of one shape (a model's layers
    # unrolled, the benchmark's distinct matrices) traces and lowers the kernel once.
    spec = SPECS[w.fmt]
    n, k = w.shape
    m = x2.shape[0]
    units = k // spec.unit
    s = tuning.block_k // spec.unit
    steps = units // (s * tuning.split_k)
    lanes = spec.unit // spec.num_parts
    views = _plane_views(w, spec)
    names = tuple(views)
    use_asm = tuning.use_asm and not interpret
    params = _TRITON_PARAMS(num_warps=tuning.num_warps, num_stages=tuning.num_stages)

    # x with parts split out: x[m, g*U + p*L + l] at [p, m, g, l], so that a part of the weight
    # meets a contiguous block of x. Small next to the weights, computed once per x (XLA fuses it
    # into x's producer or shares it between matmuls of the same x and format).
    xg = jnp.reshape(x2, (m, units, spec.num_parts, lanes))
    if tuning.kernel == "fma":
        xf = xg.astype(jnp.float32)
        xf_parts = jnp.transpose(xf, (2, 0, 1, 3))  # [P, M, G, L]
        groups = jnp.reshape(xf, (m, units, spec.num_groups, spec.unit // spec.num_groups))
        xs = jnp.transpose(jnp.sum(groups, axis=-1), (2, 0, 1))  # [NG, M, G]
        kernel = functools.partial(_fma_kernel, fmt=w.fmt, names=names, s=s, steps=steps, m=m, use_asm=use_asm)
        partial = pl.pallas_call(
            kernel,
            grid=(n // tuning.block_n, tuning.split_k),
            in_specs=[
                pl.BlockSpec(xf_parts.shape, lambda i, j: (0, 0, 0, 0)),
                pl.BlockSpec(xs.shape, lambda i, j: (0, 0, 0)),
                pl.BlockSpec((1,), lambda i, j: (0,)),
                *[_row_spec(v, tuning.block_n, 2) for v in views.values()],
            ],
            out_specs=pl.BlockSpec((None, m, tuning.block_n), lambda i, j: (j, 0, i)),
            out_shape=jax.ShapeDtypeStruct((tuning.split_k, m, n), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name=f"qmatmul_fma_{w.fmt}",
        )(xf_parts, xs, layer_arr, *views.values())  # [split, M, N]
    else:
        f32_x = x2.dtype == jnp.float32
        bm = tuning.block_m
        m_pad = -(-m // bm) * bm
        xp = x_parts(x2, spec.unit, spec.num_parts)
        if m_pad != m:
            xp = jnp.pad(xp, ((0, 0), (0, m_pad - m), (0, 0)))
        kernel = functools.partial(_mma_kernel, fmt=w.fmt, names=names, s=s, steps=steps, m=m, use_asm=use_asm,
                                   f32_x=f32_x, mask_rows=m_pad != m)
        grid = (n // tuning.block_n, m_pad // bm, tuning.split_k)
        partial = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[
                pl.BlockSpec((spec.num_parts, bm, k // spec.num_parts), lambda i, j, s_: (0, j, 0)),
                pl.BlockSpec((1,), lambda i, j, s_: (0,)),
                *[_row_spec(v, tuning.block_n, 3) for v in views.values()],
            ],
            out_specs=pl.BlockSpec((None, bm, tuning.block_n), lambda i, j, s_: (s_, j, i)),
            out_shape=jax.ShapeDtypeStruct((tuning.split_k, m_pad, n), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name=f"qmatmul_mma_{w.fmt}",
        )(xp, layer_arr, *views.values())[:, :m]  # [split, M, N]
    return partial[0] if tuning.split_k == 1 else jnp.sum(partial, axis=0)


registry.register("matmul", "triton", qmatmul_triton, is_available=lambda: jax.default_backend() == "gpu",
                  priority=10)
