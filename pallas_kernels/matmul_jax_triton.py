"""Quantized matmul as hand-written Triton kernels called through jax-triton (`jax_triton.triton_call`):
implementation "jax_triton" of op "matmul", issue 5's third variant, for comparisons with the Pallas
kernels (`matmul_mgpu.py`, `matmul_triton.py`) on the same planes. Never chosen unless forced
(`--kernels matmul=jax_triton`; bench/kernels.py `--impls jax_triton`): its priority is below
the reference's.

It needs the `jax_triton` and `triton` packages, which are not dependencies of pallas-serve:
without them (or without a CUDA GPU) the implementation is not available. jax-triton 0.3.1 runs
on the H200 image's jax 0.11.2 and Triton 3.6.0; 0.4.1 needs Triton >= 3.7 (bench/results,
twenty-fourth and twenty-fifth sessions).

Formats: Q4_0 (the `qs` plane [*S, N, K/2] uint8, GGUF's bytes: byte l of a 32-block holds weight l
in its low nibble and weight 16 + l in its high one), and the int8-code formats Q8_0 (`qs` [*S, N,
K] int8, a scale per 32 weights) and Q6_K split at load (`q6_k_split`, a scale per 16); the scales
`d` [*S, K/B, N] f16 (bf16 from the Q4_K split) are transposed (pallas_kernels/quant.py). The
formats of `q4_k_split.OFFSET_FORMS` run as their block format plus the offsets' XLA dot
(`matmul_via`).

One kernel per code width, the same plan for decode and prefill: a program owns BN weight rows
and BM rows of x (a grid axis over x's rows, masked past M) and one of `split_k` runs of K;
each K step loads its [BN, BK] codes and [BN, BK/B] scales, turns the codes into bf16 weights
with their scales folded in (the scale times the code in f32, rounded once to bf16: a weight is
off by up to 2^-8 of itself), and adds `tl.dot(w [BN, BK], x^T [BK, BM])` into an f32
accumulator. So x must be bf16 (f32 x is refused rather than rounded). Q4_0's two nibbles of a
byte are separate dots against x rearranged outside the kernel as the Pallas Triton kernels
rearrange it (`matmul_triton.x_parts`: [h, m, 16 b + l] = x[m, 32 b + 16 h + l]): no interleave
in the kernel. A code becomes a float without an
int->float conversion: (q & 15) | 0x4300 is the bf16 of 128 + q, and Q8_0's int8 converts
through f32. Partial sums [split, M, N] are added outside.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp

from pallas_kernels import matmul_triton, q4_k_split, registry
from pallas_kernels.quant import QuantizedTensor, check_layer

# Weights per scale of each format the kernels read.
BLOCK = {"q4_0": 32, "q8_0": 32, "q6_k_split": 16}
SUPPORTED_FORMATS = tuple(BLOCK)
DECODE_ROWS = 64  # x of up to this many rows runs the decode tiling (split K, one row tile)
TARGET_PROGRAMS = 256  # decode: K is split until the grid reaches about two programs per SM


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class JaxTritonMatmulTuning:
    """Tiling of one call: BM rows of x, BN weight rows and BK weights of K per program step."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if not (_is_pow2(self.block_m) and self.block_m >= 16):
            raise ValueError(f"block_m must be a power of 2 >= 16 (tl.dot), got {self.block_m}")
        if not (_is_pow2(self.block_n) and self.block_n >= 16):
            raise ValueError(f"block_n must be a power of 2 >= 16 (tl.dot), got {self.block_n}")
        if not (_is_pow2(self.block_k) and self.block_k >= 64):
            raise ValueError(f"block_k must be a power of 2 >= 64, got {self.block_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


PREFILL_TUNING = JaxTritonMatmulTuning(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)


def default_tuning(m: int, n: int, k: int) -> JaxTritonMatmulTuning:
    """Decode (m <= DECODE_ROWS): BM the next power of 2 of m (at least 16), 64 weight rows (32 or
    16 where N does not divide), K steps of 256 (128 or 64 where K does not divide), K split into
    the fewest runs of equal steps that reach TARGET_PROGRAMS programs, but no more runs than keep
    the f32 partial sums (split x M x N x 4 bytes) within half a byte per weight, Q4_0's codes
    (at M = 64 the 4096 x 11008 matrix's 43 runs would write and read 45 MB of partials for 25 MB
    of weights; that cap is reasoned, not measured). What chose the target, Q4_0 at M = 8 on the
    H200 (bench/results, twenty-fifth session): 4096 x 4096 took 9.0 us in 4 runs (256 programs)
    and 10.2 in 8 (512); 11008 x 4096 21.5 us in 2 runs (344) and 26.6 in 1 (172); 4096 x 11008
    23.2 us in 43 runs of one step (2752) and 41.0 in 4 runs of 43 steps of 64 (256).
    Prefill: PREFILL_TUNING (128 x 128 tiles), its block_n halved until it divides N."""
    if m > DECODE_ROWS:
        return dataclasses.replace(PREFILL_TUNING, block_n=_block_n(n, PREFILL_TUNING.block_n))
    bm = max(16, 1 << max(0, m - 1).bit_length())
    bn = _block_n(n, 64)
    bk = next((b for b in (256, 128, 64) if k % b == 0), 64)  # K not a multiple of 64: likewise
    steps = max(1, k // bk)
    want = -(-TARGET_PROGRAMS // max(1, n // bn))
    cap = max(1, k // (8 * m))  # split * m * n * 4 bytes <= n * k / 2
    divisors = [s for s in range(1, steps + 1) if steps % s == 0 and s <= cap]
    split = next((s for s in divisors if s >= want), divisors[-1])
    return JaxTritonMatmulTuning(block_m=bm, block_n=bn, block_k=bk, split_k=split)


def _block_n(n: int, largest: int) -> int:
    """The largest power of 2 from `largest` down to 16 that divides N (16 where none does: N not a
    multiple of 16 is refused by the call)."""
    bn = largest
    while n % bn and bn > 16:
        bn //= 2
    return bn


def check_tiling(n: int, k: int, tuning: JaxTritonMatmulTuning) -> None:
    """ValueError unless the tuning tiles an [N, K] weight."""
    if n % tuning.block_n:
        raise ValueError(f"block_n {tuning.block_n} does not tile N={n}")
    if k % (tuning.block_k * tuning.split_k):
        raise ValueError(f"block_k {tuning.block_k} x split_k {tuning.split_k} does not tile K={k}")


def is_installed() -> bool:
    """Whether jax-triton and Triton can be imported (their absence is not an error: they are
    optional; an installed package that fails to import raises when the kernels are built)."""
    return all(importlib.util.find_spec(name) is not None for name in ("jax_triton", "triton"))


def _is_available() -> bool:
    if jax.default_backend() != "gpu" or not is_installed():
        return False
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return major.isdigit() and int(major) >= 8  # bf16 tl.dot


@functools.cache
def _kernels():
    """The Triton kernels, built on first use (triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def q4_0_kernel(layer_ptr, x_ptr, qs_ptr, d_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                    STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # x_ptr: x_parts [2, M, K/2] bf16; qs_ptr: [*S, N, K/2] uint8; d_ptr: [*S, K/32, N] f16 or bf16;
        # out_ptr: [split, M, N] f32
        pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        layer = tl.load(layer_ptr).to(tl.int64)
        qs_ptr += layer * (N * (K // 2))
        d_ptr += layer * ((K // 32) * N)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        m_ok = rm < M
        half = tl.arange(0, BK // 2)  # byte 16 b + l of the step
        blocks = tl.arange(0, BK // 32)
        acc = tl.zeros((BN, BM), tl.float32)
        for step in range(STEPS):
            k0 = (pid_s * STEPS + step) * BK
            q = tl.load(qs_ptr + rn[:, None] * (K // 2) + (k0 // 2 + half)[None, :])  # [BN, BK/2]
            d = tl.load(d_ptr + (k0 // 32 + blocks)[None, :] * N + rn[:, None]).to(tl.float32)  # [BN, BK/32]
            x_off = rm[None, :] * (K // 2) + (k0 // 2 + half)[:, None]  # [BK/2, BM]
            for h in tl.static_range(2):
                nib = ((q >> (4 * h)) & 15).to(tl.uint16) | 0x4300  # bf16 bits of 128 + q
                w = nib.to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0  # q - 8, exact
                w = tl.reshape(tl.reshape(w, (BN, BK // 32, 16)) * d[:, :, None], (BN, BK // 2))
                xt = tl.load(x_ptr + h * (M * (K // 2)) + x_off, mask=m_ok[None, :], other=0.0)
                acc = tl.dot(w.to(tl.bfloat16), xt, acc)
        tl.store(out_ptr + pid_s * (M * N) + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :])

    @triton.jit
    def int8_kernel(layer_ptr, x_ptr, qs_ptr, d_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                    B: tl.constexpr, STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # x_ptr: [M, K] bf16; qs_ptr: [*S, N, K] int8; d_ptr: [*S, K/B, N] f16; out_ptr: [split, M, N] f32
        pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        layer = tl.load(layer_ptr).to(tl.int64)
        qs_ptr += layer * (N * K)
        d_ptr += layer * ((K // B) * N)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        m_ok = rm < M
        cols = tl.arange(0, BK)
        blocks = tl.arange(0, BK // B)
        acc = tl.zeros((BN, BM), tl.float32)
        for step in range(STEPS):
            k0 = (pid_s * STEPS + step) * BK
            q = tl.load(qs_ptr + rn[:, None] * K + (k0 + cols)[None, :]).to(tl.float32)  # [BN, BK]
            d = tl.load(d_ptr + (k0 // B + blocks)[None, :] * N + rn[:, None]).to(tl.float32)  # [BN, BK/B]
            w = tl.reshape(tl.reshape(q, (BN, BK // B, B)) * d[:, :, None], (BN, BK))
            xt = tl.load(x_ptr + rm[None, :] * K + (k0 + cols)[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
            acc = tl.dot(w.to(tl.bfloat16), xt, acc)
        tl.store(out_ptr + pid_s * (M * N) + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :])

    return q4_0_kernel, int8_kernel


def _check_supported(x: jax.Array, w: QuantizedTensor, layer) -> None:
    if w.fmt not in SUPPORTED_FORMATS:
        takes = ", ".join((*SUPPORTED_FORMATS, *q4_k_split.OFFSET_FORMS))
        raise NotImplementedError(f"jax_triton matmul takes {takes}; not {w.fmt}")
    check_layer(w, layer)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {list(x.shape)} does not match weight [{n}, {k}]")
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"jax_triton matmul takes bf16 x (it folds the scales into bf16 weights), "
                                  f"not {x.dtype}")
    if n % 16 or k % 64:
        raise NotImplementedError(f"jax_triton matmul: N={n} must be a multiple of 16 and K={k} of 64")


def qmatmul_jax_triton(
    x: jax.Array,  # [..., K] bf16
    w: QuantizedTensor,  # [N, K], or a stack [L, N, K] with `layer`
    tuning: JaxTritonMatmulTuning | None = None,
    *,
    layer: jax.Array | int | None = None,  # which matrix of a stacked w (may be traced)
    interpret: bool = False,
) -> jax.Array:  # [..., N] f32
    """x @ dequant(w).T through the jax-triton kernels; without a tuning, `default_tuning`.
    Raises NotImplementedError for what it does not take (formats other than those above, x not
    bf16, N not a multiple of 16 or K of 64, interpret mode)."""
    if interpret:
        raise NotImplementedError("jax_triton matmul has no interpret mode")
    if w.fmt in q4_k_split.OFFSET_FORMS:
        # the offsets' dot at the Mosaic path's precision: the kernel itself rounds weights to bf16
        return q4_k_split.matmul_via(qmatmul_jax_triton, x, w, layer, tuning=tuning,
                                     offset_precision=q4_k_split.KERNEL_OFFSET_PRECISION)
    _check_supported(x, w, layer)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = jnp.reshape(x, (-1, k))
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    tuning = tuning or default_tuning(m, n, k)
    check_tiling(n, k, tuning)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return jnp.reshape(_qmatmul_jit(x2, w, layer_arr, tuning), (*lead, n))


@functools.partial(jax.jit, static_argnames=("tuning",))
def _qmatmul_jit(x2: jax.Array, w: QuantizedTensor, layer_arr: jax.Array,
                 tuning: JaxTritonMatmulTuning) -> jax.Array:  # [M, N] f32
    import jax_triton as jt

    q4_0_kernel, int8_kernel = _kernels()
    n, k = w.shape
    m = x2.shape[0]
    t = tuning
    steps = k // (t.block_k * t.split_k)
    if w.fmt == "q4_0":
        kernel, extra = q4_0_kernel, {}
        xk = matmul_triton.x_parts(x2, 32, 2)  # [2, M, K/2]: part h meets nibble h of each byte
    else:
        kernel, extra = int8_kernel, {"B": BLOCK[w.fmt]}
        xk = x2
    partial = jt.triton_call(
        layer_arr, xk, w.planes["qs"], w.planes["d"],
        kernel=kernel,
        out_shape=jax.ShapeDtypeStruct((t.split_k, m, n), jnp.float32),
        grid=(n // t.block_n, -(-m // t.block_m), t.split_k),
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        name=f"jt_qmatmul_{w.fmt}",
        M=m, N=n, K=k, STEPS=steps, BM=t.block_m, BN=t.block_n, BK=t.block_k, **extra,
    )
    return partial[0] if t.split_k == 1 else jnp.sum(partial, axis=0)


registry.register("matmul", "jax_triton", qmatmul_jax_triton, is_available=_is_available, priority=-10)
