"""Per-op numerics of the forward pass against float64 numpy written from llama.cpp's
definitions (ggml_rms_norm, ggml_rope NORM / NEOX, softmax attention with GQA)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from model.config import ModelConfig
from model.forward import apply_rope, rms_norm, _inv_freq
from pallas_kernels.attention import attention_decode_reference, attention_prefill_reference

CFG = ModelConfig(
    arch="llama", num_layers=1, embed_dim=64, ffn_dim=128, num_heads=4, num_kv_heads=2, head_dim=16,
    vocab_size=32, context_length=256, rms_eps=1e-5, rope_theta=10000.0, rope_dim=16, rope_neox=False,
)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_rms_norm():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 64)), rng.standard_normal(64)
    want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5) * w
    assert rel(rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-5), want) < 1e-6


@pytest.mark.parametrize("neox", [False, True])
def test_rope(neox):
    cfg = dataclasses.replace(CFG, rope_neox=neox)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 3, 16))  # [T, heads, D]
    pos = np.array([0, 1, 2, 5, 17, 100, 255])
    theta = pos[:, None] * 10000.0 ** (-np.arange(8) * 2 / 16)  # [T, D/2]
    want = x.copy()
    for i in range(8):
        a, b = (i, i + 8) if neox else (2 * i, 2 * i + 1)  # ggml NEOX pairs halves, NORM neighbours
        c, s = np.cos(theta[:, i])[:, None], np.sin(theta[:, i])[:, None]
        want[..., a] = x[..., a] * c - x[..., b] * s
        want[..., b] = x[..., a] * s + x[..., b] * c
    got = apply_rope(x.astype(np.float32), pos, _inv_freq(cfg, cfg.rope_theta, None), cfg)
    assert rel(got, want) < 1e-5


def _attention(q, k, v, q_pos, window, scale):  # q [T, H, D], k/v [S, K, D]
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((t, h, d))
    for i in range(t):
        for j in range(h):
            s = np.arange(k.shape[0])
            ok = (s <= q_pos[i]) & ((s > q_pos[i] - window) if window else True)
            sc = (k[:, j // g] @ q[i, j]) * scale
            p = np.exp(sc[ok] - sc[ok].max())
            out[i, j] = (p / p.sum()) @ v[ok, j // g]
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_attention_prefill_and_decode(window):
    rng = np.random.default_rng(3)
    s, kh, h, d = 24, 2, 4, 16
    k, v = rng.standard_normal((2, s, kh, d)), rng.standard_normal((2, s, kh, d))
    q = rng.standard_normal((6, h, d))
    start = 9
    want = _attention(q, k[0], v[0], start + np.arange(6), window, 0.25)
    got = attention_prefill_reference(q.astype(np.float32), k[0].astype(np.float32), v[0].astype(np.float32), start, 0.25, window)
    assert rel(got, want) < 1e-5
    pos = np.array([3, 23])
    qd = rng.standard_normal((2, h, d))
    got = attention_decode_reference(qd.astype(np.float32), k.astype(np.float32), v.astype(np.float32), pos, 0.25, window)
    for b in range(2):
        assert rel(got[b], _attention(qd[b : b + 1], k[b], v[b], pos[b : b + 1], window, 0.25)[0]) < 1e-5


@pytest.mark.parametrize(
    "t, start, num_valid",
    [(8, 0, 8), (8, 0, 3), (8, 5, 8), (8, 12, 4), (8, 14, 2), (8, 16, 0), (32, 0, 7), (40, 3, 5)],
)
def test_write_prefill_matches_a_scatter(t, start, num_valid):
    """The windowed in-place write equals the plain per-position scatter with padding dropped:
    positions [start, start + num_valid) take the chunk's rows and nothing else changes, also
    where the window is moved back from the cache's end (start + t > S) and where the chunk is
    larger than the cache (the scatter path)."""
    import jax
    import jax.numpy as jnp

    from model.forward import KVCache

    L, B, S, K, D = 3, 2, 16 if t <= 16 else 24, 2, 4  # t 32 and 40 > S: the scatter path
    rng = np.random.default_rng(t * 100 + start * 10 + num_valid)
    old_k = rng.standard_normal((L, B, S, K, D)).astype(np.float32)
    old_v = rng.standard_normal((L, B, S, K, D)).astype(np.float32)
    k = rng.standard_normal((t, K, D)).astype(np.float32)
    v = rng.standard_normal((t, K, D)).astype(np.float32)
    layer, slot = 1, 1
    write = jax.jit(lambda c, lay, sl, st, n, k, v: c.write_prefill(lay, sl, st, n, k, v))
    got = write(KVCache(jnp.asarray(old_k), jnp.asarray(old_v)), jnp.int32(layer), jnp.int32(slot),
                jnp.int32(start), jnp.int32(num_valid), jnp.asarray(k), jnp.asarray(v))
    want_k, want_v = old_k.copy(), old_v.copy()
    want_k[layer, slot, start:start + num_valid] = k[:num_valid]
    want_v[layer, slot, start:start + num_valid] = v[:num_valid]
    np.testing.assert_array_equal(np.asarray(got.k), want_k)
    np.testing.assert_array_equal(np.asarray(got.v), want_v)


@pytest.mark.parametrize("kv, windowed, unroll, few_rows", [("float32", False, False, False),
                                                      ("bfloat16", True, True, True)])
def test_decode_with_the_cache_write_in_the_attention_kernel(tiny_tp_path, kv, windowed, unroll, few_rows):
    """A decode step whose attention kernel writes the new keys and values itself
    (`Kernels.decode_writes_cache`: the Triton kernel, Pallas interpret mode) gives the logits
    and the cache of writing them first (`KVCache.write_decode`) with the same kernel, within
    rounding (the new key's terms are summed last); an idle row (position -1) writes nothing,
    and the next step attends the written keys. Once with an f32 cache and the scanned layer
    loop, once with a bf16 cache, a sliding window on every other layer (traced per layer),
    the unrolled loop and the few-rows plan's splits."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from model import forward
    from model.forward import Kernels, KVCache
    from model.gguf_file import GGUFFile
    from model.weights import load_params
    from pallas_kernels import attention_triton, attention_triton_prefill
    from pallas_kernels.matmul import embed_reference, qmatmul_reference

    gf = GGUFFile(tiny_tp_path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    if windowed:
        cfg = dataclasses.replace(cfg, sliding_window=5, sliding_window_pattern=2, rope_theta_local=10000.0)
    params = load_params(gf, cfg)
    dec = functools.partial(attention_triton.attention_decode_triton, interpret=True, config=(
        attention_triton.DecodeAttentionConfig(block_s=16, min_split_keys=16, target_programs=8) if few_rows
        else attention_triton.DecodeAttentionConfig(block_s=16)))
    mm = lambda x, w, layer=None, split=None, elementwise_x=False: qmatmul_reference(x, w, layer=layer)  # noqa: E731
    rng = np.random.default_rng(5)
    shape = (cfg.num_layers, 3, 64, cfg.num_kv_heads, cfg.head_dim)
    cache = KVCache(*(jnp.asarray(rng.standard_normal(shape), kv) for _ in range(2)))
    tokens, positions = jnp.asarray([7, 0, 99], jnp.int32), jnp.asarray([16, -1, 40], jnp.int32)
    outs = {}
    for fused in (False, True):
        kern = Kernels(mm, embed_reference, dec, attention_triton_prefill.attention_prefill_triton,
                       decode_writes_cache=fused)
        step = jax.jit(functools.partial(forward.decode, cfg, kern), static_argnums=(4, 5, 6))
        logits, c = step(params, cache, tokens, positions, 48, unroll, few_rows)
        logits2, c = step(params, c, tokens + 1, positions + jnp.asarray([1, 0, 1]), 48, unroll, few_rows)
        outs[fused] = (logits, logits2, c)
    tol = 1e-5 if kv == "float32" else 1e-2
    for want, got in zip(outs[False], outs[True]):
        for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
            assert rel(b, a) < tol
    c1 = outs[True][2]
    assert not np.array_equal(np.asarray(c1.k[:, 0, 16]), np.asarray(cache.k[:, 0, 16]))  # written
    np.testing.assert_array_equal(np.asarray(c1.k[:, 1]), np.asarray(cache.k[:, 1]))  # the idle row: untouched
    np.testing.assert_array_equal(np.asarray(c1.v[:, 1]), np.asarray(cache.v[:, 1]))


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_rows_by_slot_written_by_the_kernel_or_by_scatters(tiny_tp_path, kv):
    """A speculative decode step (`decode(..., slots=)`: a slot's next token and two drafts, and
    another slot's token, an idle row) on the Triton attention (Pallas interpret mode): every
    row's key written first by `write_decode_rows_triton` (`Kernels.decode_write_rows`) or by
    `KVCache.write_decode`'s scatters gives the same logits and caches, bit for bit, and the
    rows' keys are in the cache."""
    import functools

    import jax
    import jax.numpy as jnp

    from model import forward
    from model.forward import Kernels, KVCache
    from model.gguf_file import GGUFFile
    from model.weights import load_params
    from pallas_kernels import attention_triton, attention_triton_prefill, kv_write_triton
    from pallas_kernels.matmul import embed_reference, qmatmul_reference

    gf = GGUFFile(tiny_tp_path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    params = load_params(gf, cfg)
    dec = functools.partial(attention_triton.attention_decode_triton, interpret=True,
                            config=attention_triton.DecodeAttentionConfig(block_s=16))
    write = functools.partial(kv_write_triton.write_decode_rows_triton, interpret=True)
    mm = lambda x, w, layer=None, split=None, elementwise_x=False: qmatmul_reference(x, w, layer=layer)  # noqa: E731
    rng = np.random.default_rng(6)
    shape = (cfg.num_layers, 3, 64, cfg.num_kv_heads, cfg.head_dim)
    cache = KVCache(*(jnp.asarray(rng.standard_normal(shape), kv) for _ in range(2)))
    tokens = jnp.asarray([7, 8, 9, 99, 0], jnp.int32)
    positions = jnp.asarray([16, 17, 18, 40, -1], jnp.int32)
    slots = jnp.asarray([0, 0, 0, 2, 1], jnp.int32)
    outs = []
    for rows in (write, None):
        kern = Kernels(mm, embed_reference, dec, attention_triton_prefill.attention_prefill_triton,
                       decode_writes_cache=True, decode_takes_slots=True, decode_write_rows=rows)
        step = jax.jit(functools.partial(forward.decode, cfg, kern), static_argnums=(4,))
        outs.append(step(params, cache, tokens, positions, 48, slots=slots))
    for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    c = outs[0][1]
    for pos in (16, 17, 18):
        assert not np.array_equal(np.asarray(c.k[:, 0, pos]), np.asarray(cache.k[:, 0, pos]))
    np.testing.assert_array_equal(np.asarray(c.k[:, 1]), np.asarray(cache.k[:, 1]))  # the idle row's slot


def test_an_8bit_float_cache_saturates_new_keys_and_values():
    """e4m3fn has no inf: a key past +-448 would turn into NaN in the cache; the forward pass
    saturates what it writes there instead, and leaves wider caches' values alone."""
    import jax.numpy as jnp

    from model.forward import _fit_cache

    x = jnp.asarray([1e4, -1e4, 3.0, 447.0], jnp.float32)
    got = np.asarray(_fit_cache(x, jnp.float8_e4m3fn).astype(jnp.float8_e4m3fn), np.float32)
    np.testing.assert_array_equal(got, [448.0, -448.0, 3.0, 448.0])  # 447 rounds to 448 in e4m3
    np.testing.assert_array_equal(np.asarray(_fit_cache(x, jnp.bfloat16)), np.asarray(x))


def test_decode_with_an_8bit_float_cache(tiny_tp_path):
    """The forward pass on an fp8 (e4m3fn) cache, reference kernels: a prefill then two decode
    steps give the logits of an f32 cache within the 8-bit rounding of keys and values (3
    mantissa bits: a few % of the logits' norm on this random-weight model)."""
    import functools

    import jax
    import jax.numpy as jnp

    from model import forward
    from model.forward import Kernels, KVCache
    from model.gguf_file import GGUFFile
    from model.weights import load_params
    from pallas_kernels.attention import attention_decode_reference, attention_prefill_reference
    from pallas_kernels.matmul import embed_reference, qmatmul_reference

    gf = GGUFFile(tiny_tp_path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    params = load_params(gf, cfg)
    mm = lambda x, w, layer=None, split=None, elementwise_x=False: qmatmul_reference(x, w, layer=layer)  # noqa: E731
    kern = Kernels(mm, embed_reference, attention_decode_reference, attention_prefill_reference)
    prefill = jax.jit(functools.partial(forward.prefill, cfg, kern))
    decode = jax.jit(functools.partial(forward.decode, cfg, kern), static_argnums=(4,))
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, 24), jnp.int32)
    outs = {}
    for kv in (jnp.float32, jnp.float8_e4m3fn):
        cache = KVCache.create(cfg, 2, 64, kv)
        first, cache = prefill(params, cache, jnp.int32(1), prompt, jnp.int32(0), jnp.int32(24))
        steps = [first]
        for j in range(2):
            logits, cache = decode(params, cache, jnp.asarray([0, 5 + j], jnp.int32), jnp.asarray([-1, 24 + j]), 64)
            steps.append(logits[1])
        assert cache.k.dtype == kv
        outs[kv] = steps
    for want, got in zip(outs[jnp.float32], outs[jnp.float8_e4m3fn]):
        assert np.isfinite(np.asarray(got)).all()
        assert 1e-4 < rel(got, want) < 0.1  # rounded, but close
