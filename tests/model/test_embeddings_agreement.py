"""The pooled embeddings of the scored prefill (PromptScores.hidden_*: the server's
/v1/embeddings) against llama.cpp's on the committed fixture (tests/fixtures/embeddings_smollm2.json,
recorded by tests/fixtures/record_embeddings.py, which gives llama.cpp each prompt in one batch):
llama.cpp's token ids of each prompt, prefilled here in scored chunks of 512, pooled as the mean
over the prompt's tokens and as its last token's, before any normalization.

Native numerics (f32 here) against llama.cpp's (8-bit activations, f16 attention) move each
hidden value a little, so the bar is the direction and the length of the vector, not its bits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan

MIN_COSINE = 0.999
MAX_NORM_RATIO = 0.01  # |1 - |ours| / |llama.cpp's||


@pytest.fixture(scope="module")
def pooled(smol_runner, fixtures_dir):
    cases = json.loads((fixtures_dir / "embeddings_smollm2.json").read_text())["cases"]
    size = smol_runner.prefill_chunks[-1]
    out = []
    for case in cases:
        ids = case["prompt_ids"]
        chunks = [PrefillChunk(6, np.asarray(ids[start:start + size], np.int32), start, start + size >= len(ids),
                               score=True, next_token=ids[start + size] if start + size < len(ids) else -1)
                  for start in range(0, len(ids), size)]
        total, last, n = 0.0, None, 0
        for chunk in chunks:  # one a step, as the engine's budget of 512 runs them
            setup = (SlotSetup(6, SamplingParams(temperature=0.0)),) if chunk.start_pos == 0 else ()
            (scores,) = smol_runner.dispatch(StepPlan(setups=setup, prefills=(chunk,))).result().scores
            total, last, n = total + scores.hidden_sum.astype(np.float64), scores.hidden_last, n + scores.hidden_tokens
        assert n == len(ids)
        out.append((case, {"mean": total / n, "last": np.asarray(last, np.float64)}))
    return out


def test_fixture_covers_chunked_prompts(pooled):
    assert len(pooled) >= 10 and sum(len(c["prompt_ids"]) > 1024 for c, _ in pooled) >= 2


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooled_vectors_point_where_llama_cpps_do(pooled, pooling):
    cosines, ratios = [], []
    for case, ours in pooled:
        ref, got = np.asarray(case[pooling]), ours[pooling]
        cosines.append(float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)))
        ratios.append(abs(1 - np.linalg.norm(got) / np.linalg.norm(ref)))
    worst = int(np.argmin(cosines))
    assert min(cosines) >= MIN_COSINE, f"{pooled[worst][0]['name']}: cosine {cosines[worst]:.5f}"
    assert max(ratios) <= MAX_NORM_RATIO, f"norm ratios off by up to {max(ratios):.4f}"
    # a different prompt's vector is much further off: the check can tell prompts apart
    others = [float(np.asarray(pooled[(i + 1) % len(pooled)][0][pooling]) @ ours[pooling]
                    / np.linalg.norm(pooled[(i + 1) % len(pooled)][0][pooling]) / np.linalg.norm(ours[pooling]))
              for i, (_, ours) in enumerate(pooled)]
    assert max(others) < MIN_COSINE
