"""The engine thread over a fake StepModel (tests/scheduler/conftest.py): token N+1 follows N.

Covers slot reuse and waiting, cancellation, deadlines, stop conditions, admission limits,
prefill chunking and budget, failures, idling without spinning, shutdown and timings (the
prompt cache: test_prompt_cache.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from model.step_types import SamplingParams
from scheduler.types import (
    SLOT_PARAMS,
    EngineUnavailableError,
    QueueFullError,
    RequestValidationError,
    TokenLogprob,
)
from tests.scheduler.streams import (
    Result,
    collect,
    collect_one,
    engine_thread_is_blocked_on_inbox,
    expected_text,
    req,
    run,
    wait_until,
)

EOS = 256


# ---- basics ----


def test_generates_and_reports_usage(make_engine):
    engine, model = make_engine()
    assert engine.stats().state == "ready"
    result = run(collect_one(engine, req("hello a", max_tokens=5)))
    assert result.text == "bcdef"
    assert result.tokens == [ord(c) for c in "bcdef"]
    assert result.final.finish_reason == "length"
    assert (result.final.prompt_tokens, result.final.completion_tokens) == (7, 5)
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))  # the snapshot follows the step
    stats = engine.stats()
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (7, 5)
    assert (stats.slots_busy, stats.requests_running, stats.requests_waiting) == (0, 0, 0)
    info = engine.info()
    assert info["model"] == "fake" and info["num_slots"] == 8 and info["kernels"] == {"attention": "fake"}


def test_heap_frozen_after_warm_up_and_released_at_shutdown(make_engine):
    """EngineConfig.gc_freeze: what loading left alive moves to the permanent generation once the
    model is warm (a full collection then scans only later allocations), and back when the
    engine stops, so that a process's later engines and tests can collect it."""
    import gc

    gc.unfreeze()
    engine, _ = make_engine(gc_freeze=True)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the test process's modules, this engine and its model
    assert run(collect_one(engine, req("hello a", max_tokens=3))).text == "bcd"
    engine.shutdown(timeout=10)
    assert gc.get_freeze_count() == 0


def test_heap_left_alone_without_gc_freeze(make_engine):
    import gc

    gc.unfreeze()
    engine, _ = make_engine(gc_freeze=False)
    assert engine.stats().state == "ready" and gc.get_freeze_count() == 0


def test_default_detokenizer(make_engine):
    # model.tokenizer.IncrementalDetokenizer over the byte tokenizer.
    engine, _ = make_engine(detokenizer_factory=None)
    result = run(collect_one(engine, req("a", max_tokens=3, stop=("d",))))
    assert result.text == "bc" and result.final.finish_reason == "stop"


def test_logprobs(make_engine):
    engine, _ = make_engine()
    request = req("a", max_tokens=2, logprobs=True, sampling=SamplingParams(top_logprobs=2))
    result = run(collect_one(engine, request))
    lps = [lp for e in result.events for lp in e.logprobs]
    b, c = ord("b"), ord("c")
    assert lps[0] == TokenLogprob(b, pytest.approx(-b / 1000), ((b, pytest.approx(-b / 1000)), (b + 1, pytest.approx(-b / 1000 - 1))))
    assert lps[1].token_id == c and len(lps[1].top) == 2
    no_lp = run(collect_one(engine, req("a", max_tokens=2)))
    assert all(e.logprobs == () for e in no_lp.events)


def test_nine_requests_share_eight_slots(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(step_delay=0.001))

    async def main():
        streams = [engine.submit(req(chr(ord("A") + i), max_tokens=4 + i, request_id=str(i))) for i in range(9)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run(main())
    for i, result in enumerate(results):
        assert result.text == expected_text(chr(ord("A") + i), 4 + i)
        assert result.final.finish_reason == "length"
    setups = [(n, s.slot) for n, p in enumerate(model.plans) for s in p.setups]
    assert len(setups) == 9
    assert len({slot for _, slot in setups}) == 8
    # The ninth joined only after the first request (4 tokens) had finished, in its slot.
    ninth_plan, ninth_slot = setups[-1]
    first_plan, first_slot = setups[0]
    assert ninth_slot == first_slot and ninth_plan > first_plan + 3
    assert max(len(p.decode_slots) + len({c.slot for c in p.prefills}) for p in model.plans) <= 8


def test_a_steps_events_reach_the_loop_in_one_wake_up(make_engine, fake_model_cls):
    """Eight streams on one loop: each processed step hands the loop one callback with every
    stream's event (in order), not one per token; the texts are unchanged."""
    engine, model = make_engine(fake_model_cls(decode_steps=(1, 2)))
    wakeups = []

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if getattr(callback, "__name__", "") == "_deliver_all":  # the engine's hand-overs
                wakeups.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        streams = [engine.submit(req(chr(ord("A") + i), max_tokens=6, request_id=str(i))) for i in range(8)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run(main())
    for i, result in enumerate(results):
        assert result.text == expected_text(chr(ord("A") + i), 6)
    stepped = [p for p in model.plans if p.decode_slots or any(c.is_last for c in p.prefills)]
    events = sum(len(r.events) for r in results)
    assert len(wakeups) <= len(stepped) < events / 4


def test_waiting_request_is_counted(make_engine, fake_model_cls):
    gate = threading.Event()
    engine, model = make_engine(fake_model_cls(num_slots=1, gate=gate), max_queue=4)

    async def main():
        first = engine.submit(req("a", max_tokens=3, request_id="first"))
        second = engine.submit(req("x", max_tokens=2))
        await asyncio.to_thread(wait_until, lambda: engine.stats().requests_waiting == 1)
        stats = engine.stats()
        assert (stats.requests_running, stats.slots_busy) == (1, 1)
        # /slots: the running request's slot, prompt, limit and settings; not the waiting one
        [info] = stats.slot_infos()
        # (the first request: its limit is 3, the waiting one's 2)
        assert (info.slot, info.prompt_tokens, info.prompt_done, info.limit) == (0, 1, 1, 3)
        assert dict(zip(SLOT_PARAMS, info.params))["temperature"] == req("a").sampling.temperature
        gate.set()
        return await collect(first), await collect(second)

    first, second = run(main())
    assert (first.text, second.text) == ("bcd", "yz")


# ---- overlap: the extra token of a finished slot ----


def test_extra_token_after_stop_is_discarded_and_slot_reused(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(num_slots=1), max_queue=2)

    async def main():
        a = engine.submit(req("a", max_tokens=10, stop_token_ids=(ord("d"),)))
        b = engine.submit(req("p", max_tokens=3))
        return await collect(a), await collect(b)

    a, b = run(main())
    assert a.tokens == [ord(c) for c in "bcd"] and a.text == "bc" and a.final.finish_reason == "stop"
    assert a.final.completion_tokens == 3
    assert b.text == "qrs" and b.tokens == [ord(c) for c in "qrs"]
    # "a": first token from the prefill, "c" and "d" from decodes, and one extra decode ("e") per
    # program queued beyond the one being read, dispatched before "d" was seen; "b" then
    # decoded twice in the same slot.
    assert model.decode_count(0) == 2 + model.dispatch_ahead + 2


# ---- stop conditions ----


def test_stop_string_spanning_tokens_is_never_sent(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req("a", max_tokens=20, stop=("def",))))
    assert result.text == "bc" and result.final.finish_reason == "stop"
    assert all("d" not in e.text for e in result.events)
    assert result.tokens == [ord(c) for c in "bcdef"]  # tokens include the stop string's
    assert result.final.completion_tokens == 5


def test_held_back_text_released_when_stop_fails(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req("a", max_tokens=6, stop=("cdX",))))
    assert [e.text for e in result.events] == ["b", "", "", "cde", "f", "g"]
    assert result.final.finish_reason == "length"


def test_held_back_text_flushed_at_length(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req("a", max_tokens=5, stop=("fg", "zz"))))
    assert result.text == "bcdef" and result.final.finish_reason == "length"
    assert result.events[-1].text == "f"


def test_earliest_stop_string_wins(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req("a", max_tokens=20, stop=("ef", "cdefg", "d"))))
    assert result.text == "bc" and result.final.finish_reason == "stop"


def test_stop_token_ids(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req("a", max_tokens=20, stop_token_ids=(ord("e"),))))
    assert result.text == "bcd" and result.tokens[-1] == ord("e")
    assert result.final.finish_reason == "stop" and result.final.completion_tokens == 4


def test_eos_and_ignore_eos(make_engine):
    engine, _ = make_engine()
    result = run(collect_one(engine, req([97, 253], max_tokens=20)))
    assert result.tokens == [254, 255, EOS]
    assert result.final.finish_reason == "stop" and result.final.completion_tokens == 3
    ignored = run(collect_one(engine, req([97, 253], max_tokens=6, ignore_eos=True)))
    assert ignored.tokens == [254, 255, EOS, 257, 0, 1]
    assert ignored.final.finish_reason == "length"


def test_incomplete_utf8_is_held_back(make_engine):
    engine, _ = make_engine()
    # "é" is C3 A9; the prompt ends in C2 so the model generates C3 then C4 (invalid pair).
    result = run(collect_one(engine, req([0xC2], max_tokens=1)))
    assert result.tokens == [0xC3] and result.text == "\ufffd"  # flushed at the end only
    assert result.events[0].finish_reason == "length"


# ---- admission ----


def test_queue_full(make_engine, fake_model_cls):
    gate = threading.Event()
    engine, _ = make_engine(fake_model_cls(num_slots=1, gate=gate), max_queue=1)

    async def main():
        a = engine.submit(req("a", max_tokens=2))
        b = engine.submit(req("b", max_tokens=2))
        with pytest.raises(QueueFullError):
            engine.submit(req("c", max_tokens=2))
        assert engine.stats().requests_rejected_total == 1
        gate.set()
        await collect(a)
        await collect(b)
        # Places come back when requests end.
        return await collect(engine.submit(req("c", max_tokens=2)))

    assert run(main()).text == "de"


def test_validation(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(max_context=32))

    async def main():
        cases = [
            (req([1] * 32, max_tokens=1), "prompt"),
            (req([1] * 30, max_tokens=3), "max_tokens"),
            (req([1, 300], max_tokens=1), "prompt"),
            (req([1], max_tokens=1, sampling=SamplingParams(top_logprobs=4)), "top_logprobs"),
            (req([1], max_tokens=1, sampling=SamplingParams(logit_bias=((999, 1.0),))), "logit_bias"),
        ]
        for request, field in cases:
            with pytest.raises(RequestValidationError) as info:
                engine.submit(request)
            assert info.value.field == field
        return await collect(engine.submit(req([1] * 30, max_tokens=2)))

    result = run(main())
    assert result.final.completion_tokens == 2


def test_not_ready_raises(make_engine):
    engine, _ = make_engine(start=False)

    async def main():
        with pytest.raises(EngineUnavailableError):
            engine.submit(req("a"))

    run(main())
    assert engine.stats().state == "loading"


def test_a_submit_racing_a_stop_ends_its_stream(make_engine):
    """The engine stops between submit's check and its put: the stream still ends, through its
    loop, with one final event (the engine's own second one is dropped)."""
    engine, _ = make_engine(start=False)
    engine._publish("ready")
    put = engine._inbox.put

    def put_then_stop(command):
        put(command)
        engine._publish("stopped")

    engine._inbox.put = put_then_stop

    async def main():
        return await collect(engine.submit(req("a")))

    result = run(main())
    assert [e.finish_reason for e in result.events] == ["error"]
    assert "shutting down" in result.final.error


# ---- prefill chunks and budget ----


def test_chunks_at_fixed_boundaries_within_budget(make_engine, fake_model_cls):
    # Chunks 4 and 8, budget 12: a chunk of n tokens costs the compiled size it is padded to.
    engine, model = make_engine(fake_model_cls(step_delay=0.001), prefill_budget=12)
    prompts = [[65] * 19, [66] * 5, [67] * 3, [68] * 8, [69] * 17]

    async def main():
        streams = [engine.submit(req(p, max_tokens=3)) for p in prompts]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = run(main())
    for prompt, result in zip(prompts, results):
        assert result.tokens == [prompt[-1] + 1, prompt[-1] + 2, prompt[-1] + 3]
    slot_prompt = {}
    for plan in model.plans:
        for setup in plan.setups:
            slot_prompt[setup.slot] = None
        cost = sum(4 if len(c.tokens) <= 4 else 8 for c in plan.prefills)
        assert cost <= 12
        for chunk in plan.prefills:
            if chunk.start_pos == 0:
                slot_prompt[chunk.slot] = next(p for p in prompts if p[0] == chunk.tokens[0])
            prompt = slot_prompt[chunk.slot]
            assert chunk.start_pos % 8 == 0
            assert len(chunk.tokens) == min(8, len(prompt) - chunk.start_pos)
            assert chunk.is_last == (chunk.start_pos + len(chunk.tokens) == len(prompt))


def test_long_prompt_does_not_stall_decodes(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(step_delay=0.001), prefill_budget=8)

    async def main():
        short = engine.submit(req("a", max_tokens=30))
        first = await short.__anext__()
        long = engine.submit(req([70] * 60, max_tokens=2))
        return first, await collect(short), await collect(long)

    first, short, long = run(main())
    assert first.text + short.text == expected_text("a", 30)
    assert long.tokens == [71, 72]
    prefill_plans = [p for p in model.plans if any(c.slot == 1 for c in p.prefills)]
    assert len(prefill_plans) == 8  # 60 tokens in chunks of 8, one per step
    assert all(0 in p.decode_slots for p in prefill_plans)


def test_a_steps_decode_tokens_are_not_held_for_its_prompt_chunks(make_engine, fake_model_cls):
    """With a model that hands steps over in parts, the running stream's token of the step that
    also prefills a new prompt reaches it while that prompt's chunk is still running."""
    prefill_gate = threading.Event()
    prefill_gate.set()
    # 5 ms steps: the running stream is still running when the other prompt joins (slot 1)
    engine, model = make_engine(fake_model_cls(parts=True, prefill_gate=prefill_gate, step_delay=0.005))

    async def main():
        running = engine.submit(req("a", max_tokens=150, request_id="running"))  # 0.75 s of steps
        seen = [await running.__anext__(), await running.__anext__()]
        prefill_gate.clear()  # the next prompt's chunk "runs" until the gate opens
        joining = engine.submit(req("xy", max_tokens=2, request_id="joining"))
        def joins(plan) -> bool:  # the joining prompt's step
            return any(c.slot == 1 for c in plan.prefills)

        await asyncio.to_thread(wait_until, lambda: any(joins(p) for p in model.plans))
        step = next(i for i, p in enumerate(model.plans) if joins(p))
        # the running stream's tokens through the joining prompt's step: one per step (its
        # prompt's step included) up to that one
        wanted = sum(0 in p.decode_slots or any(c.slot == 0 and c.is_last for c in p.prefills)
                     for p in model.plans[: step + 1])
        while sum(len(e.token_ids) for e in seen) < wanted:
            seen.append(await running.__anext__())
        assert not prefill_gate.is_set()  # got there with the prompt's chunk still running
        prefill_gate.set()
        rest = await collect(running)
        return [t for e in seen for t in e.token_ids] + rest.tokens, await collect(joining)

    tokens, joining = run(main())
    assert tokens == [ord("a") + 1 + i for i in range(150)]  # 98..247: below EOS (256)
    assert joining.tokens == [ord("y") + 1, ord("y") + 2]


def test_parts_give_the_same_streams(make_engine, fake_model_cls):
    """Handing steps over in parts changes when events reach the loop, not what they are."""

    async def both(engine):
        streams = [engine.submit(req(chr(97 + i) * (i + 1), max_tokens=6 + i, request_id=f"r{i}")) for i in range(10)]
        return [(r.text, r.final.finish_reason) for r in await asyncio.gather(*(collect(s) for s in streams))]

    whole, _ = make_engine(fake_model_cls())
    parted, _ = make_engine(fake_model_cls(parts=True))
    assert run(both(whole)) == run(both(parted))


def test_a_row_no_part_covers_ends_its_request_with_an_error(make_engine, fake_model_cls):
    """A model whose parts leave out a slot it was asked for: that request ends with an error
    (no token was sampled for it), as an invalid row of a whole output does; the engine goes on."""

    class Dropping(fake_model_cls):
        def dispatch(self, plan):
            pending = super().dispatch(plan)
            whole = pending.parts

            def parts():
                for outs, slots in whole():
                    kept = tuple(s for s in slots if s != 1)
                    if kept:
                        yield outs, kept

            pending.parts = parts
            return pending

    engine, _ = make_engine(Dropping(parts=True))

    async def both():
        first = engine.submit(req("a", max_tokens=3, request_id="first"))  # slot 0
        second = engine.submit(req("b", max_tokens=3, request_id="second"))  # slot 1: left out
        return await collect(first), await collect(second)

    first, second = run(both())
    assert first.tokens == [ord("a") + 1, ord("a") + 2, ord("a") + 3]
    assert second.final.finish_reason == "error" and "no token" in second.final.error


# ---- cancellation and deadlines ----


def test_cancel_frees_slot_and_stops_tokens(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(num_slots=1, step_delay=0.002))

    async def main():
        stream = engine.submit(req("A", max_tokens=200))
        events = [await stream.__anext__() for _ in range(3)]
        stream.cancel()
        stream.cancel()  # idempotent
        rest = await collect(stream)
        return Result(events + rest.events)

    result = run(main())
    assert result.final.finish_reason == "cancelled"
    assert result.final.token_ids == ()
    assert result.text == expected_text("A", len(result.tokens))
    assert len(result.tokens) < 200
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))
    num_plans = len(model.plans)
    # the first token came from the prompt; past the last token sent, at most the steps queued
    # when the engine saw the cancel
    assert model.decode_count(0) <= len(result.tokens) - 1 + model.dispatch_ahead
    assert engine.stats().slots_busy == 0
    # The slot serves the next request; nothing more was computed for the cancelled one.
    assert run(collect_one(engine, req("a", max_tokens=2))).text == "bc"
    assert model.plans[num_plans].setups[0].slot == 0


def test_cancel_while_waiting(make_engine, fake_model_cls):
    gate = threading.Event()
    engine, model = make_engine(fake_model_cls(num_slots=1, gate=gate), max_queue=2)

    async def main():
        running = engine.submit(req("a", max_tokens=3))
        waiting = engine.submit(req("x", max_tokens=3))
        waiting.cancel()
        cancelled = await collect(waiting)
        gate.set()
        return await collect(running), cancelled

    running, cancelled = run(main())
    assert running.text == "bcd"
    assert cancelled.final.finish_reason == "cancelled" and cancelled.tokens == []
    assert sum(len(p.setups) for p in model.plans) == 1


def test_timeout_running_and_waiting(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(num_slots=1, step_delay=0.002), max_queue=2)

    async def main():
        running = engine.submit(req("A", max_tokens=200, timeout_s=0.05))
        waiting = engine.submit(req("a", max_tokens=2, timeout_s=0.02))
        return await collect(running), await collect(waiting)

    running, waiting = run(main())
    assert running.final.finish_reason == "timeout"
    assert len(running.tokens) < 200
    assert running.tokens == [ord("A") + i + 1 for i in range(len(running.tokens))]
    # past 0x7f the byte tokens are not UTF-8: the flushed text has them as U+FFFD
    assert running.text == bytes(running.tokens).decode("utf-8", errors="replace")
    assert running.final.completion_tokens == len(running.tokens)
    assert waiting.final.finish_reason == "timeout" and waiting.tokens == []


# ---- failures ----


def test_engine_failure_ends_every_stream(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(step_delay=0.001, fail_at_step=5))

    async def main():
        streams = [engine.submit(req(c, max_tokens=20)) for c in "abc"]
        results = await asyncio.gather(*(collect(s) for s in streams))
        with pytest.raises(EngineUnavailableError, match="device on fire"):
            engine.submit(req("a"))
        return results

    for result in run(main()):
        assert result.final.finish_reason == "error" and "device on fire" in result.final.error
    stats = engine.stats()
    assert stats.state == "failed" and "device on fire" in stats.error
    assert not engine.wait_ready(0)


def test_load_failure(make_engine):
    def factory():
        raise OSError("no such model")

    engine, _ = make_engine(factory=factory)
    assert not engine.wait_ready(1)
    assert engine.stats().state == "failed" and "no such model" in engine.stats().error


def test_one_request_error_is_isolated(make_engine, detokenizer_cls):
    class Fragile(detokenizer_cls):
        def add(self, token_id: int) -> str:
            if token_id == ord("d"):
                raise UnicodeError("bad bytes")
            return super().add(token_id)

    engine, _ = make_engine(detokenizer_factory=Fragile)

    async def main():
        bad = engine.submit(req("a", max_tokens=5))
        good = engine.submit(req("A", max_tokens=5))
        return await collect(bad), await collect(good)

    bad, good = run(main())
    assert bad.final.finish_reason == "error" and "bad bytes" in bad.final.error
    assert bad.text == "bc"
    assert good.text == "BCDEF" and good.final.finish_reason == "length"
    assert engine.stats().state == "ready"


def test_shutdown_ends_streams_and_stops(make_engine, fake_model_cls):
    gate = threading.Event()
    engine, _ = make_engine(fake_model_cls(gate=gate))

    async def main():
        stream = engine.submit(req("a", max_tokens=5))
        await asyncio.to_thread(wait_until, lambda: engine.stats().requests_running == 1)
        # The engine waits on its first step (gate); the shutdown command lands meanwhile.
        stopping = asyncio.create_task(asyncio.to_thread(engine.shutdown, 5))
        await asyncio.to_thread(wait_until, lambda: engine._inbox.qsize() == 1)
        gate.set()
        await stopping
        result = await collect(stream)
        with pytest.raises(EngineUnavailableError):
            engine.submit(req("a"))
        return result

    result = run(main())
    assert result.final.finish_reason == "error" and "shutting down" in result.final.error
    assert len(result.tokens) <= 1
    assert engine.stats().state == "stopped"
    assert not engine._thread.is_alive()
    engine.shutdown()  # idempotent


# ---- idling and timings ----


def test_blocks_on_inbox_when_idle(make_engine):
    engine, model = make_engine()
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))
    run(collect_one(engine, req("a", max_tokens=3)))
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))
    num_plans = len(model.plans)
    time.sleep(0.05)
    assert engine_thread_is_blocked_on_inbox(engine) and len(model.plans) == num_plans


def test_observer_gets_timings(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(step_delay=0.001))
    timings = []
    engine.add_observer(timings.append)
    engine.add_observer(lambda t: 1 / 0)  # a failing observer is logged and ignored
    result = run(collect_one(engine, req("a", max_tokens=4, request_id="t1")))
    assert result.text == "bcde"
    wait_until(lambda: len(timings) == 1)
    (timing,) = timings
    assert timing.request_id == "t1" and timing.finish_reason == "length"
    assert (timing.prompt_tokens, timing.completion_tokens) == (1, 4)
    assert timing.queue_s is not None and 0 <= timing.queue_s <= timing.ttft_s <= timing.e2e_s
    assert len(timing.itl_s) == 3 and all(gap >= 0 for gap in timing.itl_s)
    assert timing.steps == 4  # one token a step: the prefill's, then three decodes


def test_final_event_carries_llama_server_timings(make_engine, fake_model_cls):
    engine, _ = make_engine(fake_model_cls(step_delay=0.001))
    result = run(collect_one(engine, req("hello a", max_tokens=4)))
    t = result.final.timings
    assert (t.prompt_n, t.cache_n, t.predicted_n, t.draft_n, t.draft_n_accepted) == (7, 0, 4, 0, 0)
    # the prefill step takes the fake device 1 ms; the decode steps' tokens may reach the engine
    # thread in a burst, so their span has no lower bound but 0
    assert t.prompt_ms >= 0.9 and t.predicted_ms >= 0


def test_drafts_are_counted_for_the_tokens_a_request_keeps(make_engine, fake_model_cls):
    """A speculative step's outputs name the drafts checked per slot and whether its token was a
    draft (StepOutput.drafts, .drafted); the engine counts them with the tokens a request keeps,
    not for the steps dispatched past its end, in its final event and its stats."""

    class Drafting(fake_model_cls):
        def dispatch(self, plan):
            pending = super().dispatch(plan)
            outs = []
            for out in pending._outputs:
                drafted, drafts = np.zeros((self.num_slots,), bool), np.zeros((self.num_slots,), np.int32)
                for slot in plan.decode_slots:
                    drafts[slot], drafted[slot] = 3, out.tokens[slot] % 2 == 1
                outs.append(dataclasses.replace(out, drafted=drafted, drafts=drafts))
            pending._outputs = outs
            return pending

    engine, model = make_engine(Drafting(num_slots=1))
    result = run(collect_one(engine, req("a", max_tokens=20, stop=("f",))))
    assert result.tokens == [ord(c) for c in "bcdef"] and result.final.finish_reason == "stop"
    assert model.decode_count(0) == 4 + model.dispatch_ahead  # "g" (and "h") decoded, never kept
    t = result.final.timings
    # b from the prefill; c, d, e, f decoded with 3 drafts each, c and e drafts the step kept
    assert (t.predicted_n, t.draft_n, t.draft_n_accepted) == (5, 12, 2)
    wait_until(lambda: engine_thread_is_blocked_on_inbox(engine))
    stats = engine.stats()
    assert (stats.draft_tokens_total, stats.draft_tokens_accepted_total) == (12, 2)


# ---- several decode steps per dispatch ----


def test_several_decode_steps_per_dispatch(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(decode_steps=(1, 4)))
    result = run(collect_one(engine, req("a", max_tokens=11, stop=("h",))))
    assert result.text == "bcdefg"  # stopped by a stop string in the middle of a 4-step dispatch
    assert result.final.finish_reason == "stop"
    assert any(p.num_decode_steps == 4 for p in model.plans)
    assert engine.info()["decode_steps_per_dispatch"] == 4  # shown on /health
    # max_tokens is never overrun: the tail runs one step at a time.
    engine2, model2 = make_engine(fake_model_cls(decode_steps=(1, 4)))
    timings = []
    engine2.add_observer(timings.append)
    result = run(collect_one(engine2, req("a", max_tokens=10)))
    assert result.text == "bcdefghijk" and result.final.finish_reason == "length"
    steps = [p.num_decode_steps for p in model2.plans if p.decode_slots]
    assert 4 in steps and sum(steps) == 9  # 1 token from the prefill, 9 decoded
    wait_until(lambda: len(timings) == 1)
    assert timings[0].steps == 1 + len(steps)  # a dispatch of several steps counts once
    assert all(not p.prefills for p in model2.plans if p.num_decode_steps > 1)


def test_multi_step_waits_while_a_prompt_is_prefilled(make_engine, fake_model_cls):
    engine, model = make_engine(fake_model_cls(decode_steps=(1, 4), step_delay=0.01))

    async def two():
        first = engine.submit(req("a", max_tokens=30, request_id="1"))
        events = [await first.__anext__() for _ in range(3)]
        second = engine.submit(req("x" * 20, max_tokens=3, request_id="2"))
        return events, await collect(second), await collect(first)

    _, second, first = run(two())
    assert second.final.finish_reason == "length" and first.final.finish_reason == "length"
    assert all(not (p.prefills and p.num_decode_steps > 1) for p in model.plans)


# ---- closing the model (model.multihost.LeaderRunner ends the other processes this way) ----


def test_model_is_closed_once_when_the_engine_stops(make_engine, fake_model_cls):
    class Closable(fake_model_cls):
        closed = 0

        def close(self):
            self.closed += 1

    engine, model = make_engine(Closable())
    run(collect_one(engine, req("a", max_tokens=3)))
    assert model.closed == 0
    engine.shutdown(5)
    assert model.closed == 1


def test_model_is_closed_when_the_engine_fails(make_engine, fake_model_cls):
    class Closable(fake_model_cls):
        closed = 0

        def close(self):
            self.closed += 1

    model = Closable(fail_at_step=0)
    engine, _ = make_engine(model)

    async def main():
        return await collect(engine.submit(req("a", max_tokens=3)))

    assert run(main()).final.finish_reason == "error"
    wait_until(lambda: engine.stats().state == "failed")
    wait_until(lambda: model.closed == 1)


def test_model_is_closed_when_its_warmup_fails(make_engine, fake_model_cls):
    class BadWarmup(fake_model_cls):
        closed = 0

        def warmup(self):
            raise RuntimeError("compile failed")

        def close(self):
            self.closed += 1

    model = BadWarmup()
    engine, _ = make_engine(model)
    assert not engine.wait_ready(1)
    assert engine.stats().state == "failed"
    wait_until(lambda: model.closed == 1)  # closed after the failure is published
