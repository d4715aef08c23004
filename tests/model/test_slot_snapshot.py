"""model/slot_snapshot.py on a small cache of random keys and values (no model): a slot's
positions read and written back bit for bit in bf16, f16, f32 and fp8, as a slot file stores them
(unsigned integers of the dtype's width), the other slots and positions untouched; the programs
compiled on the caller's thread are the ones the writes and reads then run."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from model.forward import KVCache
from model.runner import SlotState
from model.slot_snapshot import SlotSnapshots
from tests.model.conftest import compiles_seen, no_compiles

L, B, S, K, D, V = 3, 4, 64, 2, 8, 50


class _Runner(SlotSnapshots):
    def __init__(self, dtype) -> None:
        rng = np.random.default_rng(0)
        self.cfg = types.SimpleNamespace(arch="llama", num_layers=L, num_kv_heads=K, head_dim=D, vocab_size=V)
        self.num_slots, self.max_context = B, S
        self._cache = KVCache(*(jnp.asarray(rng.standard_normal((L, B, S, K, D)), dtype) for _ in range(2)))
        self._state = SlotState.create(B, V, S)

    def _bucket(self, end: int) -> int:
        return 16 if end <= 16 else S


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_a_slots_positions_go_out_and_back_bit_for_bit(dtype):
    runner = _Runner(jnp.dtype(dtype))
    before_k, before_v = np.asarray(runner._cache.k), np.asarray(runner._cache.v)
    runner.prepare_slot_read(24)
    read = runner.read_slot(1, 24)
    assert len(read[0]) == len(read[1]) == L and read[0][0].shape == (S, K, D)  # per layer, a bucket of 64
    k, v = (np.stack([np.asarray(layer)[:24] for layer in part]) for part in read)  # the first 24 kept
    assert k.shape == (L, 24, K, D) and np.array_equal(k, before_k[:, 1, :24]) and np.array_equal(v, before_v[:, 1, :24])
    bits = np.dtype(f"u{jnp.dtype(dtype).itemsize}")
    tokens = np.arange(24, dtype=np.int32) % V
    runner.write_slot(3, runner.stage_slot(tokens, k.view(bits), v.view(bits)))  # as a slot file hands them back
    after_k, after_v = np.asarray(runner._cache.k), np.asarray(runner._cache.v)
    assert np.array_equal(after_k[:, 3, :24], k) and np.array_equal(after_v[:, 3, :24], v)
    assert not after_k[:, 3, 24:].any() and not after_v[:, 3, 24:].any()  # past n: nothing held
    others = [0, 1, 2]
    assert np.array_equal(after_k[:, others], before_k[:, others]) and np.array_equal(after_v[:, others], before_v[:, others])
    history = np.asarray(runner._state.history)
    assert np.array_equal(history[3, :24], tokens) and not history[3, 24:].any() and not history[others].any()
    assert runner.slot_layout() == {"arch": "llama", "num_layers": L, "num_kv_heads": K, "head_dim": D,
                                    "vocab_size": V, "kv_dtype": dtype, "kv_itemsize": jnp.dtype(dtype).itemsize}


def test_the_caller_compiles_so_the_write_and_read_do_not():
    """stage_slot and prepare_slot_read compile on the caller's thread; the engine thread's
    write_slot and read_slot then find the programs compiled."""
    runner = _Runner(jnp.bfloat16)
    rows = np.zeros((L, 8, K, D), jnp.bfloat16)
    staged = runner.stage_slot(np.zeros((8,), np.int32), rows, rows)
    runner.prepare_slot_read(8)
    with no_compiles():
        runner.write_slot(0, staged)
        runner.read_slot(0, 8)[0][0].block_until_ready()
    with compiles_seen() as compiles:  # (the check sees a program compiled at its first call)
        _Runner(jnp.bfloat16).read_slot(0, 40)[0][0].block_until_ready()
    assert compiles


def test_wrong_shapes_dtypes_and_slots_are_refused():
    runner = _Runner(jnp.bfloat16)
    rows = np.zeros((L, 8, K, D), jnp.bfloat16)
    tokens = np.zeros((8,), np.int32)
    with pytest.raises(ValueError, match="slot 4 is not one of"):
        runner.write_slot(4, runner.stage_slot(tokens, rows, rows))
    with pytest.raises(ValueError, match="want"):
        runner.stage_slot(tokens[:7], rows, rows)
    with pytest.raises(ValueError, match="want bfloat16"):
        runner.stage_slot(tokens, rows.astype(np.float32), rows.astype(np.float32))
    with pytest.raises(ValueError, match="positions: want 1 to 63"):
        runner.read_slot(0, 64)
