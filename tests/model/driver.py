"""Drives a ModelRunner directly (no engine thread): prefill prompts in fixed chunks, then
decode them together, greedily. Used by the model-level correctness tests."""

from __future__ import annotations

import numpy as np

from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan

GREEDY = SamplingParams(temperature=0.0)


def generate(runner, prompts: list[list[int]], num_tokens: int, slots: list[int] | None = None,
             sampling: SamplingParams = GREEDY, stop_ids: frozenset[int] = frozenset()) -> list[list[int]]:
    """Generates up to `num_tokens` tokens for each prompt, each in its own slot, all at once."""
    slots = slots if slots is not None else list(range(len(prompts)))
    chunk = runner.prefill_chunks[-1]
    out: list[list[int]] = [[] for _ in prompts]
    setups = tuple(SlotSetup(s, sampling) for s in slots)
    prefills = []
    for s, ids in zip(slots, prompts):
        for start in range(0, len(ids), chunk):
            piece = np.asarray(ids[start:start + chunk], np.int32)
            prefills.append(PrefillChunk(s, piece, start, start + chunk >= len(ids)))
    res = runner.dispatch(StepPlan(setups=setups, prefills=tuple(prefills))).result()
    live = []
    for i, s in enumerate(slots):
        out[i].append(int(res.tokens[s]))
        if out[i][-1] not in stop_ids and num_tokens > 1:
            live.append(i)
    while live:
        res = runner.dispatch(StepPlan(decode_slots=tuple(slots[i] for i in live))).result()
        nxt = []
        for i in live:
            assert res.valid[slots[i]]
            out[i].append(int(res.tokens[slots[i]]))
            if out[i][-1] not in stop_ids and len(out[i]) < num_tokens:
                nxt.append(i)
        live = nxt
    return out
