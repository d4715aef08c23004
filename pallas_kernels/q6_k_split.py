"""Q6_K weights split into int8 codes and one f16 scale per 16 weights, so that the Mosaic GPU
matmul's 8-bit path can serve Q6_K files' Q6_K matrices (in a Q4_K_M file: `attn_v` and
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
"""

from __future__ import annotations

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
