"""Q5_K weights split into Q8_0's form (int8 codes, an f16 scale per 32 weights) plus an f16
offset per block and row, so that the Mosaic GPU matmul's 8-bit path serves Q5_K files (Q5_K_M:
every matrix but `attn_v` and `ffn_down` of some layers and the output, which are Q6_K). Through
the Triton Q5_K kernel a 7B Q5_K_M decoded at 136 tok/s for one user on the H200, a third of the
Q4_0 file's rate (bench/results, nineteenth session).

A Q5_K super-block of 256 weights holds per 32-weight sub-block b the codes q (0..31: four low
bits in `qs`, the fifth in `qh`), a 6-bit scale sc_b and a 6-bit min m_b, and per super-block f16
d and dmin: w = d sc_b q - dmin m_b (llama.cpp). Split, as `q4_k_split` does for Q4_K:

    w' = s_b (q - 16) + c_b,   s_b = f16(d sc_b),   c_b = f16(16 s_b - dmin m_b)

so x @ w'.T = q8_0_matmul(x, codes, s) + xsum @ C (`q4_k_split.offset_term`). The rounding is
q4_k_split's: w' - w = (s_b - d sc_b) q + (c_b's rounding), so a weight moves by at most 2^-11 of
d sc_b q (its scaled code) plus 2^-11 of c_b; both below bf16 x's own rounding on the GPU path.
The codes keep their five bits as int8 (q - 16, -16..15) in natural order.

Bytes per weight: 1 (codes) + 2/32 (s) + 2/32 (C) = 1.125, against Q5_K's 0.6875 (64% more):
the price of running on the 8-bit kernel, which reads them at a higher share of the bandwidth than
the Triton Q5_K kernel reads the packed bits.

Format "q5_k_split" (`quant.DERIVED_FORMATS`: planes `qs` [N, K] int8 and `d` as Q8_0's, `c`
[K/32, N] f16), made at load with `EngineConfig.split_q5_k` (`--split-q5-k`). The reference
dequantizes it (d q + c); the Mosaic GPU kernels fold them into their bf16 weights
(`fold_offsets`, in decode as in prefill: `mgpu_tuning.OFFSET_DECODE_TUNING`), and the Triton matmul
serves it through `q4_k_split.matmul_via`: its Q8_0 kernel on the codes and scales plus the
offsets' dot (`q4_k_split.OFFSET_FORMS`).
"""

from __future__ import annotations

import numpy as np

from pallas_kernels import q4_k_split
from pallas_kernels.quant import QK_K, QuantizedTensor, array_module

BLOCK = 32  # weights per Q8_0 block and per Q5_K sub-block
CODE_OFFSET = 16  # the split's weight = d (q - 16) + c


def split_q5_k(w: QuantizedTensor) -> QuantizedTensor:
    """Q5_K [*S, N, K] -> "q5_k_split" [*S, N, K] (see the module docstring). Numpy planes in
    (the loader, on the host) give numpy planes out; jax arrays give jax arrays."""
    if w.fmt != "q5_k":
        raise ValueError(f"split_q5_k takes q5_k, not {w.fmt}")
    xp = array_module(w)
    n, k = w.shape
    lead = tuple(w.stack_shape)
    supers = k // QK_K
    p = w.planes
    # per super-block: qs 128 bytes = 4 runs j of 32 bytes; nibble h of byte 32 j + l is the low
    # four bits of weight 64 j + 32 h + l, and bit 2 j + h of qh byte l its fifth
    qs = xp.reshape(xp.asarray(p["qs"]), (*lead, n, supers, 4, 1, 32))
    qh = xp.reshape(xp.asarray(p["qh"]), (*lead, n, supers, 1, 1, 32))
    nibble = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    bit = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8).reshape(4, 2, 1)
    low = (qs >> xp.asarray(nibble)) & 0x0F  # [.., S, 4, 2, 32]
    high = (qh >> xp.asarray(bit)) & 0x01
    q = (low | (high << 4)).astype(np.int8) - np.int8(CODE_OFFSET)
    codes = xp.reshape(q, (*lead, n, k))  # weight 256 s + 64 j + 32 h + l, in order
    if xp is np:
        codes = np.ascontiguousarray(codes)
    scales, offsets = q4_k_split.block_scales_and_offsets(xp, p, CODE_OFFSET)
    return QuantizedTensor({"qs": codes, "d": scales, "c": offsets}, "q5_k_split", (n, k))

