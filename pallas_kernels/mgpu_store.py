"""The Mosaic GPU matmul's epilogues (pallas_kernels/matmul_mgpu.py): its f32 accumulators out
through shared memory, as they are (`store_out`) or as the gated FFN's product (`store_gated`,
pallas_kernels/gated.py); and its loads from shared memory in a given register layout (`load`,
in the form both jax 0.10.2 and 0.11.2 take)."""

from __future__ import annotations

import functools
import inspect

from jax.experimental import pallas as pl

from pallas_kernels import gated as gated_ffn
from pallas_kernels.mgpu_tuning import BLOCK_N


def pallas_mgpu():
    """jax's Mosaic GPU Pallas module, imported on use: it needs absl and a CUDA-enabled jaxlib,
    which the CPU tests lack."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def load(ref, layout):
    """The whole of `ref` (shared memory) loaded in register `layout`. jax 0.10.2's `plgpu.load`
    takes the index as a second argument; 0.11.2 deprecates it (the ref indexed with `.at`
    instead), and a later jax may drop it."""
    plgpu = pallas_mgpu()
    if _load_takes_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


@functools.cache
def _load_takes_index() -> bool:
    """Whether this jax's `plgpu.load` needs its index argument (it has no default)."""
    param = inspect.signature(pallas_mgpu().load).parameters.get("idx")
    return param is not None and param.default is inspect.Parameter.empty


def _stage_transposed(accs, o_smem) -> None:
    """Each [64, m] accumulator t into o_smem[:, 64 t : 64 (t + 1)] ([m, rows]) through a
    transposed view. WGMMA_TRANSPOSED holds each thread's pairs down a column (one shuffle from
    WGMMA): contiguous in the transposed view, which a WGMMA-layout store cannot use."""
    plgpu = pallas_mgpu()
    for t, acc in enumerate(accs):
        acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
        o_smem.at[:, pl.ds(BLOCK_N * t, BLOCK_N)].transpose((1, 0))[...] = acc


def store_out(accs, o_smem, o_gmem, sid, col0, rows_out: bool, x0, m: int) -> None:
    """Stores the [64, m] f32 accumulators of a CTA's row tiles at output columns col0... and
    rows x0... (of x) of split `sid`: o_gmem [split, M, N] with o_smem [m, rows] when `rows_out`
    (each tile through a transposed view), else o_gmem [split, N, M] with o_smem [rows, m]."""
    plgpu = pallas_mgpu()
    if rows_out:
        _stage_transposed(accs, o_smem)
    else:
        for t, acc in enumerate(accs):
            o_smem[pl.ds(BLOCK_N * t, BLOCK_N)] = acc
    plgpu.commit_smem()
    rows = BLOCK_N * len(accs)
    if rows_out:
        dst = o_gmem.at[sid, pl.ds(x0, m), pl.ds(col0, rows)]
    else:
        dst = o_gmem.at[sid, pl.ds(col0, rows), pl.ds(x0, m)]
    plgpu.copy_smem_to_gmem(o_smem, dst)
    plgpu.wait_smem_to_gmem(0)


def store_gated(accs, o_smem, g_smem, o_gmem, col0, x0, m: int, act: str) -> None:
    """`gated`: each 64-row tile's [64, m] f32 accumulator holds the gate (its first 32 rows) and
    the up (its last 32) of 32 features (`pallas_kernels.gated`); stores act(gate) * up [m, 32]
    bf16 at output columns col0 + 32 t... and rows x0... of o_gmem [M, N / 2]. The tiles go
    through o_smem [m, rows] f32 as `store_out`'s do; `gated_product` reads them back and
    writes the product to g_smem [m, rows / 2] bf16, which goes out by TMA."""
    plgpu = pallas_mgpu()
    _stage_transposed(accs, o_smem)
    plgpu.commit_smem()  # with a warpgroup barrier: each thread reads what others stored
    gated_product(o_smem, g_smem, len(accs), m, act)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_smem, o_gmem.at[pl.ds(x0, m), pl.ds(col0, BLOCK_N // 2 * len(accs))])
    plgpu.wait_smem_to_gmem(0)


def gated_product(o_smem, g_smem, tiles: int, m: int, act: str) -> None:
    """g_smem[:, 32 t + j] = act(o_smem[:, 64 t + j]) * o_smem[:, 64 t + 32 + j] (j < 32) in bf16,
    both halves read in one strided layout (each thread holds the same elements of both).

    Written as Mosaic GPU code (`inline_mgpu`), which names both buffers' shared-memory layout
    (plain, untiled): jax 0.11.2 lowers a kernel with layout inference, whose search took the
    transposed store's tiled layout for o_smem first and ran out of fuel before undoing it in
    the decode kernel that adds Q4_K's offsets (bench/results, thirty-first session)."""
    plgpu = pallas_mgpu()
    from jax._src.lib.mlir import ir  # what Mosaic GPU's own modules build their types with
    from jax.experimental.mosaic import gpu as mgpu
    half = BLOCK_N // 2
    vec = strided_vec(m * half)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def product(ctx, o_ref, g_ref):
        del ctx
        for t in range(tiles):
            gate, up = (mgpu.FragmentedArray.load_strided(
                mgpu.memref_slice(o_ref, (slice(None), mgpu.ds(BLOCK_N * t + half * i, half))), vec_size=vec)
                for i in range(2))
            out = gated_ffn.activation(act, gate, exp=lambda v: v.exp(), tanh=lambda v: v.tanh()) * up
            out.astype(ir.BF16Type.get()).store_untiled(mgpu.memref_slice(g_ref, (slice(None), mgpu.ds(half * t, half))))

    product(o_smem, g_smem)


def strided_vec(elements: int) -> int:
    """Elements per vector of a warpgroup's strided layout over `elements` (a multiple of 128):
    up to 4 (16 bytes of f32)."""
    vec = 4
    while elements % (128 * vec):
        vec //= 2
    return vec
