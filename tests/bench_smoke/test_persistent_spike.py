"""bench/persistent_spike.py on the CPU: both variants (two kernels; one persistent kernel with a
grid barrier) lower for CUDA, the persistent one as a single Mosaic GPU kernel holding the
barrier's release and acquire; the burst splitter behind its device spans."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from bench import persistent_spike as ps
from bench.kernels import random_weight


def _lowered(fn):
    key = jax.random.PRNGKey(0)
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    w1 = jax.eval_shape(lambda: random_weight(key, "q8_0", 256, 512))
    w2 = jax.eval_shape(lambda: random_weight(key, "q8_0", 128, 256))
    return jax.jit(fn).trace(x, w1, w2).lower(lowering_platforms=("cuda",)).as_text()


def test_both_variants_lower_for_cuda():
    pytest.importorskip("absl")
    kw = dict(tile_k=256, stages=2, split=1)
    two = _lowered(functools.partial(ps.two_kernels, **kw))
    one = _lowered(functools.partial(ps.persistent, ctas=4, **kw))
    assert two.count("custom_call @mosaic_gpu") == 2
    assert one.count("custom_call @mosaic_gpu") == 1
    assert "atom.add.release.gpu" in one and "ld.acquire.gpu" in one and "fence.proxy.async.global" in one
    assert "atom.add.release" not in two
    sems = _lowered(functools.partial(ps.persistent, ctas=4, barrier="semaphores", **kw))
    assert "red.release.gpu" in sems and "fence.acquire.gpu" in sems and "fence.proxy.async.global" in sems
    assert "cp.async.bulk.prefetch.L2" not in one
    fetched = _lowered(functools.partial(ps.persistent, ctas=4, prefetch_steps=1, **kw))
    assert fetched.count("custom_call @mosaic_gpu") == 1 and "cp.async.bulk.prefetch.L2.global" in fetched


def test_hand_pipelined_variants_lower_for_cuda():
    """The second phase through `_manual_tile_matmul`, with and without its weights' first copies
    started before the barrier: one kernel each, holding the barrier, and not the same kernel."""
    pytest.importorskip("absl")
    kw = dict(tile_k=256, stages=2, split=2, ctas=4)
    manual = _lowered(functools.partial(ps.persistent, smem_preload="manual", **kw))
    preload = _lowered(functools.partial(ps.persistent, smem_preload="preload", **kw))
    for text in (manual, preload):
        assert text.count("custom_call @mosaic_gpu") == 1
        assert "atom.add.release.gpu" in text and "ld.acquire.gpu" in text
    assert manual != preload
    for bad in (dict(smem_preload="yes"), dict(smem_preload="preload", barrier="semaphores"),
                dict(smem_preload="manual", prefetch_steps=1)):
        with pytest.raises(ValueError):
            _lowered(functools.partial(ps.persistent, **{**kw, **bad}))


def test_spans_split_at_idle_gaps():
    events = [{"ts": 0, "dur": 10}, {"ts": 12, "dur": 5}, {"ts": 100, "dur": 4}, {"ts": 104.5, "dur": 1}]
    assert ps.spans_per_call(events, gap_us=30) == [17.0, 5.5]
    assert ps.spans_per_call([]) == []
