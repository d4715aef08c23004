"""A slot's cached keys and values, read out of the KV cache and written back: what llama-server's
`POST /slots/{id}?action=save|restore` saves to a file and loads again (scheduler/slot_files.py
holds the file and the engine's side; server/app.py the route).

`SlotSnapshots` is a mixin of `model.runner.ModelRunner`: it works on the runner's cache and slot
state in place, between steps, on the engine thread. What it moves is positions [0, n) of one
slot: every layer's keys and values, and the prompt tokens at those positions (`SlotState.history`,
which gives a request reusing the prefix that prefix's prompt mask). Both programs take a whole
context bucket (the smallest holding n): one compiled program per bucket and direction, compiled
at its first use rather than at start-up (a slot action is rare and no step runs it), on the
caller's thread (`prepare_slot_read`, `stage_slot`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.forward import KVCache


def _read(span: int, cache: KVCache, slot: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """(keys, values), each a layer's [span, K, D] apiece: a save copies them to the host one layer
    at a time (one copy of a 7B's 2,560 positions held the engine thread's process for 0.5 s)."""
    zero = jnp.zeros((), jnp.int32)

    def rows(buf: jax.Array) -> tuple[jax.Array, ...]:  # [L, B, S, K, D]
        whole = jax.lax.dynamic_slice(buf, (zero, slot, zero, zero, zero), (buf.shape[0], 1, span, *buf.shape[3:]))
        return tuple(whole[layer, 0] for layer in range(buf.shape[0]))

    return rows(cache.k), rows(cache.v)


def _write(cache: KVCache, st: Any, slot: jax.Array, tokens: jax.Array, k: jax.Array, v: jax.Array):
    """tokens [span] int32, k and v [L, span, K, D]: positions [0, span) of the slot."""
    zero = jnp.zeros((), jnp.int32)

    def put(buf: jax.Array, rows: jax.Array) -> jax.Array:  # [L, B, S, K, D]
        return jax.lax.dynamic_update_slice(buf, rows[:, None].astype(buf.dtype), (zero, slot, zero, zero, zero))

    history = jax.lax.dynamic_update_slice(st.history, tokens[None], (slot, zero))
    return KVCache(put(cache.k, k), put(cache.v, v)), dataclasses.replace(st, history=history)


@dataclasses.dataclass(frozen=True)
class StagedSlot:
    """A slot's positions ready to be written (`SlotSnapshots.stage_slot`): on the device where the
    cache is on one, padded to the context bucket, the write program compiled for it."""

    num_tokens: int
    span: int
    tokens: Any  # [span] int32
    k: Any  # [L, span, K, D], the cache's dtype
    v: Any


class SlotSnapshots:
    """`ModelRunner`'s slot snapshots (module docstring). Uses the runner's `_cache`, `_state`,
    `_bucket` (the smallest context bucket holding n positions), `cfg`, `num_slots` and
    `max_context`.

    `read_slot` and `write_slot` run on the engine thread, between steps; `prepare_slot_read` and
    `stage_slot` on the caller's, so that the engine thread only dispatches: the copy of a file's
    keys and values to the device (2 GiB for a 7B's 4,096 positions) and a program's first compile
    happen beside the steps, not between them. (On several devices the copy and the compile are
    left to the engine thread.)"""

    _cache: KVCache
    _state: Any
    cfg: Any
    num_slots: int
    max_context: int
    _slot_programs: dict | None = None  # (kind, span) -> the jitted program
    _programs_lock = threading.Lock()

    def slot_layout(self) -> dict[str, Any]:
        """What a saved slot must match to be written into this runner's cache: the shape of a
        position's keys (and values), their dtype and the vocabulary its tokens come from."""
        dtype = jnp.dtype(self._cache.k.dtype)
        return {"arch": self.cfg.arch, "num_layers": self.cfg.num_layers, "num_kv_heads": self.cfg.num_kv_heads,
                "head_dim": self.cfg.head_dim, "vocab_size": self.cfg.vocab_size, "kv_dtype": dtype.name,
                "kv_itemsize": dtype.itemsize}

    def _slot_program(self, kind: str, span: int):
        with self._programs_lock:
            if self._slot_programs is None:
                self._slot_programs = {}
            programs = self._slot_programs
            if (kind, span) not in programs:
                # On one device every input is placed there, committed or not, so that a program
                # compiled ahead from shapes (`_shapes`) is the one a call finds.
                one = self._cache.k.sharding if self._one_device() else None
                if kind == "read":
                    programs[kind, span] = jax.jit(lambda cache, slot: _read(span, cache, slot),
                                                   **({"in_shardings": one} if one else {}))
                else:  # the results keep the cache's and the state's placement (split over devices, or not)
                    placed = jax.tree.map(lambda a: a.sharding, (self._cache, self._state))
                    programs[kind, span] = jax.jit(_write, donate_argnums=(0, 1), out_shardings=placed,
                                                   **({"in_shardings": one} if one else {}))
            return programs[kind, span]

    def _one_device(self) -> bool:
        return len(self._cache.k.sharding.device_set) == 1

    def _shapes(self, *trees: Any) -> Any:  # (shapes, dtypes and placements only: any thread may read them)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                            trees)

    def _check_slot(self, slot: int, num_tokens: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not one of this runner's {self.num_slots}")
        if not 0 < num_tokens < self.max_context:
            raise ValueError(f"{num_tokens} positions: want 1 to {self.max_context - 1}")

    def prepare_slot_read(self, num_tokens: int) -> None:
        """Any thread: compiles the read of that many positions ahead of `read_slot` (one device)."""
        if 0 < num_tokens < self.max_context and self._one_device():
            span = self._bucket(num_tokens)
            self._slot_program("read", span).lower(*self._shapes(self._cache, np.int32(0))).compile()

    def read_slot(self, slot: int, num_tokens: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """The keys and values at the slot's positions [0, num_tokens): per layer, [span, K, D] for
        the smallest context bucket `span` holding them (the caller keeps the first num_tokens):
        device arrays, dispatched after the steps already dispatched and not waited for."""
        self._check_slot(slot, num_tokens)
        span = self._bucket(num_tokens)
        return self._slot_program("read", span)(self._cache, np.int32(slot))

    def stage_slot(self, tokens: np.ndarray, k: np.ndarray, v: np.ndarray) -> StagedSlot:
        """Any thread: positions [0, n) for `write_slot`: tokens [n] (the prompt tokens there), k and
        v [L, n, K, D] in this runner's cache dtype (`slot_layout`), or their bit patterns as
        unsigned integers of its width. Positions past n up to the bucket's end become zeros."""
        n = int(tokens.shape[0])
        self._check_slot(0, n)
        want = (self.cfg.num_layers, n, self.cfg.num_kv_heads, self.cfg.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"keys {k.shape} and values {v.shape}: want {want}")
        dtype = np.dtype(self._cache.k.dtype)
        k, v = (a.view(dtype) if a.dtype == np.dtype(f"u{dtype.itemsize}") else a for a in (k, v))
        if k.dtype != dtype or v.dtype != dtype:
            raise ValueError(f"keys {k.dtype} and values {v.dtype}: want {dtype}")
        span = self._bucket(n)
        pad = ((0, 0), (0, span - n), (0, 0), (0, 0))
        rows = (np.pad(tokens.astype(np.int32), (0, span - n)), np.pad(k, pad), np.pad(v, pad))
        if self._one_device():
            rows = jax.device_put(rows, self._cache.k.sharding)
            self._slot_program("write", span).lower(*self._shapes(self._cache, self._state, np.int32(0), *rows)).compile()
        return StagedSlot(n, span, *rows)

    def write_slot(self, slot: int, staged: StagedSlot) -> None:
        """The slot's positions [0, staged.span) from `stage_slot`'s rows: the slot holds nothing
        past its n."""
        self._check_slot(slot, staged.num_tokens)
        self._cache, self._state = self._slot_program("write", staged.span)(
            self._cache, self._state, np.int32(slot), staged.tokens, staged.k, staged.v)
