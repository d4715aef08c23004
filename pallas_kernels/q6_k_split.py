"""Q6_K weights split into int8 codes ("q6_k_split") or 6-bit codes in two planes
("q6_k_split6", the default, below) and one f16 scale per 16 weights, so that the Mosaic GPU
matmul can serve Q6_K files' Q6_K matrices (in a Q4_K_M file: `attn_v` and
`ffn_down` of half the layers, and the output matrix). Through the Triton Q6_K kernel they
took a third of a 7B Q4_K_M decode step on the H200 once its Q4_K matrices were split
(bench/results, fourteenth session).

A Q6_K super-block of 256 weights holds 6-bit codes q (0..63), a signed 8-bit scale sc_j per
16 weights and one f16 d (llama.cpp): w = d sc_j (q - 32). Split:

    w' = s_j (q - 32),   s_j = f16(d sc_j)

The codes keep their bits, as int8 (q - 32, -32..31) in natural order; d sc_j (up to 19
significant bits) is rounded to f16, so a weight moves by at most 2^-11 of d sc_j times 32, i.e.
2^-11 of its scale's full range; |d sc_j| >= |d| (or 0), so a scale is never smaller than the
file's own f16 d. Format "q6_k_split" (`quant.DERIVED_FORMATS`): planes `qs` [N, K] int8 and `d`
[K/16, N] f16 (transposed, as Q8_0's scales, so that a 16-block's scales are contiguous).

Bytes per weight: 1 + 2/16 = 1.125, against Q6_K's 0.8203 (37% more).

Made at load with `EngineConfig.split_q6_k` (`--split-q6-k`) for the matrices the Mosaic kernel
takes (N a multiple of 64: `takes`, judged on a fused matrix's rows). No other GPU kernel serves
the format: "auto" splits only where the Mosaic matmul serves it; "on" elsewhere (a GPU before
Hopper, tensor parallelism) leaves the split matrices to the reference, with a warning at load.
The reference dequantizes it directly.

Format "q6_k_split6" keeps the codes' 6 bits: the same scales, and the codes q (0..63) as a low
nibble plane `qs` [N, K/2] uint8 (16 bytes per 32 weights) and a plane of the high two bits `qh`
[N, K/4] uint8 (16 bytes per 64 weights), 0.5 + 0.25 + 2/16 = 0.875 bytes per weight (7% over
Q6_K's own, 22% under "q6_k_split"'s). Both planes are laid out for the Mosaic GPU matmul's
32-bit loads (`split_q6_k6`): thread c (0..3) of a row's quad loads bytes 4c..4c+3 of each
16-byte chunk of both planes, and finds in them the codes of its own columns of the wgmma
operand, so that the kernel makes bf16 (q - 32) pairs with shifts and masks alone, x in its
natural order (`pallas_kernels.mgpu_words.q6_words_to_bf16`). The loader makes it in place of
"q6_k_split" with `EngineConfig.q6_k_split_bits` 6, the default (8 where the jax-triton matmul,
which takes the 8-bit form only, is forced): on the H200 a 7B Q4_K_M's Mosaic matmuls took 1,851
against 1,903 us per decode step (bench/results, thirty-eighth session). The Mosaic kernel reads
it in K steps of at least 128 (`mgpu_tuning.MIN_TILE_K6`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import QK_K, QuantizedTensor, array_module

BLOCK = 16  # weights per scale
CODE_OFFSET = 32  # Q6_K weight = d sc (q - 32)
ROWS_MULTIPLE = 64  # the Mosaic matmul's weight rows per warpgroup


def takes(n: int) -> bool:
    """Whether a Q6_K matrix of N rows is split (the Mosaic kernel's rows come in 64s)."""
    return n % ROWS_MULTIPLE == 0


def split_q6_k(w: QuantizedTensor) -> QuantizedTensor:
    """Q6_K [*S, N, K] -> "q6_k_split" [*S, N, K] (see the module docstring). Numpy planes in
    (the loader, on the host) give numpy planes out; jax arrays give jax arrays."""
    if w.fmt != "q6_k":
        raise ValueError(f"split_q6_k takes q6_k, not {w.fmt}")
    xp = array_module(w)
    n, k = w.shape
    lead = tuple(w.stack_shape)
    supers = k // QK_K
    p = w.planes
    # per super-block: ql 128 bytes = 2 halves c x 2 runs i x 32 bytes, nibble h of byte
    # 64 c + 32 i + l is weight 128 c + 64 h + 32 i + l; qh 64 bytes = 2 halves x 32 bytes, bits
    # 2 (2 h + i) of byte 32 c + l are that weight's high two bits
    ql = xp.reshape(xp.asarray(p["ql"]), (*lead, n, supers, 2, 1, 2, 32))  # [.., c, h, i, l]
    qh = xp.reshape(xp.asarray(p["qh"]), (*lead, n, supers, 2, 1, 1, 32))
    shifts = np.arange(2, dtype=np.uint8)
    low = (ql >> xp.asarray((4 * shifts).reshape(2, 1, 1))) & 0x0F
    high = (qh >> xp.asarray((2 * (2 * shifts[:, None] + shifts[None, :])).astype(np.uint8).reshape(2, 2, 1))) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(CODE_OFFSET)  # [.., S, c, h, i, l]
    codes = xp.reshape(q, (*lead, n, k))
    d = xp.repeat(xp.asarray(p["d"]).astype(np.float32), QK_K // BLOCK, axis=-1)  # [.., N, K/16]
    scales = (d * xp.asarray(p["sc"]).astype(np.float32)).astype(np.float16)
    scales = xp.swapaxes(scales, -1, -2)  # [.., K/16, N]
    if xp is np:
        codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
    return QuantizedTensor({"qs": codes, "d": scales}, "q6_k_split", (n, k))


# "q6_k_split6": where weight w of a 32-block (its wgmma column; x is in natural order) sits in the
# 16 bytes of the block in `qs`, and in the 16 bytes of its 64-block in `qh` (w + 32 for the
# second 32-block). The Mosaic kernel's thread c holds columns 8 j + 2 c + h (pair j of 0..3,
# half h) and loads bytes 4c..4c+3 as one little-endian word: a column's low nibble sits at bits
# 4 j + 16 h of that word (`(word >> 4 j) & 0x000F000F` gives pair j), and its high bits, for 32-block b
# of the two, at bits 2 (4 b + j) + 16 h of its `qh` word.


def _placement() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(byte, shift) in a 32-block's `qs` bytes of each of its 32 weights, and (byte, shift) in a
    64-block's `qh` bytes of each of its 64 weights (module comment above)."""
    w = np.arange(64)
    b, col = divmod(w, 32)
    j, c, h = col // 8, (col % 8) // 2, col % 2
    lo_bit = 4 * j + 16 * h
    hi_bit = 2 * (4 * b + j) + 16 * h
    lo_byte, lo_shift = 4 * c + lo_bit // 8, lo_bit % 8
    hi_byte, hi_shift = 4 * c + hi_bit // 8, hi_bit % 8
    return lo_byte[:32], lo_shift[:32], hi_byte, hi_shift


LOW_BYTE, LOW_SHIFT, HIGH_BYTE, HIGH_SHIFT = _placement()


def split_q6_k6(w: QuantizedTensor) -> QuantizedTensor:
    """Q6_K [*S, N, K] -> "q6_k_split6" [*S, N, K] (the module docstring): `split_q6_k`'s scales
    and its codes' 6 bits in the Mosaic kernel's order. K must be a multiple of 64 (Q6_K's is of
    256)."""
    eight = split_q6_k(w)
    xp = array_module(eight)
    n, k = w.shape
    lead = tuple(w.stack_shape)
    q = (xp.asarray(eight.planes["qs"]) + np.int8(CODE_OFFSET)).astype(np.uint8)  # 0..63
    low = xp.reshape(q & 0x0F, (*lead, n, k // 32, 32))
    high = xp.reshape(q >> 4, (*lead, n, k // 64, 64))
    qs = xp.reshape(_pack(xp, low, LOW_BYTE, LOW_SHIFT, 16), (*lead, n, k // 2))
    qh = xp.reshape(_pack(xp, high, HIGH_BYTE, HIGH_SHIFT, 16), (*lead, n, k // 4))
    if xp is np:
        qs, qh = np.ascontiguousarray(qs), np.ascontiguousarray(qh)
    return QuantizedTensor({"qs": qs, "qh": qh, "d": eight.planes["d"]}, "q6_k_split6", (n, k))


def _pack(xp, values, byte, shift, nbytes: int):
    """values [.., W] uint8 (W weights of a few bits) -> bytes [.., nbytes]: weight i OR-ed in at
    byte[i] << shift[i]."""
    out = []
    for b in range(nbytes):
        idx = np.flatnonzero(byte == b)
        acc = values[..., idx[0]] << np.uint8(shift[idx[0]])
        for i in idx[1:]:
            acc = acc | (values[..., i] << np.uint8(shift[i]))
        out.append(acc)
    return xp.stack(out, axis=-1)


def codes6(planes: dict, k: int):
    """The int8 codes q - 32 [*S, N, K] in natural order of a "q6_k_split6" matrix's planes."""
    qs, qh = planes["qs"], planes["qh"]
    xp = np if isinstance(qs, np.ndarray) else jnp
    lead = qs.shape[:-1]
    qs = xp.reshape(qs, (*lead, k // 32, 16))
    qh = xp.reshape(qh, (*lead, k // 64, 16))
    low = (qs[..., LOW_BYTE] >> xp.asarray(LOW_SHIFT.astype(np.uint8))) & 0x0F  # [.., K/32, 32]
    high = (qh[..., HIGH_BYTE] >> xp.asarray(HIGH_SHIFT.astype(np.uint8))) & 0x03  # [.., K/64, 64]
    q = xp.reshape(low, (*lead, k)) | (xp.reshape(high, (*lead, k)) << 4)
    return q.astype(np.int8) - np.int8(CODE_OFFSET)
