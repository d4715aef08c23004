"""Layers that differ in format but repeat with a short period (llama.cpp's Q4_K_M) load as
`LayerGroup`s that the forward pass scans: their runs, and logits equal to the same model's
layers loaded one by one (an 8-layer synthetic Q4_K_M on this CPU)."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import forward, weights
from model.config import EngineConfig
from model.loader import load_model
from model.offline import teacher_forced_logits
from model.weights import LayerGroup, layer_runs


def q4_k_m_signatures(n: int) -> list[str]:
    """llama.cpp's Q4_K_M rule for which layers get Q6_K attn_v and ffn_down ("M")."""
    return ["M" if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 else "N" for i in range(n)]


def test_layer_runs():
    # a 7B's 32 layers: 4 with more bits, 8 repeats of (N, N, M), 4 with more bits
    assert layer_runs(q4_k_m_signatures(32)) == [(0, 1, 4), (4, 3, 8), (28, 1, 4)]
    assert layer_runs(q4_k_m_signatures(12)) == [(0, 3, 3), (9, 1, 3)]
    assert layer_runs(q4_k_m_signatures(8)) == [(0, 3, 2), (6, 1, 2)]  # the fixture below
    assert layer_runs(["a"] * 5) == [(0, 1, 5)]
    assert layer_runs(list("abcd")) == [(i, 1, 1) for i in range(4)]
    assert layer_runs(list("abab")) == [(0, 2, 2)]
    assert layer_runs(list("aabab")) == [(0, 1, 2), (2, 1, 1), (3, 1, 1), (4, 1, 1)]
    # ties go to the shorter period; a period longer than max_period is not looked for
    assert layer_runs(list("aaaa")) == [(0, 1, 4)]
    assert layer_runs(list("abcabc"), max_period=2) == [(i, 1, 1) for i in range(6)]
    assert layer_runs(list("abcabc")) == [(0, 3, 2)]
    assert layer_runs(list("abab"), max_period=0) == [(i, 1, 1) for i in range(4)]
    # every layer is covered once, in order, and each run's repeats match its first
    rng = np.random.default_rng(0)
    patterns = [q4_k_m_signatures(n) for n in range(1, 40)] + [list(rng.integers(0, 3, rng.integers(1, 30)))
                                                               for _ in range(200)]
    for sigs in patterns:
        for max_period in range(5):
            runs = layer_runs(sigs, max_period)
            assert [s + r * p + j for s, p, n_r in runs for r in range(n_r) for j in range(p)] == list(range(len(sigs)))
            assert all(sigs[s + r * p + j] == sigs[s + j] for s, p, n_r in runs for r in range(n_r) for j in range(p))
            assert all(p <= max(max_period, 1) for _, p, _ in runs)


@pytest.fixture(scope="module")
def deep_q4_k_m(synthetic_gguf) -> pathlib.Path:
    return synthetic_gguf("tiny", "q4_k_m", layers=8)


def test_grouped_layers_give_the_logits_of_single_layers(deep_q4_k_m):
    grouped = load_model(deep_q4_k_m, EngineConfig(max_context=128))
    with unittest.mock.patch.object(weights, "MAX_PERIOD", 0):
        single = load_model(deep_q4_k_m, EngineConfig(max_context=128))
    assert not grouped.params.is_stacked
    groups = [e for e in grouped.params.layers if isinstance(e, LayerGroup)]
    assert [(g.start, g.period, g.repeats) for g in groups] == [(0, 3, 2), (6, 1, 2)]
    assert len(grouped.params.layers) == 2 and len(single.params.layers) == 8
    # the same leaves, stacked per phase
    n_leaves = len(jax.tree_util.tree_leaves(single.params))
    assert len(jax.tree_util.tree_leaves(grouped.params)) < n_leaves
    assert sum(x.size for x in jax.tree_util.tree_leaves(grouped.params)) == sum(
        x.size for x in jax.tree_util.tree_leaves(single.params))
    # The prompts' prefill (a continuation of one token: its logits are the prefill's); the
    # decode is compared below, each program compiled once (a compile here costs 5-22 s).
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 2048, 40).tolist(), rng.integers(0, 2048, 1).tolist()) for _ in range(2)]
    a, b = (teacher_forced_logits(m.config, m.kernels, m.params, cases, max_context=128) for m in (single, grouped))
    for x, y in zip(a, b):  # the same arithmetic: equal to the bit on this CPU
        assert np.isfinite(y).all()
        np.testing.assert_array_equal(y, x)
    # gemma3's local and global layers (by the model's layer index, not a stack's): a window
    # that changes the logits, the same grouped or not
    windowed = dataclasses.replace(grouped.config, sliding_window=5, sliding_window_pattern=2,
                                   rope_theta_local=grouped.config.rope_theta / 10)
    c, d = (teacher_forced_logits(windowed, m.kernels, m.params, cases, max_context=128) for m in (single, grouped))
    for x, y, z in zip(c, d, a):
        np.testing.assert_array_equal(y, x)
        assert np.abs(x - z).max() > 0.1
    # the decode program as a GPU builds it, the layer loop unrolled (groups included), and as
    # this CPU scans it, over steps that pass the window (its local layers then attend fewer
    # cells than its global ones: a layer given another's index or window differs), so that each
    # layer also reads back what it wrote at its own index
    outs = []
    for m, unroll in ((single, True), (grouped, True), (grouped, False)):
        cache = forward.KVCache.create(windowed, 2, 128, jnp.float32)
        step = jax.jit(functools.partial(forward.decode, windowed, m.kernels), static_argnums=(4, 5))
        logits = []
        for t in range(8):
            tokens, positions = jnp.asarray([5 + t, 7 * t], jnp.int32), jnp.asarray([t, t], jnp.int32)
            out, cache = step(m.params, cache, tokens, positions, 128, unroll)
            logits.append(np.asarray(out))
        outs.append(np.stack(logits))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


def test_q_and_k_fused_where_v_differs(deep_q4_k_m):
    """Q4_K_M's "M" layers hold a Q6_K v beside Q4_K q and k: q and k load as one matrix (one
    kernel instead of two), v apart, and the logits are those of the three loaded apart."""
    fused = load_model(deep_q4_k_m, EngineConfig(max_context=128))
    with unittest.mock.patch.object(weights, "FUSED", {k: v for k, v in weights.FUSED.items() if k != "wqk"}):
        apart = load_model(deep_q4_k_m, EngineConfig(max_context=128))
    cfg = fused.config
    phases = [p for e in fused.params.layers if isinstance(e, LayerGroup) for p in e.phases]
    n = [p for p in phases if "wv" not in p]  # the runs (M, N, N) x 2 and (M) x 2
    m = [p for p in phases if "wv" in p]
    assert len(n) == 2 and len(m) == 2
    assert all("wqkv" in p and not {"wq", "wk", "wv", "wqk"} & set(p) for p in n)
    for p in m:
        assert {"wqk", "wv"} <= set(p) and not {"wq", "wk", "wqkv"} & set(p)
        assert (p["wqk"].fmt, p["wv"].fmt) == ("q4_k", "q6_k")
        assert p["wqk"].shape[-2:] == (cfg.q_dim + cfg.kv_dim, cfg.embed_dim)
    assert sum({"wq", "wk", "wv"} <= set(p) for e in apart.params.layers if isinstance(e, LayerGroup)
               for p in e.phases) == 2
    rng = np.random.default_rng(1)
    cases = [(rng.integers(0, 2048, 30).tolist(), rng.integers(0, 2048, 4).tolist())]
    a, b = (teacher_forced_logits(x.config, x.kernels, x.params, cases, max_context=128) for x in (apart, fused))
    for x, y in zip(a, b):
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-4)
