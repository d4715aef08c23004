"""A slot's cached keys and values, read out of the KV cache and written back: what llama-server's
`POST /slots/{id}?action=save|restore` saves to a file and loads again (scheduler/slot_files.py
holds the file and the engine's side; server/app.py the route).

`SlotSnapshots` is a mixin of `model.runner.ModelRunner`: it works on the runner's cache and slot
state in place, between steps, on the engine thread. What it moves is positions [0, n) of one
slot: every layer's keys and values, and the prompt tokens at those positions (`SlotState.history`,
which gives a request reusing the prefix that prefix's prompt mask). Both programs take a whole
context bucket (the smallest holding n): one compiled program per bucket and direction, compiled
at its first use rather than at start-up, since a slot action is rare and no step runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.forward import KVCache


def _read(span: int, cache: KVCache, slot: jax.Array) -> tuple[jax.Array, jax.Array]:  # each [L, span, K, D]
    zero = jnp.zeros((), jnp.int32)

    def rows(buf: jax.Array) -> jax.Array:  # [L, B, S, K, D]
        return jax.lax.dynamic_slice(buf, (zero, slot, zero, zero, zero), (buf.shape[0], 1, span, *buf.shape[3:]))[:, 0]

    return rows(cache.k), rows(cache.v)


def _write(cache: KVCache, st: Any, slot: jax.Array, tokens: jax.Array, k: jax.Array, v: jax.Array):
    """tokens [span] int32, k and v [L, span, K, D]: positions [0, span) of the slot."""
    zero = jnp.zeros((), jnp.int32)

    def put(buf: jax.Array, rows: jax.Array) -> jax.Array:  # [L, B, S, K, D]
        return jax.lax.dynamic_update_slice(buf, rows[:, None].astype(buf.dtype), (zero, slot, zero, zero, zero))

    history = jax.lax.dynamic_update_slice(st.history, tokens[None], (slot, zero))
    return KVCache(put(cache.k, k), put(cache.v, v)), dataclasses.replace(st, history=history)


class SlotSnapshots:
    """`ModelRunner`'s slot snapshots (module docstring). Uses the runner's `_cache`, `_state`,
    `_bucket` (the smallest context bucket holding n positions), `cfg`, `num_slots` and
    `max_context`."""

    _cache: KVCache
    _state: Any
    cfg: Any
    num_slots: int
    max_context: int
    _slot_programs: dict | None = None  # (kind, span) -> the jitted program

    def slot_layout(self) -> dict[str, Any]:
        """What a saved slot must match to be written into this runner's cache: the shape of a
        position's keys (and values), their dtype and the vocabulary its tokens come from."""
        return {"arch": self.cfg.arch, "num_layers": self.cfg.num_layers, "num_kv_heads": self.cfg.num_kv_heads,
                "head_dim": self.cfg.head_dim, "vocab_size": self.cfg.vocab_size,
                "kv_dtype": jnp.dtype(self._cache.k.dtype).name}

    def _slot_program(self, kind: str, span: int):
        if self._slot_programs is None:
            self._slot_programs = {}
        programs = self._slot_programs
        if (kind, span) not in programs:
            if kind == "read":
                programs[kind, span] = jax.jit(lambda cache, slot: _read(span, cache, slot))
            else:  # the results keep the cache's and the state's placement (split over devices, or not)
                placed = jax.tree.map(lambda a: a.sharding, (self._cache, self._state))
                programs[kind, span] = jax.jit(_write, donate_argnums=(0, 1), out_shardings=placed)
        return programs[kind, span]

    def _check_slot(self, slot: int, num_tokens: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not one of this runner's {self.num_slots}")
        if not 0 < num_tokens < self.max_context:
            raise ValueError(f"{num_tokens} positions: want 1 to {self.max_context - 1}")

    def read_slot(self, slot: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """The keys and values at the slot's positions [0, num_tokens), each [L, span, K, D] for the
        smallest context bucket `span` holding them (the caller keeps the first num_tokens): device
        arrays, dispatched after the steps already dispatched and not waited for."""
        self._check_slot(slot, num_tokens)
        span = self._bucket(num_tokens)
        return self._slot_program("read", span)(self._cache, np.int32(slot))

    def write_slot(self, slot: int, tokens: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Positions [0, n) of the slot: tokens [n] (its prompt tokens there), k and v [L, n, K, D]
        in this runner's cache dtype (`slot_layout`), or their bit patterns as unsigned integers of
        its width. Positions past n up to the bucket's end are zeroed: the slot holds nothing there."""
        n = int(tokens.shape[0])
        self._check_slot(slot, n)
        want = (self.cfg.num_layers, n, self.cfg.num_kv_heads, self.cfg.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"keys {k.shape} and values {v.shape}: want {want}")
        dtype = np.dtype(self._cache.k.dtype)
        k, v = (a.view(dtype) if a.dtype == np.dtype(f"u{dtype.itemsize}") else a for a in (k, v))
        if k.dtype != dtype or v.dtype != dtype:
            raise ValueError(f"keys {k.dtype} and values {v.dtype}: want {dtype}")
        span = self._bucket(n)
        pad = ((0, 0), (0, span - n), (0, 0), (0, 0))
        self._cache, self._state = self._slot_program("write", span)(
            self._cache, self._state, np.int32(slot), np.pad(tokens.astype(np.int32), (0, span - n)),
            np.pad(k, pad), np.pad(v, pad))
