"""The engine's planning half: what each step runs (`StepPlan`), from the slot table, the waiting
queue and the prompt cache, within the step's token budget (scheduler/engine.py's module
docstring, step 3).

`StepPlanner` is a base of `Engine` and works on its state (`_slots`, `_waiting`, `_prompts`,
`_chunk_sizes`, `_decode_steps`, the counters), on the engine thread only: the decode rows of
every decoding slot first, then chunks of the prompts being prefilled, oldest first, then
waiting requests admitted to free slots in arrival order while their first chunk fits.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from model.step_types import PrefillChunk, SlotSetup, StepPlan
from scheduler import grammar
from scheduler.requests import RequestState
from scheduler.types import FINISH_ERROR

log = logging.getLogger(__name__)


class PlannedRows(dict):
    """A dispatched step's {slot: request} of the rows it samples, and in `scored` those of its
    scored prompt chunks (PrefillChunk.score), as the slots were when it was planned."""

    def __init__(self) -> None:
        super().__init__()
        self.scored: dict[int, RequestState] = {}


class StepPlanner:
    """Engine's step planning (module docstring); its attributes are the Engine's."""

    def _chunk_cost(self, num_tokens: int) -> int:
        """Tokens the device computes for a chunk: the compiled size it is padded to."""
        return next(s for s in self._chunk_sizes if num_tokens <= s)

    def _plan_step(self) -> tuple[StepPlan | None, PlannedRows]:
        rows = PlannedRows()
        decoding = [
            (slot, state) for slot, state in enumerate(self._slots)
            if state is not None and state.is_decoding and state.num_scheduled < state.limit and self._plannable(state)
        ]
        # Several decode steps in one dispatch only when no prompt is waiting or being prefilled,
        # every decoding request has room for all of them (max_tokens is never overrun), and none
        # samples under a grammar (its allowed tokens follow each token read).
        steps = self._decode_steps[-1]
        if steps > 1 and (
            self._waiting
            or any(s is not None and not s.is_decoding for s in self._slots)
            or any(state.limit - state.num_scheduled < steps or state.matcher is not None for _, state in decoding)
        ):
            steps = 1
        decode_slots = []
        allowed: list[tuple[int, np.ndarray]] = []
        deferred: list[int] = []
        known = self._allowed_rows({slot: s for slot, s in decoding if s.matcher is not None and not s.tokens_in_flight})
        for slot, state in decoding:
            if state.matcher is not None and state.tokens_in_flight:
                deferred.append(slot)  # its row once its token in flight is read (`_supply`)
            elif state.matcher is not None:
                row = known[slot]
                if row is None:
                    continue
                allowed.append((slot, row))
            decode_slots.append(slot)
            state.num_scheduled += steps
            rows[slot] = state
        budget = self.config.prefill_budget
        prefills: list[PrefillChunk] = []
        self._prompts.start_step()
        # Prompts already in a slot continue first, oldest first; each takes what fits.
        prefilling = sorted((s for s in self._slots if s is not None and not s.is_decoding), key=lambda s: s.seq)
        for state in prefilling:
            budget = self._plan_chunks(state, budget, prefills, rows, allowed)
        # Then waiting requests take free slots in arrival order while their first chunk fits.
        setups, copies = [], []
        now = time.monotonic()
        free = [slot for slot, state in enumerate(self._slots) if state is None]
        while self._waiting and free:
            state = self._waiting[0]
            request = state.request
            slot, reused, src = self._prompts.pick_slot(state.prompt, request.cache_salt,
                                                        request.cache_prompt and not state.scores_prompt, free)
            if self._chunk_cost(min(self._chunk_sizes[-1], state.num_prompt - reused)) > budget:
                break
            self._waiting.popleft()
            free.remove(slot)
            state.slot = slot
            state.admitted_at = now
            state.num_reused = state.num_prefilled = reused
            copy = self._prompts.admit(slot, reused, src, request.cache_salt)
            if copy is not None:
                copies.append(copy)
            self._prompt_tokens_cached_total += reused
            self._slots[state.slot] = state
            setups.append(SlotSetup(state.slot, state.request.sampling))
            budget = self._plan_chunks(state, budget, prefills, rows, allowed)
        if not decode_slots and not prefills and not setups:
            # (a request admitted whose grammar then failed leaves its setup, and maybe the copy
            # the prompt cache already counts as held there: the plan still runs them)
            return None, rows
        plan = StepPlan(
            setups=tuple(setups), copies=tuple(copies), decode_slots=tuple(decode_slots), prefills=tuple(prefills),
            num_decode_steps=steps if decode_slots and not prefills else 1, allowed=tuple(allowed),
            deferred=tuple(deferred),
        )
        return plan, rows

    def _plannable(self, state: RequestState) -> bool:
        """A constrained request decodes once its tokens in flight are read, or with a model that
        defers allowed tokens (StepPlan.deferred) with one still in flight, whose step is then the
        newest (the engine supplies a deferred step before it plans another)."""
        return state.matcher is None or state.tokens_in_flight == 0 or (self._defers and state.tokens_in_flight == 1)

    def _allowed_rows(self, states: dict[int, RequestState]) -> dict[int, np.ndarray | None]:
        """The tokens each constrained request may sample next (grammar.masks); None where its
        grammar failed (that request alone is ended). With ignore_eos, not the end-of-generation
        tokens where the grammar allows others (llama.cpp's ignore_eos): `[a-z ]*` runs on."""
        rows: dict[int, np.ndarray | None] = {}
        if not states:  # (every plan asks; most have no constrained row)
            return rows
        for (slot, state), row in zip(states.items(), grammar.masks([state.matcher for state in states.values()])):
            if isinstance(row, Exception):
                log.error("request %s: its grammar failed: %s", state.request.request_id, row)
                self._finish(state, FINISH_ERROR, error=f"{type(row).__name__}: {row}")
                rows[slot] = None
            else:
                rows[slot] = grammar.without(row, self.tokenizer.eog_ids) if state.request.ignore_eos else row
        return rows

    def _plan_chunks(
        self, state: RequestState, budget: int, prefills: list[PrefillChunk], rows: PlannedRows,
        allowed: list[tuple[int, np.ndarray]],
    ) -> int:
        """Adds the request's next prompt chunks that fit in `budget`; returns what is left (and,
        for a constrained request's last chunk, its first token's allowed tokens to `allowed`).

        Chunks are [k*C, min((k+1)*C, P)) for the largest chunk size C: fixed by the prompt alone.
        """
        largest = self._chunk_sizes[-1]
        while not state.is_decoding:
            start = state.num_prefilled
            end = min(start + largest, state.num_prompt)
            cost = self._chunk_cost(end - start)
            if cost > budget:
                break
            is_last = end == state.num_prompt
            if is_last and state.matcher is not None:
                row = self._allowed_rows({state.slot: state})[state.slot]
                if row is None:
                    break
                allowed.append((state.slot, row))
            budget -= cost
            tokens = state.prompt[start:end]
            scored = dict(score=True, next_token=-1 if is_last else int(state.prompt[end])) if state.scores_prompt else {}
            if scored:
                rows.scored[state.slot] = state
            prefills.append(PrefillChunk(state.slot, tokens, start, is_last, state.num_reused, **scored))
            # held since admission: [0, start), the chunks before this one; an embedding's are not, so its
            # slot holds nothing and is the next request's first pick: a batch of them keeps to the same
            # slots instead of evicting every chat's prefix
            if state.request.pooling is None:
                self._prompts.hold(state.slot, tokens)
            state.num_prefilled = end
            self._prompt_tokens_total += end - start
            if is_last:
                state.num_scheduled = 1  # the last chunk samples the first token
                rows[state.slot] = state
        return budget
