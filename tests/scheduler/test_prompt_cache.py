"""The engine's prompt cache over the fake model (tests/scheduler/conftest.py) with
`context_tokens`, whose tokens hash every cached position: a slot's whole prefilled chunks
reused by a later prompt in the same slot or copied into another, with a cold engine's tokens.
"""

from __future__ import annotations

import asyncio
import threading

from tests.scheduler.streams import Result, collect, collect_one, engine_thread_is_blocked_on_inbox, req, run, wait_until


def _first_chunks(model) -> dict[int, tuple[int, int]]:
    """{slot: (start_pos, reused)} of each request's first chunk, in plan order (the last wins)."""
    firsts = {}
    for plan in model.plans:
        for chunk in plan.prefills:
            if chunk.is_first:
                firsts[chunk.slot] = (chunk.start_pos, chunk.reused)
    return firsts


def _serially(engine, *requests) -> list[Result]:
    async def main():
        return [await collect_one(engine, r) for r in requests]

    return run(main())


def test_a_prompt_reuses_the_whole_chunks_a_slot_holds_with_a_cold_prefills_tokens(make_engine, fake_model_cls):
    """Chunks of 8 (the largest), 2 slots: a prompt sharing 19 tokens with an earlier one
    prefills from 16 (two whole chunks reused, in the earlier prompt's slot), and its tokens,
    which the fake model makes from every cached position before them, are a cold engine's."""
    history = bytes(range(65, 84))  # 19 tokens
    first, second = history + b"+first", history + b"-second one"
    engine, model = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    cold_engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True), prompt_cache=False)
    other = req(b"zz".decode(), max_tokens=2, request_id="other")  # takes slot 0 first: the cache is in slot 1
    run(collect_one(engine, other))
    warm = _serially(engine, req(list(first), max_tokens=6), req(list(second), max_tokens=6))
    cold = _serially(cold_engine, req(list(first), max_tokens=6), req(list(second), max_tokens=6))
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert [r.final.cached_tokens for r in warm] == [0, 16]
    assert [r.final.cached_tokens for r in cold] == [0, 0]
    assert model.plans[-1].prefills == () and _first_chunks(model)[1] == (16, 16)  # slot 1, from 16
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))
    stats = engine.stats()
    assert (stats.prompt_tokens_cached_total, stats.prompt_tokens_total) == (16, 2 + 25 + 30 - 16)
    assert engine.info()["prompt_cache"] is True


def test_a_prompt_cache_hit_keeps_one_prompt_token_to_prefill(make_engine, fake_model_cls):
    """A prompt of whole chunks that the cache holds entirely prefills its last chunk again (its
    first token is sampled from that chunk's logits); one that ends inside a held chunk reuses the
    chunks before that one."""
    prompt = list(range(65, 81))  # 16 tokens: two whole chunks
    engine, model = make_engine(fake_model_cls(num_slots=1, context_tokens=True))
    cold_engine, _ = make_engine(fake_model_cls(num_slots=1, context_tokens=True), prompt_cache=False)
    requests = [req(prompt, 4), req(prompt, 4), req(prompt + [90], 4), req(prompt[:12], 4), req(prompt + [91], 4)]
    warm, cold = _serially(engine, *requests), _serially(cold_engine, *requests)
    # (the 12-token prompt rewrote positions 8-11: the slot then holds only the first chunk)
    assert [r.final.cached_tokens for r in warm] == [0, 8, 16, 8, 8]
    assert [r.tokens for r in warm] == [r.tokens for r in cold]


def test_decoded_tokens_and_partial_chunks_are_never_reused(make_engine, fake_model_cls):
    """A chat's next turn: the previous prompt plus its answer. Only the chunks that earlier
    prompt filled whole come from the cache: its last, partial chunk and the answer's decoded
    positions are prefilled again, as a cold prefill of the new prompt would fill them."""
    engine, model = make_engine(fake_model_cls(num_slots=1, context_tokens=True))
    cold_engine, _ = make_engine(fake_model_cls(num_slots=1, context_tokens=True), prompt_cache=False)
    turn1 = list(range(65, 77))  # 12 tokens: one whole chunk and 4
    (answer,) = _serially(engine, req(turn1, 10))
    turn2 = turn1 + answer.tokens + [33]
    (warm,) = _serially(engine, req(turn2, 5))
    cold = _serially(cold_engine, req(turn1, 10), req(turn2, 5))
    assert warm.final.cached_tokens == 8
    assert warm.tokens == cold[1].tokens
    (third,) = _serially(engine, req(turn2 + warm.tokens, 3))  # turn 2 prefilled positions 8-23 whole
    assert third.final.cached_tokens == 16


def _served(engine, model, request) -> tuple[int, int]:
    """Runs `request` alone: (the slot its first chunk went to, the tokens it reused there)."""
    seen = len(model.plans)
    (result,) = _serially(engine, request)
    (first,) = [c for plan in model.plans[seen:] for c in plan.prefills if c.is_first]
    assert first.reused == result.final.cached_tokens
    return first.slot, first.reused


def test_a_slot_holding_a_matching_prefix_is_chosen_and_others_keep_theirs(make_engine, fake_model_cls):
    """Of the free slots, the one whose held chunks match most is taken; a prompt that matches
    none takes a slot that holds nothing, then the one idle longest, so the others' caches last."""
    engine, model = make_engine(fake_model_cls(num_slots=3, context_tokens=True))
    a, b, c, d = ([t] * 9 for t in (65, 66, 67, 68))  # one whole chunk each
    assert _served(engine, model, req(a, 2)) == (0, 0)
    assert _served(engine, model, req(b, 2)) == (1, 0)  # slot 0 holds a; slot 1 nothing
    assert _served(engine, model, req(b + [1], 2)) == (1, 8)
    assert _served(engine, model, req(a + [1], 2)) == (0, 8)  # slot 0 was used longer ago, but holds a
    assert _served(engine, model, req(c, 2)) == (2, 0)  # matches nothing: the slot holding nothing
    assert _served(engine, model, req(d, 2)) == (1, 0)  # every slot holds something: the one idle longest
    assert _served(engine, model, req(a + [2], 2)) == (0, 8)  # a survived
    assert _served(engine, model, req(b + [2], 2)) == (2, 0)  # b did not: the slot idle longest


def test_an_overwritten_slot_no_longer_offers_its_prefix(make_engine, fake_model_cls):
    """One slot: a prompt that differs from the first chunk on overwrites what the slot held, so
    the first prompt's prefix is no longer reused; a request with cache_prompt off reuses nothing."""
    engine, model = make_engine(fake_model_cls(num_slots=1, context_tokens=True))
    cold_engine, _ = make_engine(fake_model_cls(num_slots=1, context_tokens=True), prompt_cache=False)
    a = list(range(65, 85))
    requests = [req(a, 3), req([1] + a[1:], 3), req(a, 3), req(a, 3, cache_prompt=False), req(a, 3)]
    warm, cold = _serially(engine, *requests), _serially(cold_engine, *requests)
    assert [r.final.cached_tokens for r in warm] == [0, 0, 0, 0, 16]
    assert [r.tokens for r in warm] == [r.tokens for r in cold]


def test_a_prefix_another_slot_holds_is_copied_into_the_new_requests_slot(make_engine, fake_model_cls):
    """Users sharing a system prompt: while the first decodes, a second prompt with the same first
    two chunks gets them copied (`PrefixCopy`) from the first's slot into its own before its
    prefill, and a cold engine's tokens; so does a third once both hold them."""
    system = list(range(65, 81))  # two whole chunks of 8
    prompts = [system + [1, 2, 3], system + [4, 5], system + [6] * 9]
    engine, model = make_engine(fake_model_cls(num_slots=3, context_tokens=True, step_delay=0.002))
    cold_engine, _ = make_engine(fake_model_cls(num_slots=3, context_tokens=True, step_delay=0.002), prompt_cache=False)

    async def staggered(eng):
        streams = []
        for i, prompt in enumerate(prompts):
            streams.append(eng.submit(req(prompt, max_tokens=60 - 10 * i, request_id=str(i))))
            first = await streams[-1].__anext__()  # decoding before the next arrives
            streams[-1] = (first, streams[-1])
        return [Result([first] + (await collect(stream)).events) for first, stream in streams]

    warm, cold = run(staggered(engine)), run(staggered(cold_engine))
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert [r.final.cached_tokens for r in warm] == [0, 16, 16]
    copies = [c for plan in model.plans for c in plan.copies]
    assert [(c.dst, c.num_tokens) for c in copies] == [(1, 16), (2, 16)] and copies[0].src == 0
    assert all(plan.copies == () for plan in model.plans if not plan.setups)


def test_chunks_planned_in_the_same_step_are_not_copied(make_engine, fake_model_cls):
    """Two prompts with the same first chunks admitted in one step: the second cannot copy what
    the first's chunks will write in that step (a copy runs before the step's prompt chunks), so it
    prefills whole; a third, arriving while both decode, copies. The fake model fails a copy of
    positions nothing wrote yet."""
    gate = threading.Event()
    system = list(range(65, 81))
    engine, model = make_engine(fake_model_cls(num_slots=4, context_tokens=True, gate=gate, step_delay=0.002),
                                prefill_budget=64)

    async def main():
        blocker = engine.submit(req("z", max_tokens=3, request_id="blocker"))
        await asyncio.to_thread(wait_until, lambda: len(model.plans) >= 1)  # its step waits on the gate
        a = engine.submit(req(system + [1], max_tokens=20, request_id="a"))
        b = engine.submit(req(system + [2], max_tokens=20, request_id="b"))
        await asyncio.sleep(0.05)
        gate.set()
        await a.__anext__()
        c = await collect(engine.submit(req(system + [3], max_tokens=3, request_id="c")))
        return [await collect(s) for s in (blocker, a, b)] + [c]

    results = run(main())
    assert [r.final.cached_tokens for r in results] == [0, 0, 0, 16]
    same_step = [plan for plan in model.plans if len([c for c in plan.prefills if c.is_first]) == 2]
    assert same_step and all(plan.copies == () for plan in same_step)
    (copy,) = [c for plan in model.plans for c in plan.copies]
    assert copy.dst == 3 and copy.src in (1, 2) and copy.num_tokens == 16


def test_a_long_prompts_chunks_of_this_step_are_not_copied(make_engine, fake_model_cls):
    """A prompt prefilled over two steps (budget 32, chunks of 8): a request with the same start
    admitted in the step that plans the long prompt's fifth chunk gets a copy of the four
    dispatched before, not of that one (it runs after the step's copies)."""
    shared = list(range(65, 105))  # 40 tokens: five chunks
    engine, model = make_engine(fake_model_cls(num_slots=2, context_tokens=True, step_delay=0.002),
                                prefill_budget=32)
    cold_engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True), prompt_cache=False,
                                 prefill_budget=32)

    async def main(eng):
        a = eng.submit(req(shared + [1], max_tokens=30, request_id="a"))
        b = eng.submit(req(shared + [2], max_tokens=3, request_id="b"))
        return [await collect(s) for s in (a, b)]

    warm, cold = run(main(engine)), run(main(cold_engine))
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    (copy,) = [c for plan in model.plans for c in plan.copies]
    assert (copy.src, copy.dst, copy.num_tokens) == (0, 1, 32) and warm[1].final.cached_tokens == 32
    (step,) = [plan for plan in model.plans if plan.copies]
    assert [(c.slot, c.start_pos) for c in step.prefills] == [(0, 32), (0, 40), (1, 32), (1, 40)]


def test_only_what_requests_of_the_same_cache_salt_prefilled_is_reused(make_engine, fake_model_cls):
    """cache_salt isolates the prompt cache: a slot's chunks serve (own or copied) only requests
    with the salt of the request that prefilled them."""
    system = list(range(65, 81))
    engine, model = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    requests = [req(system + [1], 2, cache_salt="a"), req(system + [2], 2, cache_salt="b"),
                req(system + [3], 2, cache_salt="b"), req(system + [4], 2, cache_salt="a"),
                req(system + [5], 2)]
    results = _serially(engine, *requests)
    assert [r.final.cached_tokens for r in results] == [0, 0, 16, 16, 0]
