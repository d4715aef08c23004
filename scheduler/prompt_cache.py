"""The engine's prompt cache (scheduler/engine.py's module docstring): which prompt tokens each
slot's keys and values hold, and where a new request goes to reuse the most of them.

Per slot it remembers the tokens of the whole chunks (the largest compiled size, from position
0) prefilled there, the `cache_salt` of the requests that prefilled them, when its last request
ended, and how many of its tokens a prefix copy may read in the step being planned (the chunks
dispatched in earlier steps). Only the engine thread touches it.
"""

from __future__ import annotations

import numpy as np

from model.step_types import PrefixCopy


class PromptCache:
    def __init__(self, num_slots: int, largest_chunk: int, enabled: bool = True) -> None:
        self.largest = largest_chunk
        self.enabled = enabled
        self.held: list[np.ndarray] = [np.zeros((0,), np.int32)] * num_slots
        self.freed_at: list[float] = [0.0] * num_slots
        self.copyable: list[int] = [0] * num_slots  # of a slot's held tokens, those a copy may read now
        self.salts: list[str] = [""] * num_slots  # the cache_salt of the requests that prefilled them

    def start_step(self) -> None:
        """A step is being planned: a copy may read what earlier steps dispatched (the step's
        prompt chunks run after its copies)."""
        self.copyable = [len(held) for held in self.held]

    def matched(self, slot: int, prompt: np.ndarray, salt: str, limit: int) -> int:
        """How many of the prompt's first tokens, in whole chunks and at most `limit`, the slot
        holds for this cache_salt."""
        if self.salts[slot] != salt:
            return 0
        held = self.held[slot]
        n = min(len(held), limit)
        differ = np.flatnonzero(held[:n] != prompt[:n])
        return (int(differ[0]) if differ.size else n) // self.largest * self.largest

    def pick_slot(self, prompt: np.ndarray, salt: str, reuse: bool, free: list[int]) -> tuple[int, int, int | None]:
        """(the free slot for a request, how many of its prompt tokens it reuses, the slot they
        are copied from or None): the free slot holding the longest match of whole chunks,
        leaving at least one token to prefill, unless another slot holds a longer one, copied
        into the free slot that holds nothing, else the one idle longest; without a match, that
        slot too. A request that may not `reuse` (cache_prompt off, prompt logprobs) reuses
        nothing but is placed the same way (other slots' caches last)."""
        if not self.enabled:
            return free[0], 0, None
        limit = (len(prompt) - 1) // self.largest * self.largest if reuse else 0
        spare = max(free, key=lambda s: (len(self.held[s]) == 0, -self.freed_at[s]))
        own, reused = max(((s, self.matched(s, prompt, salt, limit)) for s in free),
                          key=lambda sm: (sm[1], sm[0] == spare))
        src, copied = max(((s, self.matched(s, prompt, salt, min(limit, self.copyable[s])))
                           for s in range(len(self.held))), key=lambda sm: sm[1])
        if copied > reused:
            return spare, copied, src
        return (own, reused, None) if reused else (spare, 0, None)

    def admit(self, slot: int, reused: int, src: int | None, salt: str) -> PrefixCopy | None:
        """A request takes `slot` reusing its first `reused` tokens (from `src`, or the slot's
        own); returns the copy that brings them there, if any."""
        copy = None
        if src is None:
            self.held[slot] = self.held[slot][:reused]  # the rest is overwritten from here on
        else:
            copy = PrefixCopy(src, slot, reused)
            self.held[slot] = self.held[src][:reused]
        self.copyable[slot] = reused  # (its chunks planned in this step: not before the next)
        self.salts[slot] = salt
        return copy

    def hold(self, slot: int, tokens: np.ndarray) -> None:
        """A chunk dispatched into the slot after what it holds; kept if it is a whole one."""
        if len(tokens) == self.largest:
            self.held[slot] = np.concatenate([self.held[slot], tokens])

    def free(self, slot: int, now: float) -> None:
        self.freed_at[slot] = now

    def restore(self, slot: int, tokens: np.ndarray, salt: str, now: float) -> None:
        """The idle slot's keys and values at positions [0, len(tokens)) were just written (a
        restored slot file, scheduler/slot_files.py): whole chunks of these tokens."""
        self.held[slot] = tokens
        self.salts[slot] = salt
        self.freed_at[slot] = now

    def forget(self, slot: int) -> int:
        """The idle slot holds nothing to reuse any more; returns how many tokens it held."""
        num_held = len(self.held[slot])
        self.held[slot] = np.zeros((0,), np.int32)
        self.copyable[slot] = 0
        self.salts[slot] = ""
        return num_held
