"""Q4_1, Q5_0 and Q5_1 weights (llama.cpp's "legacy" block formats beside Q4_0 and Q8_0) in the
forms the Mosaic GPU matmul takes, made at load, so that it serves them rather than the Triton
kernels: those read a 7B's matrices at 20-38% of the copy bandwidth on the H200 at M = 8 against
the Mosaic kernel's 44-98% for Q4_0 and Q8_0 (bench/results, nineteenth session).

A block of 32 weights holds codes q and an f16 scale d (Q5_0: q in 0..31, w = d (q - 16)), and
for Q4_1 and Q5_1 an f16 min m (Q4_1: q in 0..15, Q5_1: 0..31; w = d q + m). Then

    Q5_0:  w = d (q - 16)                     Q8_0's form, exactly: int8 codes q - 16, scale d
    Q4_1:  w = s (q - 8) + c,   s = bf16(d),  c = bf16(f16(m + 8 d))   q4_k_split's form (Q4_0's codes)
    Q5_1:  w = d (q - 16) + c,  c = f16(m + 16 d)    q5_k_split's form (Q8_0's codes and scales)

Q5_1's scales keep their f16 values; only its offset c is rounded, by at most 2^-11 of itself
(2^-25 absolute below f16's normal range), which a dot with bf16 x (the GPU path) does not
resolve. Q4_1's split holds its scales and offsets in bf16, as q4_k_split does: the values the
folded Mosaic kernel (its GPU default in decode and prefill) rounds them to, so the kernel's
products are those of f16 planes bit for bit, without its conversions from f16 (on the H200 at
M = 8 its calls took 5-6% less, 11008 x 4096 12.1 against 12.9 us, and a synthetic Llama-2-7B
Q4_1 decoded 3-4% faster, 430 / 1,704 / 3,294 tok/s at 1 / 4 / 8 users against 414 / 1,643 /
3,184; bench/results, thirty-seventh session); every other reader (Triton, the unfolded Mosaic
kernel, the reference) sees a weight move by up to 2^-8 of its scaled code plus about 2^-8 of
its offset (2^-8 + 2^-11: rounded to f16 first).
Bytes per weight: Q4_1's split 0.625, as Q4_1; Q5_0 as Q8_0 1.0625 against 0.6875; Q5_1's split
1.125 against 0.75.

Formats "q4_1_split" and "q5_1_split" (`quant.DERIVED_FORMATS`: planes `qs`, `d`, `c` as
q4_k_split's and q5_k_split's); Q5_0 becomes plain
"q8_0". Made with `EngineConfig.split_legacy` (`--split-legacy`, auto by default: on the H200
synthetic 7B Q4_1, Q5_0 and Q5_1 files decoded 1.75-1.81x faster split, bench/results, twentieth
session), for the matrices whose shape the Mosaic kernel takes (`model.weights.is_split`; the
others keep Triton's kernels for their format); the kernels treat them as the K-quant splits of the
same form (`q4_k_split.OFFSET_FORMS`).
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.q4_k_split import as_bf16, transposed
from pallas_kernels.quant import QuantizedTensor, array_module

BLOCK = 32


def _offsets(xp, w: QuantizedTensor, code_offset: int):
    """c = f16(m + code_offset d), [.., K/32, N]."""
    d, m = (xp.asarray(w.planes[p]).astype(np.float32) for p in ("d", "m"))
    return transposed(xp, (m + code_offset * d).astype(np.float16))


def _five_bit_codes(xp, w: QuantizedTensor):
    """Q5_0 / Q5_1 codes q - 16 as int8 [.., N, K] in natural order: qs byte l holds elements l
    (low nibble) and 16 + l (high); bit j of the block's 32-bit qh (byte j / 8, bit j % 8) is
    element j's fifth."""
    n, k = w.shape
    lead = tuple(w.stack_shape)
    blocks = k // BLOCK
    qs = xp.reshape(xp.asarray(w.planes["qs"]), (*lead, n, blocks, 1, 16))
    low = (qs >> xp.asarray(np.array([0, 4], dtype=np.uint8).reshape(2, 1))) & 0x0F  # [.., B, 2, 16]
    qh = xp.reshape(xp.asarray(w.planes["qh"]), (*lead, n, blocks, 4, 1))
    high = (qh >> xp.asarray(np.arange(8, dtype=np.uint8))) & 0x01  # [.., B, 4, 8]: element 8 byte + bit
    q = low | (xp.reshape(high, (*lead, n, blocks, 2, 16)) << 4)
    codes = xp.reshape(q.astype(np.int8) - np.int8(16), (*lead, n, k))
    return np.ascontiguousarray(codes) if xp is np else codes


def _scales(xp, w: QuantizedTensor):
    return transposed(xp, xp.asarray(w.planes["d"]))


def q5_0_as_q8_0(w: QuantizedTensor) -> QuantizedTensor:
    """Q5_0 [*S, N, K] -> Q8_0 [*S, N, K], the same weights exactly."""
    if w.fmt != "q5_0":
        raise ValueError(f"q5_0_as_q8_0 takes q5_0, not {w.fmt}")
    xp = array_module(w)
    return QuantizedTensor({"qs": _five_bit_codes(xp, w), "d": _scales(xp, w)}, "q8_0", w.shape)


def split_q4_1(w: QuantizedTensor) -> QuantizedTensor:
    """Q4_1 [*S, N, K] -> "q4_1_split" [*S, N, K]: Q4_1's codes are Q4_0's layout, kept as they are."""
    if w.fmt != "q4_1":
        raise ValueError(f"split_q4_1 takes q4_1, not {w.fmt}")
    xp = array_module(w)
    return QuantizedTensor({"qs": w.planes["qs"], "d": as_bf16(xp, _scales(xp, w)),
                            "c": as_bf16(xp, _offsets(xp, w, 8))}, "q4_1_split", w.shape)


def split_q5_1(w: QuantizedTensor) -> QuantizedTensor:
    """Q5_1 [*S, N, K] -> "q5_1_split" [*S, N, K]."""
    if w.fmt != "q5_1":
        raise ValueError(f"split_q5_1 takes q5_1, not {w.fmt}")
    xp = array_module(w)
    return QuantizedTensor({"qs": _five_bit_codes(xp, w), "d": _scales(xp, w), "c": _offsets(xp, w, 16)},
                           "q5_1_split", w.shape)
