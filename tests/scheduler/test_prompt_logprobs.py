"""Prompt logprobs (GenerationRequest.prompt_logprobs) through the engine over the fake model
(tests/scheduler/conftest.py), whose scored chunks give each prompt token `fake_score`: every
prompt token after the first on the request's first event, in order across chunks and steps,
scored chunks at the sizes plain ones run at, no prompt cache reuse for them, max_tokens 0 for scoring alone."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.types import FINISH_LENGTH, RequestValidationError
from tests.scheduler.conftest import VOCAB, fake_score
from tests.scheduler.streams import collect, collect_one, req, run, wait_until


def _check(prompt: bytes, events, k: int) -> None:
    got = events[0].prompt_logprobs
    assert [p.token_id for p in got] == list(prompt[1:])
    for position, p in enumerate(got, start=1):
        assert p.logprob == pytest.approx(fake_score(p.token_id, position), abs=1e-6)
        assert p.rank == 1 + p.token_id % 5
        assert [i for i, _ in p.top] == [(p.token_id + i) % VOCAB for i in range(k)]
    assert all(not e.prompt_logprobs for e in events[1:])


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "parts"])
def test_every_prompt_token_after_the_first_comes_on_the_first_event(make_engine, fake_model_cls, parts):
    """19 tokens in chunks of 8 (a budget of 16: two chunks a step): three scored chunks, each
    naming the token after it, the scores of all on the first event with the first token; the
    tokens generated are a plain request's."""
    prompt = bytes(range(65, 84))
    engine, model = make_engine(fake_model_cls(parts=parts))
    scored = run(collect_one(engine, req(list(prompt), 3, prompt_logprobs=2)))
    plain = run(collect_one(engine, req(list(prompt), 3)))
    assert scored.tokens == plain.tokens and scored.events[0].token_ids
    _check(prompt, scored.events, 2)
    chunks = [c for plan in model.plans for c in plan.prefills if c.score]
    assert [(c.start_pos, len(c.tokens), c.next_token, c.is_last) for c in chunks] == [
        (0, 8, prompt[8], False), (8, 8, prompt[16], False), (16, 3, -1, True)]
    assert [len(p.prefills) for p in model.plans[:2]] == [2, 1]  # each scored chunk costs a whole 8
    assert not plain.events[0].prompt_logprobs


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_engine, fake_model_cls):
    prompt = b"scoring only"
    engine, _ = make_engine(fake_model_cls())
    timings = []
    engine.add_observer(timings.append)
    result = run(collect_one(engine, req(list(prompt), 0, prompt_logprobs=0)))
    assert len(result.events) == 1 and result.final.finish_reason == FINISH_LENGTH
    assert result.tokens == [] and result.text == "" and result.final.completion_tokens == 0
    _check(prompt, result.events, 0)
    assert engine.stats().generation_tokens_total == 0
    # no token, so no time to a first one (/metrics' histogram of it is for generated tokens)
    wait_until(lambda: len(timings) == 1)
    assert timings[0].ttft_s is None and timings[0].itl_s == () and timings[0].e2e_s > 0
    # a one-token prompt has no token to score
    one = run(collect_one(engine, req([70], 0, prompt_logprobs=1)))
    assert one.final.prompt_logprobs == () and one.final.finish_reason == FINISH_LENGTH


def test_a_scored_prompt_reuses_no_cached_prefix_but_leaves_its_chunks_for_others(make_engine, fake_model_cls):
    """The prompt cache's reused positions were never scored: a scored request prefills from 0;
    the whole chunks it prefilled serve a later plain request."""
    prompt = list(range(65, 90))
    engine, model = make_engine(fake_model_cls(num_slots=1, context_tokens=True))
    first = run(collect_one(engine, req(prompt, 2)))
    scored = run(collect_one(engine, req(prompt, 2, prompt_logprobs=1)))
    again = run(collect_one(engine, req(prompt, 2)))
    assert [r.final.cached_tokens for r in (first, scored, again)] == [0, 0, 24]
    assert first.tokens == scored.tokens == again.tokens
    _check(bytes(prompt), scored.events, 1)


def test_a_scored_request_beside_others_leaves_their_tokens_alone(make_engine, fake_model_cls):
    prompts = [bytes(range(65 + i, 85 + 2 * i)) for i in range(4)]
    engine, _ = make_engine(fake_model_cls(num_slots=4))
    alone = [run(collect_one(engine, req(list(p), 6))) for p in prompts]

    async def together():
        streams = [engine.submit(req(list(p), 6, prompt_logprobs=3 if i % 2 else None)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run(together())
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    for i, (p, r) in enumerate(zip(prompts, results)):
        if i % 2:
            _check(p, r.events, 3)
        else:
            assert all(not e.prompt_logprobs for e in r.events)


def test_prompt_logprobs_are_refused_where_the_model_cannot_score_or_beyond_the_limit(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(scores_prompts=False))
    with pytest.raises(RequestValidationError, match="prompt logprobs are off") as err:
        engine.submit(req("abc", 2, prompt_logprobs=1), loop=asyncio.new_event_loop())
    assert err.value.field == "prompt_logprobs" and engine.info()["prompt_logprobs"] is False
    engine, _ = make_engine(fake_model_cls(max_top_logprobs=3))
    with pytest.raises(RequestValidationError, match="prompt_logprobs must be <= 3"):
        engine.submit(req("abc", 2, prompt_logprobs=4), loop=asyncio.new_event_loop())
    with pytest.raises(RequestValidationError, match="prompt_logprobs must be >= 0"):
        req("abc", 2, prompt_logprobs=-1)


def test_a_scored_chunk_runs_at_the_size_a_plain_one_would_and_costs_it(make_engine, fake_model_cls):
    """Chunks of 2, 4 and 8, a budget of 8: 3-token prompts cost 4 each (two a step), scored or
    not; 5-token ones cost 8 (one a step), so a 5- and a 3-token one cost 12 (two steps, though
    their 8 tokens would fit); four 2-token scored prompts cost 2 each (one step)."""
    engine, model = make_engine(fake_model_cls(prefill_chunks=(2, 4, 8)), prefill_budget=8)

    async def together(*requests):
        return await asyncio.gather(*(collect(engine.submit(r)) for r in requests))

    run(together(req("abc", 1), req("def", 1)))
    assert [len(p.prefills) for p in model.plans] == [2]
    run(together(req("abc", 1, prompt_logprobs=0), req("def", 1, prompt_logprobs=0)))
    assert [len(p.prefills) for p in model.plans[1:]] == [2]
    run(together(req("abcde", 1, prompt_logprobs=0), req("fghij", 1, prompt_logprobs=0)))
    assert [len(p.prefills) for p in model.plans[2:4]] == [1, 1]
    run(together(req("abcde", 1, prompt_logprobs=0), req("abc", 1, prompt_logprobs=0)))
    assert [len(p.prefills) for p in model.plans[4:6]] == [1, 1]
    results = run(together(*(req("ab", 1, prompt_logprobs=0) for _ in range(4))))
    assert [len(p.prefills) for p in model.plans[6:]] == [4]
    assert all(len(r.events[0].prompt_logprobs) == 1 for r in results)
