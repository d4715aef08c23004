"""Conformance of the attention kernels against the plain-jnp references.

One shared base per op (`DecodeConformance`, `PrefillConformance`) holds the checks; each
subclass names an implementation setting and its cases: `...Interpret` runs the Triton kernels
in Pallas interpret mode on the CPU (small shapes), `...Gpu` compiles them for the GPU (marked
`gpu`, skipped unless jax's default backend is a GPU: run with JAX_PLATFORMS=cuda, since
tests/conftest.py defaults JAX to the CPU).

Every case draws fresh random inputs (the seed is in the failure message) with per-row random
positions that include 0 and S - 1, and compares with the reference by relative norm error:
1e-5 for f32 caches, 1e-2 for bf16 (q and the softmax weights are rounded to bf16 for the
tensor-core dots) and for an 8-bit float cache (its tiles, q and the weights in f16). NaN or
inf never passes. Windows listed in a case are passed traced (one compiled program serves them
all, as in gemma3's scanned layers) unless the case says static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention, attention_triton, attention_triton_prefill, kv_write_triton, registry
from pallas_kernels.attention_triton import DecodeAttentionConfig
from pallas_kernels.attention_triton_prefill import PrefillAttentionConfig

# fp8: the reference reads the same 8-bit values; the kernel rounds q and p to f16 (tolerance as for bf16)
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float8_e4m3fn): 1e-2}


def junk(dtype) -> float:
    """A large value `dtype` holds (fp8 e4m3fn tops out at 448; beyond it converts to NaN)."""
    return min(1e3, float(jnp.finfo(dtype).max) / 2)


def assert_rel_close(actual, expected, tol, context=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, context
    assert np.isfinite(expected).all(), f"reference not finite: {context}"
    assert np.isfinite(actual).all(), f"NaN/inf never passes: {context}"
    err = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    assert err < tol, f"relative error {err:.3g} >= {tol}: {context}"


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def normal(rng, shape, dtype) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    b: int
    s: int
    h: int
    k: int
    d: int
    dtype: type
    windows: tuple[int, ...] = (0,)
    is_window_static: bool = False
    config: DecodeAttentionConfig = attention_triton.DEFAULT_DECODE_CONFIG
    few_rows: bool = False  # the plan made for a lone busy row
    lone_row: bool = False  # row 0 at the cache's end, every other row at position 0 (idle slots)
    checks_out_dtype: bool = True  # test_out_dtype runs it (in interpret mode a compile each)

    def __str__(self) -> str:
        kind = "static" if self.is_window_static else "traced"
        return (f"b{self.b}-s{self.s}-h{self.h}-k{self.k}-d{self.d}-{jnp.dtype(self.dtype).name}"
                f"-win{'_'.join(map(str, self.windows))}{kind}{'-few' if self.few_rows else ''}"
                f"{'-lone' if self.lone_row else ''}")


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    t: int
    s: int
    h: int
    k: int
    d: int
    dtype: type
    starts: tuple[int, ...] = (0,)
    windows: tuple[int, ...] = (0,)
    is_window_static: bool = False
    config: PrefillAttentionConfig = attention_triton_prefill.DEFAULT_PREFILL_CONFIG

    def __str__(self) -> str:
        kind = "static" if self.is_window_static else "traced"
        return (f"t{self.t}-s{self.s}-h{self.h}-k{self.k}-d{self.d}-{jnp.dtype(self.dtype).name}"
                f"-start{'_'.join(map(str, self.starts))}-win{'_'.join(map(str, self.windows))}{kind}")


# Windows passed as jit arguments: traced inside the kernels' wrappers.
@functools.partial(jax.jit, static_argnames=("config", "interpret", "few_rows"))
def _decode_traced_window(q, k, v, positions, window, *, config, interpret, few_rows):
    return attention_triton.attention_decode_triton(
        q, k, v, positions, q.shape[-1] ** -0.5, window, config=config, interpret=interpret, few_rows=few_rows)


@functools.partial(jax.jit, static_argnames=("span", "config", "interpret", "few_rows"))
def _decode_write_traced_window(q, k, v, positions, window, layer, wpos, *, span, config, interpret, few_rows):
    return attention_triton.attention_decode_triton(
        q, k, v, positions, q.shape[-1] ** -0.5, window, layer=layer, span=span, config=config, interpret=interpret,
        few_rows=few_rows, write_pos=wpos)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _prefill_traced_window(q, k, v, start, window, *, config, interpret):
    return attention_triton_prefill.attention_prefill_triton(
        q, k, v, start, q.shape[-1] ** -0.5, window, config=config, interpret=interpret)


def stack_layers(cache, layer: int, extra: int, rng, seq_axis: int):
    """A 3-layer stack holding `cache` at `layer`, NaN in the other layers, and `extra`
    positions past its length filled with large finite junk (what stale cache rows hold)."""
    if extra:
        junk_shape = list(cache.shape)
        junk_shape[seq_axis] = extra
        stale = jnp.asarray(np.clip(rng.standard_normal(junk_shape, np.float32), -4, 4) * junk(cache.dtype) / 4,
                            cache.dtype)
        cache = jnp.concatenate([cache, stale], axis=seq_axis)
    nan = jnp.full_like(cache, jnp.nan)
    return jnp.stack([cache if i == layer else nan for i in range(3)])


# The references, jitted once per shape (run eagerly, each of their ops compiles on its own).
_decode_reference_jit = jax.jit(attention.attention_decode_reference, static_argnames="scale")
_prefill_reference_jit = jax.jit(attention.attention_prefill_reference, static_argnames="scale")


def decode_reference(q, k, v, positions, window):
    return _decode_reference_jit(q, k, v, positions, q.shape[-1] ** -0.5, jnp.int32(window))


def prefill_reference(q, k, v, start, window):
    return _prefill_reference_jit(q, k, v, jnp.int32(start), q.shape[-1] ** -0.5, jnp.int32(window))


def _parametrize(metafunc, argname: str, cases) -> None:
    if argname in metafunc.fixturenames:
        metafunc.parametrize(argname, cases, ids=[str(c) for c in cases])


# ---------------------------------------------------------------------------------------------
# decode


class DecodeConformance:
    interpret: bool
    decode_cases: tuple[DecodeCase, ...]

    def pytest_generate_tests(self, metafunc):
        _parametrize(metafunc, "case", self.decode_cases)

    def run(self, case: DecodeCase, q, k, v, positions, window):
        if case.is_window_static:
            return attention_triton.attention_decode_triton(
                q, k, v, positions, case.d ** -0.5, window, config=case.config, interpret=self.interpret,
                few_rows=case.few_rows)
        return _decode_traced_window(q, k, v, positions, jnp.int32(window), config=case.config,
                                     interpret=self.interpret, few_rows=case.few_rows)

    def inputs(self, case: DecodeCase, rng):
        q = normal(rng, (case.b, case.h, case.d), case.dtype)
        k = normal(rng, (case.b, case.s, case.k, case.d), case.dtype)
        v = normal(rng, (case.b, case.s, case.k, case.d), case.dtype)
        positions = rng.integers(0, case.s, case.b)
        positions[0], positions[-1] = 0, case.s - 1
        if case.lone_row:
            positions[:] = 0
            positions[0] = case.s - 1
        return q, k, v, jnp.asarray(positions, jnp.int32)

    def test_matches_reference(self, case: DecodeCase):
        rng, seed = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        for window in case.windows:
            out = self.run(case, q, k, v, positions, window)
            assert out.shape == q.shape and out.dtype == jnp.float32
            ref = decode_reference(q, k, v, positions, window)
            assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)],
                             f"seed {seed}, window {window}, positions {np.asarray(positions).tolist()}")

    def test_out_dtype(self, case: DecodeCase):
        """Asked for bf16 output (the engine's activations), the call returns its f32 output
        rounded to bf16, bit for bit, whether the kernel writes it (one split) or the merge."""
        if not case.checks_out_dtype:
            pytest.skip("the out_dtype check runs on other cases")
        rng, _ = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        window = case.windows[-1]
        run = jax.jit(lambda q, k, v, p, out_dtype: attention_triton.attention_decode_triton(
            q, k, v, p, case.d ** -0.5, window, config=case.config, interpret=self.interpret,
            few_rows=case.few_rows, out_dtype=out_dtype), static_argnames="out_dtype")
        out32 = run(q, k, v, positions, out_dtype=jnp.float32)
        out16 = run(q, k, v, positions, out_dtype=jnp.bfloat16)
        assert out32.dtype == jnp.float32 and out16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out16.astype(jnp.float32)),
                                      np.asarray(out32.astype(jnp.bfloat16).astype(jnp.float32)))

    def test_reads_no_tile_outside_visible_keys(self, case: DecodeCase):
        """NaN in every tile wholly past a row's position or before its window: a kernel that
        read one would return NaN (0 * NaN in the probability-weighted sum of V)."""
        rng, seed = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        tile = case.config.plan(case.b, case.k, case.h // case.k, case.d, jnp.dtype(case.dtype).itemsize, case.s,
                                few_rows=case.few_rows).block_s
        s_idx = np.arange(case.s)
        for window in case.windows:
            poison = np.zeros((case.b, case.s), bool)
            for row, pos in enumerate(np.asarray(positions)):
                first = max(pos - window + 1, 0) if window > 0 else 0
                poison[row] = (s_idx >= (pos // tile + 1) * tile) | (s_idx < first // tile * tile)
            mask = jnp.asarray(poison)[:, :, None, None]
            out = self.run(case, q, jnp.where(mask, jnp.nan, k).astype(k.dtype),
                           jnp.where(mask, jnp.nan, v).astype(v.dtype), positions, window)
            ref = decode_reference(q, k, v, positions, window)
            assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}, window {window}")

    def test_stacked_cache_read_in_place(self, case: DecodeCase):
        """The [L, B, S, K, D] cache with a traced layer and a span shorter than the cache's
        extent (the forward pass's call) equals the plain call on that layer's first span keys."""
        rng, seed = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        ks, vs = (stack_layers(a, 1, 24, rng, 1) for a in (k, v))
        run = jax.jit(lambda q, k, v, p, layer: attention_triton.attention_decode_triton(
            q, k, v, p, case.d ** -0.5, case.windows[0], layer=layer, span=case.s, config=case.config,
            interpret=self.interpret, few_rows=case.few_rows))
        out = run(q, ks, vs, positions, jnp.int32(1))
        ref = decode_reference(q, k, v, positions, case.windows[0])
        assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}")

    def test_cache_write_in_the_call(self, case: DecodeCase):
        """write_pos with q packed (pack_decode_write), as the forward pass calls it (stacked
        cache, traced layer, a span short of the cache): the caches come back exactly as a
        scatter of the new rows would leave them (nothing written for an idle row, whose
        position lies outside the cache), and the output is the reference's on the written
        cache. A kernel that attended the stale cache row instead of the new key would fail: the
        stale rows are large junk."""
        rng, seed = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        ks, vs = (stack_layers(a, 1, 24, rng, 1) for a in (k, v))
        rows = jnp.arange(case.b)
        ks, vs = (c.at[1, rows, positions].set(jnp.asarray(junk(c.dtype), c.dtype)) for c in (ks, vs))  # stale
        new_k = normal(rng, (case.b, case.k, case.d), jnp.float32)
        new_v = normal(rng, (case.b, case.k, case.d), jnp.float32)
        wpos = np.asarray(positions).copy()
        wpos[1] = ks.shape[2]  # idle: dropped
        wpos = jnp.asarray(wpos, jnp.int32)
        packed = attention.pack_decode_write(q, new_k, new_v)
        drop = dict(mode="drop")
        k_want = ks.at[1, rows, wpos].set(new_k.astype(ks.dtype), **drop)
        v_want = vs.at[1, rows, wpos].set(new_v.astype(vs.dtype), **drop)
        keep = np.asarray(wpos) < ks.shape[2]  # the idle row attended its stale row: not compared
        for window in case.windows:
            if case.is_window_static:
                out, k_out, v_out = jax.jit(lambda q, k, v, p, layer, wpos: attention_triton.attention_decode_triton(
                    q, k, v, p, case.d ** -0.5, window, layer=layer, span=case.s, config=case.config,
                    interpret=self.interpret, few_rows=case.few_rows, write_pos=wpos))(
                    packed, ks, vs, positions, jnp.int32(1), wpos)
            else:
                out, k_out, v_out = _decode_write_traced_window(
                    packed, ks, vs, positions, jnp.int32(window), jnp.int32(1), wpos, span=case.s, config=case.config,
                    interpret=self.interpret, few_rows=case.few_rows)
            np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_want, np.float32))
            np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_want, np.float32))
            ref = decode_reference(q, k_want[1, :, :case.s], v_want[1, :, :case.s], positions, window)
            assert_rel_close(out[keep], ref[keep], TOL[jnp.dtype(case.dtype)], f"seed {seed}, window {window}")

    def test_rows_by_slot(self, case: DecodeCase):
        """`slots=`: each query row reads (and with write_pos writes) the cache row it names,
        several rows sharing one at consecutive positions (the engine's speculative decode, the
        keys of the earlier positions already in the cache). Row r's output is bitwise the plain
        call's for its slot at its position and query (that one planned for all rows, whatever
        the case's plan), and the caches come back as a scatter at
        (slot, write_pos) leaves them."""
        rng, seed = fresh_rng()
        q, k, v, positions = self.inputs(case, rng)
        b, window = case.b, case.windows[0]
        slots = np.asarray([(r + 1) % b if r < b - 1 else 0 for r in range(b)], np.int32)  # a rotation ...
        slots[: min(3, b)] = slots[0]  # ... whose first rows share one slot
        pos = np.asarray(positions).copy()
        first = min(int(pos[0]), case.s - 3)
        pos[: min(3, b)] = first + np.arange(min(3, b))  # consecutive positions in the shared slot
        pos, slots_j, pos_j = pos, jnp.asarray(slots), jnp.asarray(pos, jnp.int32)
        ks, vs = (stack_layers(a, 1, 0, rng, 1) for a in (k, v))
        new_k = normal(rng, (b, case.k, case.d), jnp.float32)
        new_v = normal(rng, (b, case.k, case.d), jnp.float32)
        # every row's key in its slot first; the write-mode call writes them again (same values)
        k_pre = ks.at[1, slots_j, pos_j].set(new_k.astype(ks.dtype))
        v_pre = vs.at[1, slots_j, pos_j].set(new_v.astype(vs.dtype))
        packed = attention.pack_decode_write(q, new_k, new_v)
        common = dict(layer=jnp.int32(1), span=case.s, config=case.config, interpret=self.interpret)
        run = jax.jit(lambda q, k, v, p, w, sl: attention_triton.attention_decode_triton(
            q, k, v, p, case.d ** -0.5, window, write_pos=w, slots=sl, few_rows=case.few_rows, **common),
            donate_argnums=())
        plain = jax.jit(lambda q, k, v, p, w: attention_triton.attention_decode_triton(
            q, k, v, p, case.d ** -0.5, window, write_pos=w, **common))
        out, k_out, v_out = run(packed, k_pre, v_pre, pos_j, pos_j, slots_j)
        np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_pre, np.float32))
        np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_pre, np.float32))
        for r in range(b):  # row r alone in the plain call, at its slot's row; the others idle
            p_r = np.full((b,), 0, np.int32)
            p_r[slots[r]] = pos[r]
            w_r = np.full((b,), ks.shape[2], np.int32)
            w_r[slots[r]] = pos[r]
            q_r = jnp.zeros_like(packed).at[slots[r]].set(packed[r])
            want, _, _ = plain(q_r, k_pre, v_pre, jnp.asarray(p_r), jnp.asarray(w_r))
            np.testing.assert_array_equal(np.asarray(out[r]), np.asarray(want[slots[r]]),
                                          err_msg=f"seed {seed}, row {r}, slot {slots[r]}, position {pos[r]}")
        ref = attention.attention_decode_reference(q, k_pre, v_pre, pos_j, case.d ** -0.5, window, layer=1,
                                                   slots=slots_j)
        assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}")

    def test_write_rows(self, case: DecodeCase):
        """`write_decode_rows_triton`: every row's packed key and value into its slot's cache
        row, several rows sharing a slot at consecutive positions, an idle row (position S)
        writing nothing: the caches a scatter of the same values (rounded to the cache's dtype
        through q's) leaves, bit for bit, the other layers untouched."""
        rng, seed = fresh_rng()
        b, d = case.b, case.d
        slots = np.asarray([min(r, b - 2) if r < b - 1 else 0 for r in range(b)], np.int32)
        slots[: min(3, b)] = b - 1
        pos = rng.integers(0, case.s, b).astype(np.int32)
        pos[: min(3, b)] = min(int(pos[0]), case.s - 3) + np.arange(min(3, b))
        pos[-1] = case.s  # idle
        ks, vs = (stack_layers(normal(rng, (b, case.s, case.k, d), case.dtype), 1, 0, rng, 1) for _ in range(2))
        q = normal(rng, (b, case.h, d), jnp.bfloat16)
        new_k, new_v = (normal(rng, (b, case.k, d), jnp.float32) for _ in range(2))
        slots_j, pos_j = jnp.asarray(slots), jnp.asarray(pos)
        got_k, got_v = jax.jit(lambda p, k, v, w, sl: kv_write_triton.write_decode_rows_triton(
            p, k, v, w, sl, layer=jnp.int32(1), interpret=self.interpret))(
            attention.pack_decode_write(q, new_k, new_v), ks, vs, pos_j, slots_j)
        for got, cache, new in ((got_k, ks, new_k), (got_v, vs, new_v)):
            want = cache.at[1, slots_j, pos_j].set(new.astype(q.dtype).astype(cache.dtype), mode="drop")
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                          err_msg=f"seed {seed}")


# ---------------------------------------------------------------------------------------------
# prefill


class PrefillConformance:
    interpret: bool
    prefill_cases: tuple[PrefillCase, ...]

    def pytest_generate_tests(self, metafunc):
        _parametrize(metafunc, "case", self.prefill_cases)

    def run(self, case: PrefillCase, q, k, v, start, window):
        if case.is_window_static:
            return attention_triton_prefill.attention_prefill_triton(
                q, k, v, start, case.d ** -0.5, window, config=case.config, interpret=self.interpret)
        return _prefill_traced_window(q, k, v, start, jnp.int32(window), config=case.config,
                                      interpret=self.interpret)

    def inputs(self, case: PrefillCase, rng):
        q = normal(rng, (case.t, case.h, case.d), case.dtype)
        k = normal(rng, (case.s, case.k, case.d), case.dtype)
        v = normal(rng, (case.s, case.k, case.d), case.dtype)
        return q, k, v

    def test_matches_reference(self, case: PrefillCase):
        rng, seed = fresh_rng()
        q, k, v = self.inputs(case, rng)
        for start in case.starts:
            assert start + case.t <= case.s, "the chunk's keys are in the cache"
            for window in case.windows:
                out = self.run(case, q, k, v, jnp.int32(start), window)
                assert out.shape == q.shape and out.dtype == jnp.float32
                ref = prefill_reference(q, k, v, start, window)
                assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}, start {start}, window {window}")

    def test_reads_no_tile_outside_visible_keys(self, case: PrefillCase):
        """NaN in every key tile wholly past the chunk's last query or before the window of its
        first query."""
        rng, seed = fresh_rng()
        q, k, v = self.inputs(case, rng)
        block_k = case.config.resolve(case.d, jnp.dtype(case.dtype).itemsize)[1]
        s_idx = np.arange(case.s)
        for start in case.starts:
            for window in case.windows:
                last = start + case.t - 1
                first = max(start - window + 1, 0) if window > 0 else 0
                poison = (s_idx >= (last // block_k + 1) * block_k) | (s_idx < first // block_k * block_k)
                mask = jnp.asarray(poison)[:, None, None]
                out = self.run(case, q, jnp.where(mask, jnp.nan, k).astype(k.dtype),
                               jnp.where(mask, jnp.nan, v).astype(v.dtype), jnp.int32(start), window)
                ref = prefill_reference(q, k, v, start, window)
                assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}, start {start}, window {window}")

    def test_stacked_cache_read_in_place(self, case: PrefillCase):
        """The [L, B, S, K, D] cache with traced layer and slot and a span shorter than the
        cache's extent equals the plain call on that slot's first span keys."""
        rng, seed = fresh_rng()
        q, k, v = self.inputs(case, rng)
        # slot 2 of 3, layer 1 of 3, 24 junk positions past the span
        ks, vs = (stack_layers(stack_layers(a, 2, 24, rng, 0), 1, 0, rng, 0) for a in (k, v))
        run = jax.jit(lambda q, k, v, start, layer, slot: attention_triton_prefill.attention_prefill_triton(
            q, k, v, start, case.d ** -0.5, case.windows[0], layer=layer, slot=slot, span=case.s,
            config=case.config, interpret=self.interpret))
        start = case.starts[-1]
        out = run(q, ks, vs, jnp.int32(start), jnp.int32(1), jnp.int32(2))
        ref = prefill_reference(q, k, v, start, case.windows[0])
        assert_rel_close(out, ref, TOL[jnp.dtype(case.dtype)], f"seed {seed}")


# ---------------------------------------------------------------------------------------------
# CPU: Pallas interpret mode, small shapes. Each case is one compiled program (a few seconds of
# XLA compile on two cores); windows and starts vary at run time within it.
# GQA ratios 1, 3, 4, 8; head dims 32..256; ragged cache lengths and chunks; one and many splits.


class TestDecodeInterpret(DecodeConformance):
    interpret = True
    decode_cases = (
        DecodeCase(4, 64, 4, 4, 64, jnp.float32, windows=(0, 1, 5), config=DecodeAttentionConfig(block_s=16),
                   checks_out_dtype=False),
        DecodeCase(3, 100, 6, 2, 32, jnp.float32, windows=(0, 7, 40),
                   config=DecodeAttentionConfig(block_s=16, num_splits=3, min_split_keys=16)),  # out_dtype: merged
        DecodeCase(4, 128, 8, 2, 128, jnp.bfloat16, windows=(0,), is_window_static=True,
                   config=DecodeAttentionConfig(block_s=32, num_splits=2, min_split_keys=32), checks_out_dtype=False),
        DecodeCase(3, 64, 8, 1, 256, jnp.bfloat16, windows=(9,), is_window_static=True,
                   config=DecodeAttentionConfig(block_s=16), checks_out_dtype=False),
        # the auto plan's one split with half tiles and 2 warps (G = 1, kv heads x 2 >= 8); out_dtype: the kernel's
        DecodeCase(3, 100, 4, 4, 64, jnp.float32, windows=(0, 7), config=DecodeAttentionConfig(target_programs=8)),
        # up to 8 splits of >= 16 keys, as many as each row's own length allows
        DecodeCase(3, 128, 4, 2, 32, jnp.float32, windows=(0, 20),
                   config=DecodeAttentionConfig(block_s=16, min_split_keys=16, num_splits=8), checks_out_dtype=False),
        # the plan for a lone busy row (1 split for all 4 rows, up to 4 for one: 2 kv heads x
        # 4 = 8), rows taking them by their share of all rows' tiles: random rows, and one long
        # row beside idle ones (it takes all 4)
        DecodeCase(4, 128, 4, 2, 32, jnp.float32, windows=(0, 20),
                   config=DecodeAttentionConfig(block_s=16, min_split_keys=16, target_programs=8), few_rows=True,
                   checks_out_dtype=False),
        DecodeCase(4, 128, 4, 2, 32, jnp.float32, windows=(0, 20),
                   config=DecodeAttentionConfig(block_s=16, min_split_keys=16, target_programs=8), few_rows=True,
                   lone_row=True, checks_out_dtype=False),
        # G = 16: the queries fill the dot's 16 rows (no padding rows), two splits
        DecodeCase(2, 64, 16, 1, 32, jnp.float32, windows=(0, 9),
                   config=DecodeAttentionConfig(block_s=16, num_splits=2, min_split_keys=16), checks_out_dtype=False),
        # an 8-bit float cache, converted to f16 per tile
        DecodeCase(3, 100, 4, 2, 64, jnp.float8_e4m3fn, windows=(0, 7),
                   config=DecodeAttentionConfig(block_s=16, num_splits=2, min_split_keys=16), checks_out_dtype=False),
        # chunks of 2 tiles, splits of whole chunks (a window's first chunk may be partial)
        DecodeCase(3, 100, 6, 2, 32, jnp.float32, windows=(0, 7, 40),
                   config=DecodeAttentionConfig(block_s=16, num_splits=3, min_split_keys=32)),
    )


class TestPrefillInterpret(PrefillConformance):
    interpret = True
    prefill_cases = (
        PrefillCase(32, 64, 4, 4, 64, jnp.float32, starts=(0, 32), windows=(0, 1, 5),
                    config=PrefillAttentionConfig(block_t=16, block_k=16)),
        PrefillCase(24, 100, 6, 2, 32, jnp.float32, starts=(0, 37, 76), windows=(0, 9, 30),
                    config=PrefillAttentionConfig(block_t=16, block_k=16)),
        PrefillCase(32, 128, 8, 2, 128, jnp.bfloat16, starts=(0, 96), is_window_static=True),
        PrefillCase(16, 64, 8, 1, 256, jnp.bfloat16, starts=(0, 48), windows=(9,), is_window_static=True,
                    config=PrefillAttentionConfig(block_k=16)),
        PrefillCase(24, 100, 4, 2, 64, jnp.float8_e4m3fn, starts=(0, 37), windows=(0, 9),
                    config=PrefillAttentionConfig(block_t=16, block_k=16)),
    )


# ---------------------------------------------------------------------------------------------
# GPU: compiled through Triton, model-sized shapes.

_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs jax's default backend to be a GPU"),
]


@_gpu[0]
@_gpu[1]
class TestDecodeGpu(DecodeConformance):
    interpret = False
    decode_cases = (
        DecodeCase(8, 4096, 32, 8, 128, jnp.bfloat16, is_window_static=True),  # Llama-3-8B
        DecodeCase(4, 2048, 32, 32, 128, jnp.bfloat16, is_window_static=True),  # Llama-2-7B
        DecodeCase(5, 1000, 24, 8, 64, jnp.bfloat16, windows=(0, 7, 300)),  # G = 3, ragged S
        DecodeCase(3, 1024, 16, 2, 256, jnp.bfloat16, windows=(0, 512)),  # gemma3-like, G = 8
        DecodeCase(4, 512, 8, 2, 128, jnp.float32, windows=(0, 33)),
        DecodeCase(2, 512, 8, 1, 256, jnp.float32, is_window_static=True),
        DecodeCase(4, 4096, 8, 8, 128, jnp.bfloat16, is_window_static=True,
                   config=DecodeAttentionConfig(num_splits=7)),
        DecodeCase(32, 1024, 32, 8, 128, jnp.bfloat16, is_window_static=True),  # one split
        DecodeCase(8, 1024, 32, 32, 128, jnp.bfloat16, windows=(0, 100)),  # the engine's 8 slots of a 7B: half tiles
        DecodeCase(8, 4096, 32, 32, 128, jnp.bfloat16, is_window_static=True, few_rows=True,
                   lone_row=True),  # ... one busy: 8 splits
        DecodeCase(8, 2048, 32, 8, 128, jnp.bfloat16, windows=(0, 300), few_rows=True),  # Llama-3-8B: 16 splits
        DecodeCase(8, 4096, 32, 8, 128, jnp.float8_e4m3fn, is_window_static=True),  # Llama-3-8B, 8-bit cache
        DecodeCase(8, 1024, 32, 32, 128, jnp.float8_e4m3fn, windows=(0, 100)),  # the 7B's 8 slots, 8-bit cache
        DecodeCase(8, 4096, 32, 8, 128, jnp.bfloat16, is_window_static=True,  # Llama-3-8B, one-tile chunks
                   config=DecodeAttentionConfig(min_split_keys=64)),
    )


@_gpu[0]
@_gpu[1]
class TestPrefillGpu(PrefillConformance):
    interpret = False
    prefill_cases = (
        PrefillCase(512, 4096, 32, 8, 128, jnp.bfloat16, starts=(0, 1024, 3584), is_window_static=True),
        PrefillCase(512, 4096, 32, 32, 128, jnp.bfloat16, starts=(0, 3584), is_window_static=True),
        PrefillCase(64, 512, 8, 8, 64, jnp.float32, starts=(0, 448), windows=(0, 100)),
        PrefillCase(100, 1000, 24, 8, 64, jnp.bfloat16, starts=(0, 900), windows=(0, 17)),  # ragged
        PrefillCase(128, 1024, 16, 2, 256, jnp.bfloat16, starts=(0, 896), windows=(0, 512)),
        PrefillCase(1, 512, 32, 8, 128, jnp.bfloat16, starts=(0, 300, 511), is_window_static=True),
        PrefillCase(512, 4096, 32, 8, 128, jnp.float8_e4m3fn, starts=(0, 3584), is_window_static=True),
    )

    def test_chosen_by_the_registry(self):
        spec = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32), 0.1, 0)
        assert registry.choose("attention_prefill", probes=[spec]) is attention_triton_prefill.attention_prefill_triton


# ---------------------------------------------------------------------------------------------
# backend-independent checks


def test_registered_above_the_reference():
    for op in ("attention_decode", "attention_prefill"):
        impls = registry.implementations(op)
        names = [impl.name for impl in impls]
        assert names.index("triton") < names.index("reference")
        triton = impls[names.index("triton")]
        assert triton.is_available() == (jax.default_backend() == "gpu")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU: the triton implementation is unavailable")
def test_the_cpus_are_chosen_on_cpu():  # decode's reads only the keys in use (test_attention_chunked.py)
    assert registry.choose("attention_decode") is attention.attention_decode_chunked


@pytest.mark.parametrize(
    "k_shape, dtype, reason",
    [((2, 64, 2, 80), jnp.bfloat16, "head dim"), ((2, 64, 2, 64), jnp.int8, "KV dtype")],
)
def test_rejects_input_it_cannot_take(k_shape, dtype, reason):
    d = k_shape[-1]
    q = jax.ShapeDtypeStruct((2, 4, d), jnp.float32)
    kv = jax.ShapeDtypeStruct(k_shape, dtype)
    pos = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(NotImplementedError, match=reason):
        jax.eval_shape(attention_triton.attention_decode_triton, q, kv, kv, pos, 0.1, 0)
    with pytest.raises(NotImplementedError, match=reason):
        jax.eval_shape(attention_triton_prefill.attention_prefill_triton, jax.ShapeDtypeStruct((8, 4, d), jnp.float32),
                       jax.ShapeDtypeStruct(k_shape[1:], dtype), jax.ShapeDtypeStruct(k_shape[1:], dtype),
                       jax.ShapeDtypeStruct((), jnp.int32), 0.1, 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DecodeAttentionConfig(block_s=48),
        lambda: DecodeAttentionConfig(block_s=8),
        lambda: DecodeAttentionConfig(num_splits=0),
        lambda: DecodeAttentionConfig(max_splits=0),
        lambda: DecodeAttentionConfig(num_warps=3),
        lambda: DecodeAttentionConfig(num_stages=0),
        lambda: PrefillAttentionConfig(block_t=100),
        lambda: PrefillAttentionConfig(block_k=8),
    ],
)
def test_config_validation(make):
    with pytest.raises(ValueError):
        make()


def test_decode_plan_choices():
    """Enough splits to fill `target_programs` programs with all rows (the span plays no part,
    so a row splits alike in every context bucket), at most `max_splits`: one split once rows x
    kv heads reach the target; the few-rows plan fills them with one row, no more than the span
    holds at `min_split_keys` each; the half tile and 2 warps for one query per kv head;
    explicit fields win."""
    cfg = DecodeAttentionConfig()
    plan = attention_triton.DecodePlan
    assert cfg.plan(8, 32, 1, 128, 2, 512) == plan(32, 1, 2)  # Llama-2-7B, 8 slots
    assert cfg.plan(8, 32, 1, 128, 2, 4096) == plan(32, 1, 2)
    assert cfg.plan(1, 32, 1, 128, 2, 4096) == plan(32, 8, 2)  # one row: 32 kv heads x 8 = 256
    assert cfg.plan(1, 32, 1, 128, 2, 512) == plan(32, 8, 2)  # whatever the span
    assert cfg.plan(8, 32, 4, 128, 2, 512) == plan(64, 1, 4)  # G = 4: full tile
    assert cfg.plan(8, 8, 4, 128, 2, 4096) == plan(64, 4, 4)  # Llama-3-8B: 64 programs, 4 splits
    assert cfg.plan(1, 8, 4, 128, 2, 4096) == plan(64, 16, 4)  # max_splits
    few = functools.partial(cfg.plan, few_rows=True)
    assert few(8, 32, 1, 128, 2, 4096) == plan(32, 8, 2, by_share=True)  # planned for one busy row
    assert few(8, 32, 1, 128, 2, 512) == plan(32, 4, 2, by_share=True)  # >= 128 keys per split
    assert few(8, 8, 4, 128, 2, 4096) == plan(64, 16, 4, by_share=True)
    assert few(8, 8, 4, 128, 2, 100) == plan(64, 1, 4, by_share=True)  # fewer keys than a split's
    assert DecodeAttentionConfig(num_splits=2).plan(8, 32, 1, 128, 2, 512) == plan(32, 2, 2)
    # partials past max_partial_bytes (512 MiB): one split. 32 slots of 32 kv heads at 32k keys
    # would take 257 chunks x 32 x 32 x 16 x (128 + 2) x 4 bytes = 2.2 GB
    assert few(32, 32, 1, 128, 2, 32768).num_splits == 1 and few(32, 32, 1, 128, 2, 4096).num_splits == 8
    assert DecodeAttentionConfig(max_partial_bytes=0).plan(8, 8, 4, 128, 2, 512).num_splits == 1
    assert DecodeAttentionConfig(max_splits=2).plan(1, 8, 4, 128, 2, 4096).num_splits == 2
    assert DecodeAttentionConfig(block_s=16, num_warps=8).plan(8, 32, 1, 128, 2, 512) == plan(16, 1, 8)
    assert DecodeAttentionConfig(target_programs=1024).plan(8, 32, 1, 128, 2, 512).num_splits == 4
    # an explicit tile keeps the 4 warps measured with it
    assert DecodeAttentionConfig(block_s=64).plan(8, 32, 1, 128, 2, 512) == plan(64, 1, 4)


def test_decode_few_rows_limit():
    """The plan for few rows runs from 8 chunks (1024 keys), where it splits further: one query per kv
    head while the busy rows' programs under the plan for all rows stay under target_programs / 2 and
    its own (idle too) under 4 x target_programs a chunk; GQA: a quarter of the rows over 16 chunks."""
    cfg = DecodeAttentionConfig()
    assert cfg.few_rows_limit(8, 32, 1, 128, 2, 512) == 0  # too short: one split ran faster
    assert cfg.few_rows_limit(8, 32, 1, 128, 2, 1024) == 3  # 3 x 32 programs < 128; 4 x 32 are not
    assert cfg.few_rows_limit(8, 32, 1, 128, 2, 4096) == 3
    assert cfg.few_rows_limit(8, 8, 4, 128, 2, 4096) == 2  # Llama-3-8B: 16 splits against 4
    assert cfg.few_rows_limit(32, 8, 4, 128, 2, 4096) == 8
    assert cfg.few_rows_limit(8, 8, 4, 128, 2, 2048) == cfg.few_rows_limit(32, 8, 4, 128, 2, 1024) == 0  # GQA: slower
    assert cfg.few_rows_limit(8, 8, 4, 128, 2, 3072) == 2  # a --max-context of 3072's last bucket
    assert cfg.few_rows_limit(24, 32, 1, 128, 2, 1024) == cfg.few_rows_limit(32, 32, 1, 128, 2, 2048) == 3
    assert cfg.few_rows_limit(32, 32, 1, 128, 2, 1024) == cfg.few_rows_limit(64, 32, 1, 128, 2, 2048) == 0  # idle
    assert cfg.few_rows_limit(32, 32, 1, 128, 2, 4096) == 3  # 32 slots of a 7B: one split, 32 programs a row
    assert cfg.few_rows_limit(3, 32, 1, 128, 2, 4096) == 1  # 3 splits, 96 programs a row
    assert DecodeAttentionConfig(target_programs=1024).few_rows_limit(8, 32, 1, 128, 2, 4096) == 3  # 4 splits
    assert cfg.few_rows_limit(1, 32, 1, 128, 2, 4096) == 0  # one slot: the same plan
    assert DecodeAttentionConfig(num_splits=4).few_rows_limit(8, 32, 1, 128, 2, 4096) == 0
    limit = attention_triton.attention_decode_triton.few_rows_limit  # the protocol model/kernels.py reads
    assert limit(8, 32, 1, 128, 2, 2048) == cfg.few_rows_limit(8, 32, 1, 128, 2, 2048)


def _row_output_cases(b: int, s: int, explicit_splits: bool = True):
    """(positions of the other rows, span, few_rows, config) for the invariance tests: a row
    beside busy and idle rows, in a shorter context bucket, under the plan for few rows and
    (`explicit_splits`) with explicit split counts."""
    cases = (
        ((s - 1, 17, 90) + (0,) * (b - 4), s, False, None),
        ((3,) * (b - 1), s, False, None),  # every other row busy and short
        ((0,) * (b - 1), s // 2 + 32, False, None),
        ((0,) * (b - 1), s, True, None),  # a lone row: the few-rows plan spreads it
        ((s // 2, 0, s - 1) + (0,) * (b - 4), s, True, None),
    )
    if explicit_splits:
        cases += (((100, 159, 0) + (0,) * (b - 4), s, False, DecodeAttentionConfig(num_splits=1)),
                  ((0,) * (b - 1), s, False, DecodeAttentionConfig(num_splits=3)))
    return cases


def test_decode_row_output_does_not_depend_on_the_other_rows_or_the_span():
    """The engine's batch invariance on the GPU rests on this: a row's chunks are folded in
    key order whichever programs hold them, so its output is bitwise the same whatever the
    other rows' positions, the context bucket (span) the step attends over, the plan for few
    rows and the split count. (Interpret mode on the CPU: the same chunks and order of folds
    as the GPU program, not its float unit.)"""
    rng, seed = fresh_rng()
    b, s, h, kh, d = 4, 256, 4, 2, 32
    q = normal(rng, (b, h, d), jnp.float32)
    k, v = (stack_layers(normal(rng, (b, s, kh, d), jnp.float32), 0, 0, rng, 1) for _ in range(2))
    base = dict(block_s=16, min_split_keys=32, target_programs=8)
    run = jax.jit(lambda p, span, few, cfg: attention_triton.attention_decode_triton(
        q, k, v, p, d ** -0.5, 0, layer=0, span=span, config=cfg, interpret=True, few_rows=few),
        static_argnums=(1, 2, 3))
    cfg = DecodeAttentionConfig(**base)
    first = np.asarray(run(jnp.asarray([150, 0, 0, 0], jnp.int32), s, False, cfg))[0]
    for others, span, few, config in _row_output_cases(b, s):
        config = dataclasses.replace(config, **base) if config else cfg
        plan = config.plan(b, kh, h // kh, d, 4, span, few_rows=few)
        out = np.asarray(run(jnp.asarray([150, *others], jnp.int32), span, few, config))[0]
        np.testing.assert_array_equal(out, first, err_msg=f"seed {seed}, others {others}, span {span}, {plan}")


def _check_every_plan_with_the_cache_write(b, s, h, kh, d, dtype, base, splits, row_pos, others_list, interpret):
    """Row 0's output (at `row_pos`, writing its new key in the call, windows 0 and 37 traced)
    bitwise the same under one split, each of `splits` and the few-rows plan, beside the other
    rows at `others_list` (the last of them writes nothing: its write position is past the cache)."""
    rng, seed = fresh_rng()
    q = normal(rng, (b, h, d), dtype)
    k, v = (normal(rng, (1, b, s, kh, d), dtype) for _ in range(2))
    packed = attention.pack_decode_write(q, normal(rng, (b, kh, d), dtype), normal(rng, (b, kh, d), dtype))
    run = jax.jit(lambda p, w, win, few, cfg: attention_triton.attention_decode_triton(
        packed, k, v, p, d ** -0.5, win, layer=0, write_pos=w, config=cfg, interpret=interpret, few_rows=few)[0],
        static_argnums=(3, 4))
    for window in (0, 37):
        first = None
        for others in others_list:
            pos = np.asarray([row_pos, *others], np.int32)
            wpos = pos.copy()
            wpos[-1] = s  # past the cache: this row writes nothing
            for few, n in ((False, 1), *((False, n) for n in splits), (True, None)):
                cfg = DecodeAttentionConfig(**base, num_splits=n)
                out = np.asarray(run(jnp.asarray(pos), jnp.asarray(wpos), jnp.int32(window), few, cfg))[0]
                if first is None:
                    first = out
                plan = cfg.plan(b, kh, h // kh, d, k.dtype.itemsize, s, few)
                np.testing.assert_array_equal(out, first, err_msg=f"seed {seed}, window {window}, others {others}, "
                                                                  f"few {few}, {plan}")


def test_decode_row_output_under_every_plan_with_windows_and_the_cache_write():
    """The same bits under 1, 5 and 16 splits and the few-rows plan where the row has a window
    (its first chunk partial), writes its new key in the call, and holds more chunks (20 of one
    tile) than the merge loads at once (16), beside busy, idle and write-less rows."""
    _check_every_plan_with_the_cache_write(4, 320, 4, 2, 16, jnp.float32, dict(block_s=16, min_split_keys=16,
                                                                                target_programs=8),
                                           (5, 16), 299, ((0, 0, 0), (319, 5, 100)), interpret=True)


@_gpu[0]
@_gpu[1]
def test_decode_row_output_under_every_plan_with_windows_and_the_cache_write_gpu():
    """The same on the GPU, on the engine's decode path (the cache write in the call), in bf16, at
    Llama-3-8B's shape: one split, its default 4, 16 and the few-rows plan (12 chunks of the
    row's 1,500 keys; 16 splits of 2,048 keys take one chunk each)."""
    _check_every_plan_with_the_cache_write(8, 2048, 32, 8, 128, jnp.bfloat16, {}, (None, 16), 1500,
                                           ((0,) * 7, (2047, 5, 100, 900, 0, 1, 0)), interpret=False)


@_gpu[0]
@_gpu[1]
@pytest.mark.parametrize("kh", [32, 8])
def test_decode_row_output_does_not_depend_on_the_other_rows_or_the_span_gpu(kh):
    """The same on the GPU's float unit, at the engine's shapes of Llama-2-7B (8 slots of 32
    kv heads: one split by default, up to 8 under the few-rows plan) and Llama-3-8B (8 kv heads:
    4 splits, up to 16), in bf16, across context buckets 1024 and 2048, without the explicit
    split counts (each plan is a compile of its own; the interpret-mode test has them)."""
    rng, seed = fresh_rng()
    b, s, h, d = 8, 2048, 32, 128
    q = normal(rng, (b, h, d), jnp.bfloat16)
    k, v = (normal(rng, (1, b, s, kh, d), jnp.bfloat16) for _ in range(2))
    run = jax.jit(lambda p, span, few, cfg: attention_triton.attention_decode_triton(
        q, k, v, p, d ** -0.5, 0, layer=0, span=span, few_rows=few, config=cfg), static_argnums=(1, 2, 3))
    first = np.asarray(run(jnp.asarray([900] + [0] * 7, jnp.int32), 1024, False, None))[0]
    for others, span, few, config in _row_output_cases(b, s, explicit_splits=False):
        out = np.asarray(run(jnp.asarray([900, *others], jnp.int32), span, few, config))[0]
        np.testing.assert_array_equal(out, first, err_msg=f"seed {seed}, others {others}, span {span}, few {few}, "
                                                          f"{config}")


@pytest.mark.parametrize("kv_dtype, d, s, g", [(jnp.bfloat16, 128, 4096, 4), (jnp.float32, 64, 1000, 3),
                                                (jnp.bfloat16, 256, 512, 8), (jnp.float8_e4m3fn, 128, 1000, 1)])
def test_lowers_to_triton_for_cuda(kv_dtype, d, s, g):
    """The Triton lowering (no GPU needed) accepts every kernel variant: it rejects what Triton
    cannot take (non-power-of-two tensors, unsupported primitives) at this stage."""
    k_heads = 2
    kv = jax.ShapeDtypeStruct((3, s, k_heads, d), kv_dtype)
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    for config, few in ((DecodeAttentionConfig(), False), (DecodeAttentionConfig(num_splits=1), False),
                        (DecodeAttentionConfig(), True)):
        fn = lambda q, k, v, p, w, c=config, f=few: attention_triton.attention_decode_triton(  # noqa: E731
            q, k, v, p, 0.1, w, config=c, few_rows=f)
        lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((3, g * k_heads, d), jnp.bfloat16), kv, kv,
                                    jax.ShapeDtypeStruct((3,), jnp.int32), i32).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    kv1 = jax.ShapeDtypeStruct((s, k_heads, d), kv_dtype)
    for t in (100, 512):
        fn = lambda q, k, v, p, w: attention_triton_prefill.attention_prefill_triton(q, k, v, p, 0.1, w)
        lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((t, g * k_heads, d), jnp.bfloat16), kv1, kv1, i32,
                                    i32).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    # the forward pass's calls: a stacked [L, B, S, K, D] cache read in place at traced indices
    kv5 = jax.ShapeDtypeStruct((5, 3, s + 24, k_heads, d), kv_dtype)
    fn = lambda q, k, v, p, layer: attention_triton.attention_decode_triton(  # noqa: E731
        q, k, v, p, 0.1, 0, layer=layer, span=s)
    lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((3, g * k_heads, d), jnp.bfloat16), kv5, kv5,
                                jax.ShapeDtypeStruct((3,), jnp.int32), i32).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    # ... with the step's cache write: the caches aliased in and out of the kernel
    for config, few in ((DecodeAttentionConfig(), False), (DecodeAttentionConfig(num_splits=3), False),
                        (DecodeAttentionConfig(), True)):
        fn = lambda q, k, v, p, layer, w, c=config, f=few: attention_triton.attention_decode_triton(  # noqa: E731
            q, k, v, p, 0.1, 0, layer=layer, span=s, write_pos=w, config=c, few_rows=f)
        lowered = jax.jit(fn, donate_argnums=(1, 2)).trace(
            jax.ShapeDtypeStruct((3, (g + 2) * k_heads, d), jnp.float32), kv5, kv5,
            jax.ShapeDtypeStruct((3,), jnp.int32), i32, jax.ShapeDtypeStruct((3,), jnp.int32),
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text() and lowered.as_text().count("output_operand_alias") >= 2
    # ... with each row's cache row named (`slots=`, the speculative decode)
    fn = lambda q, k, v, p, layer, w, sl: attention_triton.attention_decode_triton(  # noqa: E731
        q, k, v, p, 0.1, 0, layer=layer, span=s, write_pos=w, slots=sl)
    lowered = jax.jit(fn, donate_argnums=(1, 2)).trace(
        jax.ShapeDtypeStruct((3, (g + 2) * k_heads, d), jnp.float32), kv5, kv5, jax.ShapeDtypeStruct((3,), jnp.int32),
        i32, jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    # ... and the write of every row's key and value before that call
    fn = lambda q, k, v, w, sl, layer: kv_write_triton.write_decode_rows_triton(  # noqa: E731
        q, k, v, w, sl, layer=layer)
    lowered = jax.jit(fn, donate_argnums=(1, 2)).trace(
        jax.ShapeDtypeStruct((3, (g + 2) * k_heads, d), jnp.bfloat16), kv5, kv5, jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32), i32,
    ).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text() and lowered.as_text().count("output_operand_alias") >= 2
    fn = lambda q, k, v, p, layer, slot: attention_triton_prefill.attention_prefill_triton(  # noqa: E731
        q, k, v, p, 0.1, 0, layer=layer, slot=slot, span=s)
    lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((64, g * k_heads, d), jnp.bfloat16), kv5, kv5, i32, i32,
                                i32).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
