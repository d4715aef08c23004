"""Pooled embeddings (GenerationRequest.pooling) through the engine over the fake model
(tests/scheduler/conftest.py), whose scored chunks pool `fake_hidden` of each prompt token: the
mean over every prompt token or the last one's, on the final event, across chunks and steps,
beside generating requests, with no prompt cache reuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from scheduler.types import FINISH_LENGTH, RequestValidationError
from tests.scheduler.conftest import fake_hidden
from tests.scheduler.streams import collect, collect_one, req, run


def _expected(prompt: list[int], pooling: str) -> np.ndarray:
    rows = [fake_hidden(t, p) for p, t in enumerate(prompt)]
    return rows[-1] if pooling == "last" else np.mean(rows, axis=0)


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "parts"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_the_whole_prompt_is_pooled_across_chunks(make_engine, fake_model_cls, parts, pooling):
    """19 tokens in chunks of 8 (three chunks over two steps): one event, the embedding of all 19."""
    prompt = list(range(65, 84))
    engine, model = make_engine(fake_model_cls(parts=parts))
    result = run(collect_one(engine, req(prompt, 0, pooling=pooling)))
    assert len(result.events) == 1 and result.final.finish_reason == FINISH_LENGTH
    assert result.tokens == [] and result.final.completion_tokens == 0 and result.final.prompt_tokens == 19
    np.testing.assert_allclose(result.final.embedding, _expected(prompt, pooling), rtol=1e-6)
    assert result.final.prompt_logprobs == ()  # scored chunks, but no logprobs asked for
    assert sum(c.score for plan in model.plans for c in plan.prefills) == 3
    plain = run(collect_one(engine, req(prompt, 2)))
    assert plain.final.embedding is None


def test_embeddings_beside_generating_requests_leave_their_tokens_alone(make_engine, fake_model_cls):
    """Four requests in four slots, two of them embeddings of the same prompts as the others,
    a warm prompt cache: the embeddings reuse nothing and are each their prompt's alone."""
    prompts = [list(range(65 + i, 85 + 2 * i)) for i in range(4)]
    engine, _ = make_engine(fake_model_cls(num_slots=4, context_tokens=True))
    alone = [run(collect_one(engine, req(p, 6))) for p in prompts]

    async def together():
        streams = [engine.submit(req(p, 0, pooling="mean") if i % 2 else req(p, 6)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run(together())
    for i, (p, r) in enumerate(zip(prompts, results)):
        if i % 2:
            assert r.final.cached_tokens == 0 and r.tokens == []
            np.testing.assert_allclose(r.final.embedding, _expected(p, "mean"), rtol=1e-6)
        else:
            assert r.tokens == alone[i].tokens and r.final.embedding is None


def test_embeddings_are_refused_without_scored_programs_or_with_tokens_to_generate(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(scores_prompts=False))
    with pytest.raises(RequestValidationError, match="embeddings need the scored prompt programs") as err:
        engine.submit(req("abc", 0, pooling="last"), loop=asyncio.new_event_loop())
    assert err.value.field == "input"
    with pytest.raises(RequestValidationError, match="generates nothing"):
        req("abc", 2, pooling="mean")
    with pytest.raises(RequestValidationError, match="pooling must be one of mean, last"):
        req("abc", 0, pooling="cls")


def test_embeddings_keep_to_the_slots_that_hold_nothing(make_engine, fake_model_cls):
    """Two slots, a chat's prompt cached in one: embeddings one after another hold none of their
    chunks, so each takes the slot the last one left empty, and the chat's next request still
    reuses its prefix."""
    chat = list(range(65, 90))
    engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    first = run(collect_one(engine, req(chat, 2)))
    for i in range(3):
        run(collect_one(engine, req(list(range(100 + i, 125 + i)), 0, pooling="last")))
    again = run(collect_one(engine, req(chat, 2)))
    assert again.final.cached_tokens == 24 and again.tokens == first.tokens
