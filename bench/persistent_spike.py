"""A spike for issue 6's persistent-kernel idea: two dependent decode matmuls in ONE Mosaic GPU
kernel, a grid-wide barrier between them, against the same two matmuls as two kernels.

    python3 bench/persistent_spike.py --out "$OUT"          # GPU
    python3 bench/persistent_spike.py --lower-only            # CPU: lowers both variants for CUDA

What it runs, per "pair" (a stand-in for a layer's up and down projections, both Q8_0):

    y = bf16(x @ W1.T)    W1 [N1, K1]   (one K split: each 64-row tile of y whole in one CTA)
    z = y @ W2.T          W2 [N2, N1]   (split K; partial sums [split, M, N2], added by XLA)

- "two_kernels": y by one kernel (grid N1/64), z by a second (grid N2/64 x split), as the engine
  runs its matmuls today (one kernel each, with CUDA graphs between them).
- "persistent": one kernel of `--ctas` CTAs (all resident at once; by default as many as the
  larger phase has items, at most 2 per SM: 264 on the H200, where the 7B pair's second phase
  has 320 items, so 56 CTAs take two, as the 320-CTA second kernel of two_kernels runs in two
  waves).
  Each CTA takes every ctas-th tile of y, then waits at a grid barrier (`counter_barrier`: one
  global counter, an atomic add and a spin on loads), then takes every ctas-th (tile, split) of
  z, reading y from global memory.
- "persistent_semaphores": the same with `grid_barrier`, Pallas's global semaphores (every CTA
  adds 1 to `arrive`; CTA 0 waits for all, then adds ctas to `release`; each CTA takes 1 from
  `release`, a compare-and-swap loop on one word).

All variants share the per-step product (`_step_product`: a K step of a Q8_0 matmul of 64
weight rows, as `pallas_kernels.matmul_mgpu`'s decode kernel with one row tile). `--pairs` pairs are chained in
one jit (z of one, cast to bf16, is x of the next), so the weights read per call exceed the L2.
The report: device time per pair (sum of kernel durations, and the span from the first kernel's
start to the last one's end, per call, over the pairs), the wall clock per call, and each
variant's relative error against the reference (on the first pair alone) (`pallas_kernels.matmul.qmatmul_reference`).

- "persistent_prefetch<P>": as "persistent", but before the barrier each CTA asks the L2 for the
  codes of the first P K steps of its first second-phase item (`cp.async.bulk.prefetch.L2`), so
  that the weights stream while the CTAs wait: where a persistent layer kernel would gain most.
- "persistent_manual": as "persistent", the second phase through a hand-written pipeline
  (`_manual_tile_matmul`: codes, scales and x in `stages` slots, one barrier per slot for the
  weights and one for x) instead of `emit_pipeline`: the baseline of the next variant.
- "persistent_smem": as "persistent_manual", but each CTA starts the TMA copies of the first
  `stages` K steps of its first second-phase item's weights into shared memory before the
  barrier (`_preload_weights`; CTAs without a first-phase tile start them at once), and x's
  copies after it.

Measured on the H200 (twenty-second session, bench/results/persistent-spike-20261201-*): per
pair, up (11008 x 4096) then down (4096 x 11008), Q8_0, M = 8, 264 CTAs: two_kernels 43.2-43.3
us, persistent 42.2-43.0 us (-0.6% to -2.4%), with the L2 prefetch of 4 or 8 K steps 42.8-43.7 us;
4096 x 4096 twice: 26.0 against 26.4 us (+1.4%), prefetch 27.8 us. The semaphore barrier took
83-111 us per pair; with 132 CTAs (work unevenly spread) the counter barrier's pair took 52.3 us.
Forty-second session (persistent-spike-20261204-*, another machine, 256 CTAs): the 7B pair two_kernels
37.9 us, persistent 39.1, persistent_manual 39.4, persistent_smem 38.3 (the preload 1.1 us better than
the same pipeline without it, still 0.35 us behind two kernels); 4096 x 4096 twice 23.1 / 24.1 /
24.1 / 24.5 us.
So a grid barrier costs about what a kernel boundary costs under CUDA graphs (about 1 us); the
per-matmul fixed cost lies inside each kernel, not between kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Run as a file, Python puts bench/ first on sys.path, where bench/http.py would shadow the
# standard library's http (which jax imports): put the repository root there instead.
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from bench import common  # noqa: E402
from pallas_kernels import matmul_mgpu as mm  # noqa: E402
from pallas_kernels import mgpu_tuning  # noqa: E402

BLOCK = 32  # Q8_0's block
ROWS = mgpu_tuning.BLOCK_N  # weight rows per tile (one warpgroup's wgmma M)


def _code_transforms(tile_k: int) -> tuple:
    """The shared-memory tiling and swizzle of a [64, tile_k] Q8_0 code tile (the wgmma's A)."""
    plgpu = mm._plgpu()
    a_swz = plgpu.find_swizzle(tile_k * 8, "lhs")
    return plgpu.TilingTransform((8, a_swz * 8 // 8)), plgpu.SwizzleTransform(a_swz)


def _x_transforms() -> tuple:
    """The same for an [m, tile_k] bf16 x tile (the transposed B, a 32-block at a time)."""
    plgpu = mm._plgpu()
    x_swz = plgpu.find_swizzle(BLOCK * 16, "rhs")
    return plgpu.TilingTransform((8, x_swz * 8 // 16)), plgpu.SwizzleTransform(x_swz)


def _step_product(acc, x_smem, c_smem, d_smem, *, m: int, nb: int):
    """acc + one K step's product: the step's codes [64, tile_k] in bf16 against x [m, tile_k],
    a wgmma per 32-block, each block's [64, m] result scaled by its scales [tile_k/32, 64]."""
    plgpu = mm._plgpu()
    a = mm._codes_bf16(c_smem, "q8_0", upcast_loads=True, word_unpack=False)

    def blockdots(*acc_refs):
        for b, acc_ref in enumerate(acc_refs):
            xb = plgpu.transpose_ref(x_smem.at[:, pl.ds(BLOCK * b, BLOCK)], (1, 0))
            plgpu.wgmma(acc_ref, a[:, BLOCK * b:BLOCK * (b + 1)], xb)
        return [r[...] for r in acc_refs]

    parts = pl.run_scoped(blockdots, *[plgpu.ACC((ROWS, m), jnp.float32) for _ in range(nb)])
    return mm._scale_and_sum(acc, parts, d_smem)


def _tile_matmul(x_gmem, c_gmem, d_gmem, row0, lo, hi, *, m: int, tile_k: int, stages: int):
    """[64, m] f32: weight rows row0..row0+63 (Q8_0: c_gmem [N, K] int8 codes, d_gmem [K/32, N]
    f16 scales) times x_gmem [m, K] bf16 over K steps lo..hi-1 of tile_k."""
    plgpu = mm._plgpu()
    nb = tile_k // BLOCK

    def body(idx, x_smem, c_smem, d_smem, carry):
        del idx
        return (_step_product(carry[0], x_smem, c_smem, d_smem, m=m, nb=nb),)

    in_specs = [
        plgpu.BlockSpec((m, tile_k), lambda j: (0, lo + j), transforms=_x_transforms()),
        plgpu.BlockSpec((ROWS, tile_k), lambda j: (0, lo + j), transforms=_code_transforms(tile_k)),
        plgpu.BlockSpec((nb, ROWS), lambda j: (lo + j, 0)),
    ]
    zero = plgpu.layout_cast(jnp.zeros((ROWS, m), jnp.float32), plgpu.Layout.WGMMA)
    (acc,) = plgpu.emit_pipeline(body, grid=(hi - lo,), in_specs=in_specs, max_concurrent_steps=stages,
                                 init_carry=(zero,))(x_gmem, c_gmem.at[pl.ds(row0, ROWS)],
                                                     d_gmem.at[:, pl.ds(row0, ROWS)])
    return acc


def _weight_copies(c_gmem, d_gmem, bufs, row0, step, slot) -> None:
    """Starts the TMA copies of one K step's codes and scales into `slot` (its weight barrier)."""
    plgpu = mm._plgpu()
    cbuf, dbuf, _, wbar, _ = bufs
    tile_k, nb = cbuf.shape[-1], dbuf.shape[1]
    plgpu.copy_gmem_to_smem(c_gmem.at[pl.ds(row0, ROWS), pl.ds(step * tile_k, tile_k)], cbuf.at[slot], wbar.at[slot])
    plgpu.copy_gmem_to_smem(d_gmem.at[pl.ds(step * nb, nb), pl.ds(row0, ROWS)], dbuf.at[slot], wbar.at[slot])


def _x_copy(x_gmem, bufs, step, slot) -> None:
    plgpu = mm._plgpu()
    _, _, xbuf, _, xbar = bufs
    tile_k = xbuf.shape[-1]
    plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(step * tile_k, tile_k)], xbuf.at[slot], xbar.at[slot])


def _preload_weights(c_gmem, d_gmem, bufs, row0, lo, hi, valid) -> None:
    """The first `stages` K steps' weights of a tile, before its x exists (what a persistent
    kernel can do while it waits at a barrier)."""
    stages = bufs[0].shape[0]
    for s in range(stages):
        @pl.when(jnp.logical_and(valid, lo + s < hi))
        def _():
            _weight_copies(c_gmem, d_gmem, bufs, row0, lo + s, s)


def _manual_tile_matmul(x_gmem, c_gmem, d_gmem, bufs, row0, lo, hi, *, m: int, preloaded: bool):
    """As `_tile_matmul`, with a hand-written pipeline over `bufs` (codes, scales and x in
    `stages` slots, a barrier per slot for the weights and one for x), so that the weights of
    the first steps can be in flight before x may be read (`preloaded`: `_preload_weights` ran)."""
    plgpu = mm._plgpu()
    cbuf, dbuf, xbuf, wbar, xbar = bufs
    stages, nb = cbuf.shape[0], dbuf.shape[1]
    n = hi - lo
    for s in range(stages):
        @pl.when(jnp.logical_and(s < n, jnp.logical_not(preloaded)))
        def _():
            _weight_copies(c_gmem, d_gmem, bufs, row0, lo + s, s)

        @pl.when(s < n)
        def _():
            _x_copy(x_gmem, bufs, lo + s, s)

    def step(j, acc):
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(wbar.at[slot])
        plgpu.barrier_wait(xbar.at[slot])
        acc = _step_product(acc, xbuf.at[slot], cbuf.at[slot], dbuf.at[slot], m=m, nb=nb)

        @pl.when(j + stages < n)  # the slot's wgmmas are done (their results were read)
        def _():
            _weight_copies(c_gmem, d_gmem, bufs, row0, lo + j + stages, slot)
            _x_copy(x_gmem, bufs, lo + j + stages, slot)

        return acc

    zero = plgpu.layout_cast(jnp.zeros((ROWS, m), jnp.float32), plgpu.Layout.WGMMA)
    return lax.fori_loop(0, n, step, zero)


def _manual_bufs(m: int, tile_k: int, stages: int):
    """Scratch types of `_manual_tile_matmul`'s slots (Q8_0 codes, f16 scales, bf16 x)."""
    plgpu = mm._plgpu()
    return [plgpu.SMEM((stages, ROWS, tile_k), jnp.int8, transforms=_code_transforms(tile_k)),
            plgpu.SMEM((stages, tile_k // BLOCK, ROWS), jnp.float16),
            plgpu.SMEM((stages, m, tile_k), jnp.bfloat16, transforms=_x_transforms()),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages)]


def _store_rows(acc, smem, gmem_slice, dtype) -> None:
    """acc [64, m] f32 -> gmem_slice [m, 64] (dtype) through smem [m, 64] (a transposed view)."""
    plgpu = mm._plgpu()
    acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    # through .at: jax 0.11's transpose_ref takes a sliced ref, not a kernel argument itself
    plgpu.transpose_ref(smem.at[:, pl.ds(0, ROWS)], (1, 0))[...] = acc.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem_slice)
    plgpu.wait_smem_to_gmem(0)


def _first(x_gmem, c_gmem, d_gmem, y_gmem, y_smem, tile, *, k: int, **kw) -> None:
    acc = _tile_matmul(x_gmem, c_gmem, d_gmem, tile * ROWS, 0, k // kw["tile_k"], **kw)
    _store_rows(acc, y_smem, y_gmem.at[:, pl.ds(tile * ROWS, ROWS)], jnp.bfloat16)


def _second(y_gmem, c_gmem, d_gmem, z_gmem, z_smem, tile, sid, *, k: int, split: int, **kw) -> None:
    steps = k // kw["tile_k"]
    lo, hi = (sid * steps) // split, ((sid + 1) * steps) // split
    acc = _tile_matmul(y_gmem, c_gmem, d_gmem, tile * ROWS, lo, hi, **kw)
    _store_rows(acc, z_smem, z_gmem.at[sid, :, pl.ds(tile * ROWS, ROWS)], jnp.float32)


def grid_barrier(arrive, release, ctas: int, cta) -> None:
    """All `ctas` CTAs of the grid (all resident) meet here; both semaphores end at 0. Release
    and acquire at GPU scope order each CTA's earlier global writes (its stores, waited for)
    before every CTA's later reads. Slow with many CTAs: every CTA's wait on `release` is a
    compare-and-swap loop on one word (see `counter_barrier`)."""
    plgpu = mm._plgpu()
    plgpu.semaphore_signal(arrive, 1, memory_scope="gpu")

    @pl.when(cta == 0)
    def _():
        plgpu.semaphore_wait(arrive, ctas, memory_scope="gpu")
        plgpu.semaphore_signal(release, ctas, memory_scope="gpu")

    plgpu.semaphore_wait(release, 1, memory_scope="gpu")
    _fence_proxy_async_global()


def counter_barrier(counter, ctas: int) -> None:
    """A grid barrier on one counter: one thread per CTA adds 1 (a release at GPU scope) and
    reads the count before its add, then spins on plain acquire loads until the count reaches
    the next multiple of `ctas` (no compare-and-swap: the waiters only read). Pallas zero-fills
    its global scratch at every kernel call, so the count runs from 0 to `ctas`; the next
    multiple (rather than `ctas` itself) would keep the barrier right if the count were kept
    between calls."""
    plgpu = mm._plgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def barrier(ctx, sem_ref):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        mgpu_utils.warpgroup_barrier()  # the CTA's earlier work (its stores waited for) is done
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            llvm.inline_asm(
                ir.Type.parse("!llvm.void"), [mgpu_utils.memref_ptr(sem_ref)],
                "{ .reg .u32 old, target, cur; .reg .pred p;\n"
                "atom.add.release.gpu.global.u32 old, [$0], 1;\n"
                f"div.u32 target, old, {ctas}; add.u32 target, target, 1; mul.lo.u32 target, target, {ctas};\n"
                "spin_${:uid}: ld.acquire.gpu.global.u32 cur, [$0];\n"
                "sub.u32 cur, cur, target; setp.gt.s32 p, cur, -1; @!p bra spin_${:uid}; }",
                "l", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    barrier(counter)
    _fence_proxy_async_global()


def _fence_proxy_async_global() -> None:
    """Orders this thread's generic-proxy view of global memory (the acquire above) before the
    async proxy's (the TMA loads after it), which read what other CTAs' TMA stores wrote."""
    plgpu = mm._plgpu()

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()


def _prefetch_first_steps(c_gmem, *, k: int, tile_k: int, split: int, items: int, prefetch_steps: int) -> None:
    """Asks the L2 for the codes of the first `prefetch_steps` K steps of this CTA's first
    second-phase item (its 64 weight rows, two threads to a row, `cp.async.bulk.prefetch.L2`),
    so that they load while the CTA waits at the barrier."""
    plgpu = mm._plgpu()
    steps = k // tile_k
    half = prefetch_steps * tile_k // 2  # bytes per thread (int8 codes), a multiple of 16

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def prefetch(ctx, c_ref):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, llvm

        i64 = ir.IntegerType.get_signless(64)

        def const(v):
            return arith.constant(i64, v)

        cta = arith.index_cast(i64, gpu.block_id(gpu.Dimension.x))
        tid = arith.index_cast(i64, gpu.thread_id(gpu.Dimension.x))
        tile, sid = arith.divui(cta, const(split)), arith.remui(cta, const(split))
        lo = arith.divui(arith.muli(sid, const(steps)), const(split))
        row, part = arith.shrui(tid, const(1)), arith.andi(tid, const(1))
        offset = arith.addi(arith.muli(arith.addi(arith.muli(tile, const(ROWS)), row), const(k)),
                            arith.addi(arith.muli(lo, const(tile_k)), arith.muli(part, const(half))))
        base = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(c_ref))
        ult = arith.CmpIPredicate.ult
        pred = arith.andi(arith.cmpi(ult, cta, const(items)), arith.cmpi(ult, tid, const(2 * ROWS)))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.addi(base, offset), pred],
                        f"@$1 cp.async.bulk.prefetch.L2.global [$0], {half};", "l,b", has_side_effects=True)

    prefetch(c_gmem)


def _codes_scales(w):
    n = w.shape[0]
    return mm.codes_of(w), jnp.reshape(w.planes["d"], (-1, n))


def _shapes(x, w1, w2, split):
    m, (n1, _), (n2, _) = x.shape[0], w1.shape, w2.shape
    return (jax.ShapeDtypeStruct((m, n1), jnp.bfloat16), jax.ShapeDtypeStruct((split, m, n2), jnp.float32))


def two_kernels(x, w1, w2, *, tile_k: int, stages: int, split: int):
    """z partial sums [split, M, N2] by two kernels."""
    plgpu = mm._plgpu()
    m, (n1, k1), (n2, k2) = x.shape[0], w1.shape, w2.shape
    kw = dict(m=m, tile_k=tile_k, stages=stages)
    y_type, z_type = _shapes(x, w1, w2, split)

    def first(x_gmem, c_gmem, d_gmem, y_gmem, y_smem):
        _first(x_gmem, c_gmem, d_gmem, y_gmem, y_smem, lax.axis_index("rows"), k=k1, **kw)

    def second(y_gmem, c_gmem, d_gmem, z_gmem, z_smem):
        _second(y_gmem, c_gmem, d_gmem, z_gmem, z_smem, lax.axis_index("rows"), lax.axis_index("split"),
                k=k2, split=split, **kw)

    y = plgpu.kernel(first, out_type=y_type, grid=(n1 // ROWS,), grid_names=("rows",),
                     scratch_types=[plgpu.SMEM((m, ROWS), jnp.bfloat16)])(x, *_codes_scales(w1))
    return plgpu.kernel(second, out_type=z_type, grid=(n2 // ROWS, split), grid_names=("rows", "split"),
                        scratch_types=[plgpu.SMEM((m, ROWS), jnp.float32)])(y, *_codes_scales(w2))


def persistent(x, w1, w2, *, tile_k: int, stages: int, split: int, ctas: int, prefetch_steps: int = 0,
               barrier: str = "counter", smem_preload: str = ""):
    """z partial sums [split, M, N2] by one kernel of `ctas` CTAs with a grid barrier; with
    `prefetch_steps`, each CTA asks the L2 for its first second-phase weights before the barrier;
    `smem_preload` "manual": the second phase through `_manual_tile_matmul`, "preload": the same
    with its first weights copied into shared memory before the (counter) barrier."""
    if smem_preload not in ("", "manual", "preload"):
        raise ValueError(f"smem_preload must be '', 'manual' or 'preload', got {smem_preload!r}")
    if smem_preload and (barrier != "counter" or prefetch_steps):
        raise ValueError("smem_preload runs the counter barrier alone, without prefetch_steps")
    plgpu = mm._plgpu()
    m, (n1, k1), (n2, k2) = x.shape[0], w1.shape, w2.shape
    kw = dict(m=m, tile_k=tile_k, stages=stages)
    y_type, z_type = _shapes(x, w1, w2, split)

    def kernel(x_gmem, c1, d1, c2, d2, y_gmem, z_gmem, y_smem, z_smem):
        cta = lax.axis_index("cta")
        if barrier == "semaphores":
            arrive = pl.get_global(plgpu.SemaphoreType.REGULAR)
            release = pl.get_global(plgpu.SemaphoreType.REGULAR)
        else:
            counter = pl.get_global(plgpu.SemaphoreType.REGULAR)

        @pl.loop(cta, n1 // ROWS, step=ctas)
        def _(tile):
            _first(x_gmem, c1, d1, y_gmem, y_smem, tile, k=k1, **kw)

        if prefetch_steps:
            _prefetch_first_steps(c2, k=k2, tile_k=tile_k, split=split, items=(n2 // ROWS) * split,
                                  prefetch_steps=prefetch_steps)
        items2 = (n2 // ROWS) * split
        if smem_preload:
            steps2 = k2 // tile_k

            def item_range(item):
                sid = item % split
                return (item // split) * ROWS, (sid * steps2) // split, ((sid + 1) * steps2) // split

            def second_phase(*bufs):
                row0, lo, hi = item_range(cta)
                if smem_preload == "preload":
                    _preload_weights(c2, d2, bufs, row0, lo, hi, cta < items2)
                counter_barrier(counter, ctas)

                @pl.loop(cta, items2, step=ctas)
                def _(item):
                    row0, lo, hi = item_range(item)
                    acc = _manual_tile_matmul(y_gmem, c2, d2, bufs, row0, lo, hi, m=m,
                                              preloaded=jnp.logical_and(item == cta, smem_preload == "preload"))
                    _store_rows(acc, z_smem, z_gmem.at[item % split, :, pl.ds(row0, ROWS)], jnp.float32)

            pl.run_scoped(second_phase, *_manual_bufs(m, tile_k, stages))
            return
        if barrier == "semaphores":
            grid_barrier(arrive, release, ctas, cta)
        else:
            counter_barrier(counter, ctas)

        @pl.loop(cta, items2, step=ctas)
        def _(item):
            _second(y_gmem, c2, d2, z_gmem, z_smem, item // split, item % split, k=k2, split=split, **kw)

    _, z = plgpu.kernel(kernel, out_type=(y_type, z_type), grid=(ctas,), grid_names=("cta",),
                        scratch_types=[plgpu.SMEM((m, ROWS), jnp.bfloat16), plgpu.SMEM((m, ROWS), jnp.float32)],
                        )(x, *_codes_scales(w1), *_codes_scales(w2))
    return z


def reference_pair(x, w1, w2):
    from pallas_kernels.matmul import qmatmul_reference

    y = qmatmul_reference(x, w1).astype(jnp.bfloat16)
    return qmatmul_reference(y, w2)


def chain(pair_fn, x, pairs):
    """x through every (w1, w2) pair in turn; each z (summed over splits) cast to bf16 is the next x."""
    for w1, w2 in pairs:
        z = pair_fn(x, w1, w2)
        x = (jnp.sum(z, axis=0) if z.ndim == 3 else z).astype(jnp.bfloat16)
    return x


def spans_per_call(events: list[dict], gap_us: float = 30.0) -> list[float]:
    """The device span (first start to last end) of each burst of kernels, bursts split at idle
    gaps over gap_us (the host's sync between calls)."""
    evs = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)
    spans, start, end = [], None, None
    for s, e in evs:
        if start is None:
            start, end = s, e
        elif s - end > gap_us:
            spans.append(end - start)
            start, end = s, e
        else:
            end = max(end, e)
    if start is not None:
        spans.append(end - start)
    return spans


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--n1", type=int, default=11008)
    ap.add_argument("--k1", type=int, default=4096)
    ap.add_argument("--n2", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--ctas", type=int, default=0,
                    help="persistent CTAs (default: the larger phase's items, at most 2 per SM)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--prefetch-steps", type=int, default=0,
                    help="K steps of second-phase codes asked of the L2 before the barrier (default: the stages)")
    ap.add_argument("--lower-only", action="store_true", help="lower both variants for CUDA and stop (CPU check)")
    args = ap.parse_args(argv)

    from bench.kernels import _random_weight, random_weight

    tuning = mgpu_tuning.DEFAULT_TUNING
    k2 = args.n1
    split = mgpu_tuning.split_for(args.n2, k2, tuning)
    stages = min(tuning.stages, mgpu_tuning.stages_for("q8_0", args.m, tuning, ROWS))
    gpu = jax.default_backend() == "gpu"
    items = max(args.n1 // ROWS, args.n2 // ROWS * split)  # one item per CTA where they fit: as two_kernels
    resident = 2 * (jax.devices()[0].core_count if gpu else 132)  # 2 CTAs per SM fit the shared memory
    ctas = args.ctas or min(items, resident)
    if ctas > resident:  # a CTA not yet running would never reach the barrier: the grid would hang
        raise SystemExit(f"--ctas {ctas}: more than the {resident} CTAs that are resident at once")
    kw = dict(tile_k=tuning.tile_k, stages=stages, split=split)
    split_steps = k2 // tuning.tile_k // split  # the fewest K steps a second-phase item has
    prefetch = args.prefetch_steps or min(stages, split_steps)
    if prefetch > split_steps:
        raise SystemExit(f"--prefetch-steps {prefetch}: more than a split's {split_steps} K steps")
    variants = {"two_kernels": functools.partial(two_kernels, **kw),
                "persistent_semaphores": functools.partial(persistent, ctas=ctas, barrier="semaphores", **kw),
                "persistent": functools.partial(persistent, ctas=ctas, **kw),
                f"persistent_prefetch{prefetch}": functools.partial(persistent, ctas=ctas, prefetch_steps=prefetch, **kw),
                "persistent_manual": functools.partial(persistent, ctas=ctas, smem_preload="manual", **kw),
                "persistent_smem": functools.partial(persistent, ctas=ctas, smem_preload="preload", **kw)}

    key = jax.random.PRNGKey(0)
    if args.lower_only:
        x = jax.ShapeDtypeStruct((args.m, args.k1), jnp.bfloat16)
        w1 = jax.eval_shape(lambda: random_weight(key, "q8_0", args.n1, args.k1))
        w2 = jax.eval_shape(lambda: random_weight(key, "q8_0", args.n2, k2))
        for name, fn in variants.items():
            text = jax.jit(fn).trace(x, w1, w2).lower(lowering_platforms=("cuda",)).as_text()
            print(name, "lowered:", text.count("mosaic_gpu"), "mosaic_gpu mentions")
        return

    pairs = [(_random_weight(jax.random.fold_in(key, 2 * i), "q8_0", args.n1, args.k1),
              _random_weight(jax.random.fold_in(key, 2 * i + 1), "q8_0", args.n2, k2)) for i in range(args.pairs)]
    x = jax.random.normal(jax.random.fold_in(key, 999), (args.m, args.k1), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(jax.jit(lambda x, p: chain(reference_pair, x, p))(x, pairs[:1]), np.float32)
    w_bytes = sum(int(p.nbytes) for w in pairs[0] for p in w.planes.values())
    report = {**common.device_info(), "git": common.git_rev(), "m": args.m, "n1": args.n1, "k1": args.k1,
              "n2": args.n2, "k2": k2, "split": split, "stages": stages, "tile_k": tuning.tile_k, "ctas": ctas,
              "pairs": args.pairs, "weight_mb_per_pair": w_bytes / 1e6, "variants": {}}
    for name, fn in variants.items():
        row: dict = {}
        try:
            one = np.asarray(jax.jit(lambda x, p: chain(fn, x, p))(x, pairs[:1]), np.float32)
            row["rel_err"] = float(np.linalg.norm(one - ref) / max(np.linalg.norm(ref), 1e-30))
            f = jax.jit(lambda x, p: chain(fn, x, p))
            jax.block_until_ready(f(x, pairs))
            t0 = time.perf_counter()
            for _ in range(args.runs):
                jax.block_until_ready(f(x, pairs))
            row["wall_us_per_pair"] = (time.perf_counter() - t0) / args.runs / args.pairs * 1e6
            events = common.traced_device_events(lambda: f(x, pairs), args.runs)
            if events:
                spans = spans_per_call(events)
                row["calls_found"] = len(spans)  # should be --runs: else the gap split merged or cut calls
                row["span_us_per_pair"] = float(np.median(spans)) / args.pairs
                row["busy_us_per_pair"] = sum(float(e.get("dur", 0.0)) for e in events) / args.runs / args.pairs
                row["kernels_per_call"] = len(events) / args.runs
                row["kernel_names"] = sorted({str(e.get("name", ""))[:60] for e in events})
                row["gbps_span"] = w_bytes / (row["span_us_per_pair"] * 1e-6) / 1e9
                row["pct_copy_span"] = None
        except Exception as e:  # noqa: BLE001  (a spike: report what failed, keep the other variant)
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        report["variants"][name] = row
        print(name, row, flush=True)
    if gpu:
        # 4 GiB, 20 repeats: with 1 GiB (the first runs) the same-call figure ranged 2.0-3.3 TB/s
        copy = common.copy_bandwidth_gb_s(4 << 30, repeats=20)
        report["copy_gbps"] = copy
        for row in report["variants"].values():
            if "span_us_per_pair" in row:
                row["pct_copy_span"] = 100.0 * w_bytes / (row["span_us_per_pair"] * 1e-6) / (copy * 1e9)
    print(json.dumps(report, indent=1))
    if args.out:
        path = common.result_path(args.out, "persistent-spike", common.timestamp())
        common.write_json(path, report)
        print("wrote", path)


if __name__ == "__main__":
    main()
