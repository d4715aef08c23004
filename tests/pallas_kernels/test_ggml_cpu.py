"""`--numerics ggml` (pallas_kernels/ggml_cpu.py) against its numpy recipe
(tests/fixtures/replay_ggml.py, itself checked bit for bit against llama.cpp's dumped tensors)
and the C library: every op must be bit-exact, since one last-bit difference is enough for
greedy generations to part. The recipe needs XLA on the CPU to keep a few properties
(test_xla_*): a jax that changes them fails here, not silently in the agreement."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pallas_kernels import ggml_cpu, quant

_spec = importlib.util.spec_from_file_location(
    "replay_ggml", pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "replay_ggml.py")
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)

f32 = np.float32


def _bits_differ(a, b) -> int:
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    assert a.shape == b.shape
    return int((a.view(np.uint32) != b.view(np.uint32)).sum())


def _normal_range(rng, n: int) -> np.ndarray:
    """exp arguments whose results are normal f32 numbers (XLA on the CPU flushes subnormal
    results to zero; ggml does not: a softmax weight below 1e-38 that no sum can see)."""
    return np.concatenate([rng.uniform(-87.3, 88.7, n), rng.standard_normal(n) * 3, [0.0, -0.0, 1.0, -1.0]]).astype(f32)


def test_xla_contracts_one_product_and_sum():
    """Where ggml has an FMA, ggml_cpu mostly writes `acc + p * v` in f32, one product and one
    sum (the matmul's lanes, the f16 dot's later steps, both attention paths' accumulators),
    which XLA compiles as an FMA."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(4096).astype(f32) for _ in range(3))
    got = jax.jit(lambda a, b, c: a + b * c)(a, b, c)
    assert _bits_differ(got, replay.fma(b, c, a)) == 0


def test_xla_dot_is_a_chain_of_fmas():
    """ggml's tiled attention scores each key by a chain of fmas over the head dim from 0; an
    f32 dot on the CPU is that chain (checked at the shapes the paths use: a tile's keys by a
    chunk's rows, [64, D] x [D, T])."""
    rng = np.random.default_rng(1)
    for m, k, n in [(64, 64, 512), (64, 64, 128), (64, 128, 512), (512, 64, 64), (9, 64, 64), (1, 128, 64)]:
        a = rng.standard_normal((m, k)).astype(f32)
        b = rng.standard_normal((k, n)).astype(f32)
        chain = np.zeros((m, n), f32)
        for i in range(k):
            chain = replay.fma(a[:, i:i + 1], b[i:i + 1], chain)
        assert _bits_differ(jax.jit(jnp.dot)(a, b), chain) == 0


def test_libm_expf_is_the_c_librarys():
    lib = ctypes.CDLL("libm.so.6")
    lib.expf.restype, lib.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = np.concatenate([_normal_range(np.random.default_rng(2), 20000), [-np.inf, -200.0, 100.0]]).astype(f32)
    want = np.array([lib.expf(float(v)) for v in x], f32)
    assert _bits_differ(jax.jit(ggml_cpu.libm_expf)(x), want) == 0


def test_vector_expf_and_swiglu():
    rng = np.random.default_rng(3)
    x = _normal_range(rng, 20000)
    assert _bits_differ(jax.jit(ggml_cpu.vector_expf)(x), replay.vector_expf(x)) == 0
    gate = (rng.standard_normal((8, 1536)) * 4).astype(f32)
    up = rng.standard_normal((8, 1536)).astype(f32)
    assert _bits_differ(jax.jit(ggml_cpu.swiglu)(gate, up), replay.swiglu(gate, up)) == 0


def _random_matrix(rng, fmt: str, n: int, k: int):
    """Raw GGUF blocks of `fmt` with random codes and f16 scales -> (our planes, replay's tuple)."""
    nb = k // 32
    d = (rng.random((n, nb)) * 0.05 + 1e-3).astype(np.float16)
    if fmt == "q4_1":
        m = (-rng.random((n, nb)) * 0.2).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], axis=-1)
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)
        ref = ("q4_1", (d.astype(f32), m.astype(f32), codes))
        qtype = Q.Q4_1
    else:
        qs = rng.integers(-127, 128, (n, nb, 32)).astype(np.int8)
        raw = np.concatenate([d[..., None].view(np.uint8), qs.view(np.uint8)], axis=-1)
        ref = ("q8_0", (d.astype(f32), qs.astype(np.int32)))
        qtype = Q.Q8_0
    w = quant.repack(raw.reshape(n, -1), qtype, (n, k))
    return jax.tree_util.tree_map(jnp.asarray, w), ref


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_matmul(fmt):
    rng = np.random.default_rng(4)
    # 40 rows: more than one tile of 32, padded; 2048 columns: two tiles of 1024
    for n, rows in ((96, 1), (96, 5), (96, 40), (2048, 3)):
        w, ref = _random_matrix(rng, fmt, n, 256)
        x = (rng.standard_normal((rows, 256)) * rng.choice([0.01, 1.0, 30.0], (rows, 1))).astype(f32)
        x[0, :32] = 0  # a block of zeros: d = 0, codes 0
        want = np.stack([replay.matmul(r, ref) for r in x])
        assert _bits_differ(jax.jit(ggml_cpu.matmul)(x, w), want) == 0


def test_matmul_refuses_other_formats():
    w = quant.repack(np.zeros((4, 144), np.uint8), Q.Q4_K, (4, 256))
    with pytest.raises(NotImplementedError, match="q4_k"):
        jax.eval_shape(lambda x: ggml_cpu.matmul(x, w), jax.ShapeDtypeStruct((1, 256), jnp.float32))


def test_norm_and_rope():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 576)) * rng.choice([0.1, 3.0], (6, 1))).astype(f32)
    w = rng.standard_normal(576).astype(f32)
    want = np.stack([replay.rms_norm(r, 1e-5) * w for r in x]).astype(f32)
    assert _bits_differ(jax.jit(lambda x: ggml_cpu.rms_norm(x, w, 1e-5))(x), want) == 0
    cos, sin = ggml_cpu.rope_tables(100000.0, 64, 600)
    rope = jax.jit(ggml_cpu.make_rope(cos, sin, neox=False))
    heads = rng.standard_normal((5, 9, 64)).astype(f32)
    pos = np.array([0, 1, 77, 300, 599])
    want = np.stack([replay.rope(h, int(p), 100000.0) for h, p in zip(heads, pos)])
    assert _bits_differ(rope(heads, pos), want) == 0


def _cache(rng, cells: int, kv_heads: int, used: int):
    k = np.zeros((cells, kv_heads, 64), np.float16)
    v = np.zeros_like(k)
    k[:used] = rng.standard_normal((used, kv_heads, 64)) * 0.7
    v[:used] = rng.standard_normal((used, kv_heads, 64))
    return k, v


def _stacked_cache(rng, layers: int, slots: int, cells: int, kv_heads: int):
    """[L, B, S, K, D] caches, every cell of every layer and slot drawn (`_cache`)."""
    pairs = [[_cache(rng, cells, kv_heads, cells) for _ in range(slots)] for _ in range(layers)]
    return tuple(np.stack([np.stack([pair[i] for pair in row]) for row in pairs]) for i in (0, 1))


@pytest.mark.parametrize("positions, threads", [
    ([0, 37, 255, 256, 300, 700, -1, 1023], 2),
    ([0, 37, 255, 100, 5, 200, -1, 17], 2),  # no row splits (the path that skips the split)
    ([0, 300, 700, 1023, 511, 512, -1, 256], 3),
])
def test_decode_attention_one_chunk_and_split(positions, threads):
    """Rows at positions below 256 (n_kv = 256 cells) take the one-chunk path; from 256 on
    llama.cpp attends to n_kv >= 512 cells and splits them between its threads."""
    rng = np.random.default_rng(6)
    cells, heads, kv_heads = 1024, 4, 2
    positions = np.array(positions)
    k = np.zeros((8, cells, kv_heads, 64), np.float16)
    v = np.zeros_like(k)
    for b in range(8):
        k[b], v[b] = _cache(rng, cells, kv_heads, cells)
    q = rng.standard_normal((8, heads, 64)).astype(f32)
    fn = jax.jit(lambda q, k, v, p: ggml_cpu.attention_decode(q, k, v, p, 0.125, threads=threads))
    got = np.asarray(fn(q, k, v, positions))
    for b, p in enumerate(positions):
        if p < 0:
            continue
        for h in range(heads):
            want = replay.attention_split(q[b, h], k[b, :p + 1, h // 2].astype(f32), v[b, :p + 1, h // 2].astype(f32),
                                          f32(0.125), cells=cells, threads=threads)
            assert _bits_differ(got[b, h], want) == 0, (int(p), h)


def test_decode_attention_reads_a_stacked_caches_layer_and_slots():
    """The engine's call: the stacked [L, B, S, K, D] cache, the layer and (speculative decode)
    each row's slot, gathered block by block from it: the numbers of the same rows over their
    own caches."""
    rng = np.random.default_rng(8)
    heads = 4
    k, v = _stacked_cache(rng, 3, 4, 1024, 2)
    q = rng.standard_normal((5, heads, 64)).astype(f32)
    rows, positions = np.array([2, 0, 2, 3, 1]), np.array([700, 3, 40, 300, -1])
    fn = jax.jit(lambda q, k, v, p, layer, rows: ggml_cpu.attention_decode(q, k, v, p, 0.125, layer=layer, slots=rows))
    got = np.asarray(fn(q, k, v, positions, np.int32(1), rows))
    plain = jax.jit(lambda q, k, v, p: ggml_cpu.attention_decode(q, k, v, p, 0.125))
    want = np.asarray(plain(q, k[1, rows], v[1, rows], positions))
    assert _bits_differ(got, want) == 0
    assert _bits_differ(got[0], got[2]) > 0  # the same slot, other positions


@pytest.mark.parametrize("start, valid", [(0, 20), (64, 70), (300, 1)])
def test_prefill_attention_reads_a_stacked_caches_layer_and_slot(start, valid):
    """The engine's call: the stacked [L, B, S, K, D] cache with the layer and the slot (and a
    span), each path's numbers those of the slot's own cache."""
    rng = np.random.default_rng(9)
    heads, t = 4, 128
    k, v = _stacked_cache(rng, 2, 3, 512, 2)
    q = rng.standard_normal((t, heads, 64)).astype(f32)
    stacked = jax.jit(lambda q, k, v, s, n, layer, slot: ggml_cpu.attention_prefill(
        q, k, v, s, 0.125, layer=layer, slot=slot, span=384, num_valid=n))
    plain = jax.jit(lambda q, k, v, s, n: ggml_cpu.attention_prefill(q, k, v, s, 0.125, num_valid=n))
    got = np.asarray(stacked(q, k, v, np.int32(start), np.int32(valid), np.int32(1), np.int32(2)))[:valid]
    want = np.asarray(plain(q, k[1, 2], v[1, 2], np.int32(start), np.int32(valid)))[:valid]
    assert _bits_differ(got, want) == 0
    other = np.asarray(stacked(q, k, v, np.int32(start), np.int32(valid), np.int32(0), np.int32(2)))[:valid]
    assert _bits_differ(other, want) > 0  # another layer's cells


@pytest.mark.parametrize("start, valid", [(0, 20), (0, 100), (64, 70), (300, 1)])
def test_prefill_attention_paths(start, valid):
    """A chunk (llama.cpp's ubatch) of 64 rows or more takes the tiled path, fewer the one-chunk
    path, one row the decode path."""
    rng = np.random.default_rng(7)
    cells, heads, kv_heads, t = 1024, 4, 2, 128
    k, v = _cache(rng, cells, kv_heads, start + valid)
    q = rng.standard_normal((t, heads, 64)).astype(f32)
    fn = jax.jit(lambda q, k, v, s, n: ggml_cpu.attention_prefill(q, k, v, s, 0.125, num_valid=n))
    got = np.asarray(fn(q, k, v, np.int32(start), np.int32(valid)))
    for i in range(valid):
        p = start + i
        for h in range(heads):
            keys, values = k[:p + 1, h // 2].astype(f32), v[:p + 1, h // 2].astype(f32)
            if valid >= 64:
                want = replay.attention_tiled(q[i, h], keys, values, f32(0.125))
            elif valid == 1:
                want = replay.attention_split(q[i, h], keys, values, f32(0.125), cells=cells)
            else:
                want = replay.attention_one_chunk(q[i, h], keys, values, f32(0.125))
            assert _bits_differ(got[i, h], want) == 0, (i, h)
