"""The CPU's decode attention (`attention_decode_chunked`: keys read in chunks, only those some
busy row sees) against the plain-jnp reference, on fresh random inputs (the seed is in each
failure message): f32 and bf16 caches, traced windows, a stacked cache read at a traced layer
and a span short of its extent, rows that share a slot, idle rows. Each row's output is
bitwise independent of the other rows (whose positions set how many chunks the loop runs), and
no chunk outside the keys the busy rows see is read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention, registry
from pallas_kernels.attention import DECODE_KEY_CHUNK, attention_decode_chunked, attention_decode_reference

C = DECODE_KEY_CHUNK


def _run(fn):
    @functools.partial(jax.jit, static_argnames=("span",))
    def run(q, k, v, positions, window, layer, slots, span):
        return fn(q, k, v, positions, q.shape[-1] ** -0.5, window, layer=layer, span=span, slots=slots)
    return run


chunked, reference = _run(attention_decode_chunked), _run(attention_decode_reference)


def _inputs(rng, b, s, h, kh, d, dtype, layers=3, extra=0):
    """q [b, h, d] and a [layers, b, s + extra, kh, d] cache pair (layer 1 is read)."""
    q = jnp.asarray(rng.standard_normal((b, h, d), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((layers, b, s + extra, kh, d), np.float32), dtype) for _ in range(2))
    return q, k, v


def _close(actual, expected, context):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all(), context
    err = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
    assert err < 1e-5, f"relative error {err:.3g}: {context}"


@pytest.mark.parametrize("b,s,h,kh,d,dtype,extra", [
    (4, 4 * C, 4, 2, 32, jnp.float32, C),  # the span stops short of the cache
    (3, 2 * C, 6, 6, 16, jnp.bfloat16, C),
    (2, 100, 4, 1, 32, jnp.float32, C),  # a span shorter than a chunk
    (3, 3 * C + 44, 4, 2, 32, jnp.float32, 0),  # not a multiple of the chunk, at the cache's edge
    (3, 2 * C + 7, 4, 2, 32, jnp.float32, 20),  # ... and short of the edge by less than a chunk
    (8, 8 * C, 9, 3, 64, jnp.float32, 0),  # SmolLM2's heads
])
@pytest.mark.parametrize("window", [0, 1, 37, 3 * C])
def test_matches_the_reference(b, s, h, kh, d, dtype, extra, window):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, b, s, h, kh, d, dtype, extra=extra)
    positions = rng.integers(0, s, b)
    positions[0] = s - 1
    positions[-1] = 0 if b < 3 else -1  # an idle row (not compared)
    if b >= 3:
        positions[1] = 0  # a row at position 0 (as the forward pass gives an idle one): compared
    pos = jnp.asarray(positions, jnp.int32)
    busy = positions >= 0
    got = chunked(q, k, v, pos, jnp.int32(window), jnp.int32(1), None, span=s)
    want = reference(q, k, v, pos, jnp.int32(window), jnp.int32(1), None, span=s)
    assert got.shape == q.shape and got.dtype == jnp.float32
    _close(got[busy], want[busy], f"seed {seed}, positions {positions.tolist()}")


@pytest.mark.parametrize("window", [0, 2 * C + 5])
def test_rows_by_slot(window):
    """Rows that share a slot at consecutive positions (the speculative decode) and rows reading
    other rows' slots: each the reference's for its slot."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    b, s = 6, 6 * C
    q, k, v = _inputs(rng, b, s, 4, 2, 32, jnp.float32)
    slots = jnp.asarray([4, 4, 4, 0, 5, 2], jnp.int32)
    first = int(rng.integers(0, s - 3))
    pos = jnp.asarray([first, first + 1, first + 2, *rng.integers(0, s, 3)], jnp.int32)
    got = chunked(q, k, v, pos, jnp.int32(window), jnp.int32(1), slots, span=s)
    want = reference(q, k, v, pos, jnp.int32(window), jnp.int32(1), slots, span=s)
    _close(got, want, f"seed {seed}, positions {np.asarray(pos).tolist()}")


@pytest.mark.parametrize("window", [0, C + 3])
def test_a_rows_output_does_not_depend_on_the_other_rows(window):
    """Row 0 alone (the others idle) and beside rows whose positions make the loop start earlier
    and end later: bit for bit the same output."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    b, s = 4, 8 * C
    q, k, v = _inputs(rng, b, s, 4, 2, 32, jnp.float32)
    row0 = int(rng.integers(3 * C, 5 * C))
    alone = chunked(q, k, v, jnp.asarray([row0, -1, -1, -1], jnp.int32), jnp.int32(window), jnp.int32(1), None,
                    span=s)
    for others in ([0, s - 1, 2 * C], [5, 6, 7], [s - 1, s - 2, s - 3], [0, 0, 0]):
        beside = chunked(q, k, v, jnp.asarray([row0, *others], jnp.int32), jnp.int32(window), jnp.int32(1), None,
                         span=s)
        np.testing.assert_array_equal(np.asarray(beside[0]), np.asarray(alone[0]),
                                      err_msg=f"seed {seed}, row 0 at {row0}, others at {others}")


@pytest.mark.parametrize("window", [0, C])
def test_reads_only_the_chunks_the_busy_rows_see(window):
    """NaN in every chunk wholly after the latest row's chunk and, with a window, in those
    between the first chunk (always read) and the earliest key shown by the window of a row past
    position 0 (a read of one would give NaN), and in the stale keys past the span: the output is
    the reference's on the clean cache. The third row sits at position 0, as the forward pass
    puts an idle slot's row: it does not hold the loop's start back."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    b, s = 3, 8 * C
    q, k, v = _inputs(rng, b, s, 4, 2, 32, jnp.float32, extra=C)
    positions = np.asarray([int(rng.integers(5 * C, 6 * C)), int(rng.integers(4 * C, 5 * C)), 0])
    lo = (positions[1] - window + 1) // C * C if window else 0
    hi = (max(positions) // C + 1) * C
    cells = np.arange(s + C)
    poison = jnp.asarray(((cells >= C) & (cells < lo)) | (cells >= hi))[None, None, :, None, None]
    k_bad, v_bad = (jnp.where(poison, jnp.nan, a) for a in (k, v))
    pos = jnp.asarray(positions, jnp.int32)
    got = chunked(q, k_bad, v_bad, pos, jnp.int32(window), jnp.int32(1), None, span=s)
    want = reference(q, k, v, pos, jnp.int32(window), jnp.int32(1), None, span=s)
    if window:
        assert lo >= 3 * C  # chunks 1 and 2 poisoned
    _close(got, want, f"seed {seed}, positions {positions.tolist()}")


def test_the_cpu_chooses_it_and_a_gpu_never_does():
    impl = next(i for i in registry.implementations("attention_decode") if i.name == "chunked")
    assert impl.fn is attention.attention_decode_chunked and attention_decode_chunked.takes_slots
    assert impl.is_available() == (jax.default_backend() == "cpu")
    names = [i.name for i in registry.implementations("attention_decode") if i.is_available()]
    if jax.default_backend() == "cpu":
        assert names.index("chunked") < names.index("reference")
