"""Scored prompt chunks (PrefillChunk.score) run at every prefill chunk size, as plain ones do:
on a tiny model with chunks of 8, 16 and 32, a 12-token scored chunk runs the 16-row scoring
program (warm-up compiled it) and scores what the same prompt scored in chunks of 8 scores."""

from __future__ import annotations

import numpy as np
import pytest

from model.config import EngineConfig
from model.loader import load_model
from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan


@pytest.fixture(scope="module")
def runner(tiny_tp_path):
    cfg = EngineConfig(num_slots=2, max_context=64, prefill_budget=32, prefill_chunks=(8, 16, 32),
                       context_buckets=(64,), max_top_logprobs=4)
    runner = load_model(tiny_tp_path, cfg).make_runner(cfg)
    runner.warmup()
    return runner


def _scores(runner, prompt: np.ndarray, slot: int, size: int):
    """The prompt scored in chunks of `size` tokens, one a step; the scores in order."""
    out = []
    for start in range(0, len(prompt), size):
        end = min(start + size, len(prompt))
        chunk = PrefillChunk(slot, prompt[start:end], start, end == len(prompt), score=True,
                             next_token=int(prompt[end]) if end < len(prompt) else -1)
        setup = (SlotSetup(slot, SamplingParams(temperature=0.0)),) if start == 0 else ()
        out += runner.dispatch(StepPlan(setups=setup, prefills=(chunk,))).result().scores
    return out


def test_a_scored_chunk_runs_at_the_smallest_size_that_holds_it(runner):
    assert {key[1] for key in runner._compiled if key[0] == "score"} == {8, 16, 32}
    used = []
    program = runner._program
    runner._program = lambda kind, size, *a, **k: used.append((kind, size)) or program(kind, size, *a, **k)
    try:
        prompt = np.random.default_rng(3).integers(0, runner.vocab_size, 12, dtype=np.int32)
        whole = _scores(runner, prompt, 0, 12)
        assert used == [("score", 16)]
        parts = _scores(runner, prompt, 1, 8)
        assert used[1:] == [("score", 8)] * 2
    finally:
        del runner._program
    (one,) = whole
    assert one.first == 1 and len(one.logprobs) == 11 and [p.first for p in parts] == [1, 9]
    np.testing.assert_array_equal(one.top_ids[:, 0], np.concatenate([p.top_ids[:, 0] for p in parts]))
    np.testing.assert_allclose(one.logprobs, np.concatenate([p.logprobs for p in parts]), atol=1e-3)
