"""model/transfer.py: a pytree of small host arrays as one buffer of words, and step outputs in
pinned host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import sampling, transfer
from model.step_types import SamplingParams


def test_words_round_trip_a_sampling_pack_bit_for_bit() -> None:
    """Every leaf of a sampling pack (f32, int32, uint32 of several shapes, NaN and negative
    zero included) comes back from the device with its dtype, shape and bits."""
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**63 - 5, logit_bias=((3, -1.5), (7, 2.0))),
              None, SamplingParams(temperature=0.0, min_p=0.05, repetition_penalty=1.1, top_logprobs=3)]
    pack = sampling.pack_sampling(params, max_bias=4, rng=np.random.default_rng(0))
    pack = pack._replace(presence_penalty=np.asarray([np.nan, -0.0, 1e-30], np.float32))
    words, layout = transfer.pack_words(pack)
    assert words.dtype == np.int32 and words.ndim == 1
    got = jax.jit(transfer.unpack_words, static_argnums=1)(jax.device_put(words), layout)
    for name, want, have in zip(pack._fields, pack, got):
        have = np.asarray(have)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert have.tobytes() == np.ascontiguousarray(want).tobytes(), name


def test_words_refuse_dtypes_not_four_bytes_wide() -> None:
    with pytest.raises(TypeError, match="4-byte"):
        transfer.pack_words({"a": np.zeros((2,), np.float32), "b": np.zeros((2,), np.bool_)})


def test_host_outputs_are_read_as_device_outputs_are() -> None:
    """A program whose outputs the host_outputs sharding places gives the same values, and still
    takes and gives back a donated buffer in device memory."""
    host = transfer.host_outputs(None)
    if host is None:
        pytest.skip("the default device has no pinned host memory")

    def step(x, y):
        return x + 1, (y * 2, jnp.argmax(x))

    x = jnp.arange(6, dtype=jnp.float32)
    plain = jax.jit(step)(x, jnp.ones((3,), jnp.int32))
    placed = jax.jit(step, donate_argnums=0, out_shardings=(None, host))(jnp.arange(6, dtype=jnp.float32),
                                                                          jnp.ones((3,), jnp.int32))
    assert placed[1][0].sharding.memory_kind == "pinned_host"
    assert placed[0].sharding.memory_kind != "pinned_host"
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(placed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("num_top", [0, 3])
def test_step_outputs_round_trip_through_one_array(num_top: int) -> None:
    """The runner's one output array (`_pack_outputs`, in the program) gives back on the host
    (`_unpack_outputs`) each field's values and bits: tokens, flags, logprobs (-inf and -0.0
    among them) and top ids and logprobs, for a decode step's rows, a stack of steps and a
    prefill's single row."""
    from model.pending import _unpack_outputs
    from model.runner import _pack_outputs

    rng = np.random.default_rng(0)
    steps, slots = 2, 4
    fields = (rng.integers(0, 262144, (steps, slots)).astype(np.int32), rng.random((steps, slots)) < 0.5,
              np.asarray([[-np.inf, -0.0, -1.5, -3e-8]] * steps, np.float32),
              rng.integers(0, 262144, (steps, slots, num_top)).astype(np.int32),
              -rng.random((steps, slots, num_top)).astype(np.float32))
    for sel in ((slice(None),), (0,), (1, 2)):  # stacked steps, one step's rows, one row
        want = tuple(f[sel] for f in fields)
        packed = np.asarray(jax.jit(_pack_outputs)(*want))
        assert packed.dtype == np.int32 and packed.shape[-1] == 3 + 2 * num_top
        for w, g in zip(want, _unpack_outputs(packed)):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
