"""`EngineProcess`: the engine in a child process (spawned), over the fake model of conftest.py
(built there by tests/scheduler/fake_engine_process.py): token N+1 follows N.

Covers what crosses the process boundary: events and usage, timings for observers, stats,
admission decided in the parent (validation, 429 capacity given back at each final event),
cancellation, a child that dies, shutdown, and a model that fails to load.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time

import pytest

from model.config import EngineConfig
from model.step_types import SamplingParams
from scheduler.engine_process import EngineProcess, EngineSpec, _OpenStreams
from scheduler.gc_pauses import GC_BUCKETS
from scheduler.types import EngineUnavailableError, QueueFullError, RequestValidationError
from tests.scheduler import streams as shared
from tests.scheduler.conftest import ByteTokenizer
from tests.scheduler.streams import req

BUILDER = "tests.scheduler.fake_engine_process:build"
START_TIMEOUT_S = 60


async def collect(stream) -> list:
    return (await shared.collect(stream)).events


def text(events) -> str:
    return "".join(e.text for e in events)


def run(coro):
    return shared.run(coro, timeout=30.0)  # a spawned child answers slower than a thread


def wait_until(predicate) -> None:
    shared.wait_until(predicate, timeout=10.0)


@pytest.fixture
def start_process(dispatch_ahead):
    """start_process(options=None, start=True, ready=True, **EngineConfig fields) -> an EngineProcess;
    options: FakeModel keyword arguments (and "load_error"), sent to the child as its model path."""
    made: list[EngineProcess] = []

    def start(options: dict | None = None, *, start: bool = True, ready: bool = True, **config) -> EngineProcess:
        options = {"dispatch_ahead": dispatch_ahead, **(options or {})}
        config = {"num_slots": 4, "max_context": 64, "prefill_chunks": (4, 8), "prefill_budget": 16,
                  "gc_freeze": False, **config}
        spec = EngineSpec(model_path=json.dumps(options), engine_config=EngineConfig(**config), log_level="warning",
                          builder=BUILDER)
        engine = EngineProcess(spec, ByteTokenizer(), model_name="fake")
        made.append(engine)
        if not start:
            return engine
        engine.start()
        if ready:
            assert engine.wait_ready(START_TIMEOUT_S), engine.stats()
        return engine

    yield start
    for engine in made:
        engine.shutdown(timeout=10)


def test_streams_usage_timings_and_stats_cross_the_process(start_process):
    engine = start_process()
    timings = []
    engine.add_observer(timings.append)

    async def main():
        return await collect(engine.submit(req("hello a", max_tokens=5)))

    events = run(main())
    assert text(events) == "bcdef"
    assert [t for e in events for t in e.token_ids] == [ord(c) for c in "bcdef"]
    assert events[-1].finish_reason == "length"
    assert (events[-1].prompt_tokens, events[-1].completion_tokens) == (7, 5)
    assert (events[-1].timings.prompt_n, events[-1].timings.predicted_n) == (7, 5)
    wait_until(lambda: timings and engine.stats().generation_tokens_total == 5)
    assert timings[0].request_id == "r" and timings[0].completion_tokens == 5 and len(timings[0].itl_s) == 4
    stats = engine.stats()
    assert (stats.state, stats.prompt_tokens_total, stats.slots_busy) == ("ready", 7, 0)
    info = engine.info()
    assert info["model"] == "fake" and info["num_slots"] == 4 and info["kernels"] == {"attention": "fake"}
    assert info["max_context"] == 64
    assert engine._process.pid is not None and engine._process.is_alive()


def test_concurrent_requests_each_get_their_own_tokens(start_process):
    engine = start_process({"step_delay": 0.002})

    async def main():
        streams = [engine.submit(req(c, max_tokens=6, request_id=c)) for c in "abcdefg"]  # 7 on 4 slots
        return await asyncio.gather(*(collect(s) for s in streams))

    for c, events in zip("abcdefg", run(main())):
        assert text(events) == "".join(chr(ord(c) + i + 1) for i in range(6))
    wait_until(lambda: engine.stats().generation_tokens_total == 42)


def test_admission_is_decided_at_once_and_places_come_back(start_process):
    engine = start_process({"step_delay": 0.02}, num_slots=1, max_queue=1)

    async def main():
        first = engine.submit(req("a", max_tokens=40))
        second = engine.submit(req("b", max_tokens=40))
        with pytest.raises(QueueFullError):
            engine.submit(req("c"))
        with pytest.raises(RequestValidationError) as e:
            engine.submit(req("x" * 64))  # the child's context: 64 tokens with the generated one
        assert e.value.field == "prompt"
        with pytest.raises(RequestValidationError) as e:
            engine.submit(req("a", logprobs=True, sampling=SamplingParams(top_logprobs=4)))  # the fake's 3
        assert e.value.field == "top_logprobs"
        first.cancel()
        second.cancel()
        ends = await asyncio.gather(collect(first), collect(second))
        assert [events[-1].finish_reason for events in ends] == ["cancelled", "cancelled"]
        return await collect(engine.submit(req("a", max_tokens=2)))  # both places are back

    assert text(run(main())) == "bc"
    assert engine.stats().requests_rejected_total == 1


def test_cancel_stops_a_running_request(start_process):
    engine = start_process({"step_delay": 0.01})

    async def main():
        stream = engine.submit(req("a", max_tokens=50))
        events = [await stream.__anext__()]
        stream.cancel()
        return events + await collect(stream)

    events = run(main())
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens < 50
    wait_until(lambda: engine.stats().slots_busy == 0)


def test_a_dead_engine_process_ends_every_stream_and_fails(start_process):
    engine = start_process({"step_delay": 0.01})

    async def main():
        streams = [engine.submit(req(c, max_tokens=50)) for c in "ab"]
        await streams[0].__anext__()
        engine._process.kill()
        return await asyncio.gather(*(collect(s) for s in streams))

    for events in run(main()):
        assert events[-1].finish_reason == "error" and "engine process exited" in events[-1].error
    stats = engine.stats()
    assert stats.state == "failed" and "exit code" in stats.error

    async def submit_again():
        with pytest.raises(EngineUnavailableError, match="engine process exited"):
            engine.submit(req("a"))

    run(submit_again())


def test_shutdown_ends_open_streams_and_the_process(start_process):
    engine = start_process({"step_delay": 0.01})

    async def main():
        stream = engine.submit(req("a", max_tokens=50))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown, 10)
        return await collect(stream)

    events = run(main())
    assert events[-1].finish_reason == "error" and "shutting down" in events[-1].error
    assert engine.stats().state == "stopped"
    assert engine._join(0) == 0


def test_slot_actions_run_in_the_child_and_their_errors_come_back(start_process, tmp_path):
    """A slot saved and restored through the child (which writes and reads the file), and the
    refusals with their types: the server maps them to 400, 404, 409."""
    engine = start_process({"context_tokens": True}, num_slots=2)
    prompt = list(range(65, 85))  # 20 tokens: two chunks of 8 kept
    first = run(shared.collect_one(engine, req(prompt, 3)))
    slot = engine.stats().cached.index(16)
    saved = engine.slot_action("save", slot, str(tmp_path / "s.bin"))
    assert saved["n_saved"] == 16 and saved["n_written"] == (tmp_path / "s.bin").stat().st_size
    assert engine.slot_action("erase", slot) == {"id_slot": slot, "n_erased": 16}
    assert engine.stats().cached == (0, 0)  # as of the answer
    assert engine.slot_action("restore", 1 - slot, str(tmp_path / "s.bin"))["n_restored"] == 16
    assert engine.stats().cached[1 - slot] == 16
    again = run(shared.collect_one(engine, req(prompt, 3)))
    assert again.final.cached_tokens == 16 and again.tokens == first.tokens
    with pytest.raises(FileNotFoundError):
        engine.slot_action("restore", 0, str(tmp_path / "missing.bin"))
    with pytest.raises(RequestValidationError, match="slot 5 does not exist"):
        engine.slot_action("erase", 5)
    with pytest.raises(RequestValidationError, match="unknown slot action"):
        engine.slot_action("load", 0)


def test_load_failure_in_the_engine_process(start_process):
    engine = start_process({"load_error": "no such model"}, ready=False)
    assert not engine.wait_ready(START_TIMEOUT_S)
    stats = engine.stats()
    assert stats.state == "failed" and "no such model" in stats.error


def test_submit_before_the_engine_is_ready_is_refused(start_process):
    engine = start_process(start=False)

    async def main():
        with pytest.raises(EngineUnavailableError, match="loading"):
            engine.submit(req("a"))
        engine.start()
        assert engine.wait_ready(START_TIMEOUT_S)
        return await collect(engine.submit(req("a", max_tokens=2)))

    assert text(run(main())) == "bc"


def test_a_stream_ended_before_it_is_filed_does_not_stay_open():
    """The child's streams: the engine thread may send a request's final event before the
    command loop files its stream; either order leaves nothing behind."""
    streams = _OpenStreams()
    streams.add(1, "stream 1")
    assert streams.get(1) == "stream 1"
    streams.end(1)  # filed, then ended
    streams.end(2)  # ended first (a deadline right after submit), then filed
    assert streams.get(2) is None and len(streams) == 1
    streams.add(2, "stream 2")
    assert streams.get(1) is None and streams.get(2) is None and len(streams) == 0


def test_a_builder_that_raises_fails_the_engine(start_process):
    engine = start_process({"build_error": "bad file"}, ready=False)
    assert not engine.wait_ready(START_TIMEOUT_S)
    stats = engine.stats()
    assert stats.state == "failed" and "ValueError: bad file" in stats.error


def test_shutdown_while_the_model_loads_ends_the_process_at_once(start_process):
    engine = start_process({"load_s": 60}, ready=False)
    time.sleep(1.0)  # the child is in its builder
    started = time.monotonic()
    engine.shutdown(timeout=30)
    assert time.monotonic() - started < 10  # not after the minute-long load
    assert engine._join(0) == 0 and engine.stats().state == "stopped"


def test_the_parent_gone_while_the_model_loads_ends_the_process(start_process):
    engine = start_process({"load_s": 60}, ready=False)
    time.sleep(1.0)
    engine._commands.close()  # as the parent's death closes it
    assert engine._join(10) == 1


def test_the_engine_process_ignores_group_signals(start_process):
    """Ctrl-C and a service manager's SIGTERM reach the whole process group: the child stays for
    the parent's drain."""
    engine = start_process()
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(engine._process.pid, sig)

    async def main():
        return await collect(engine.submit(req("a", max_tokens=3)))

    assert text(run(main())) == "bcd"
    assert engine._process.is_alive()


def test_the_engine_process_reports_its_gc_pauses(start_process):
    engine = start_process(gc_freeze=True)  # the engine's warm-up runs a full collection there
    wait_until(lambda: engine.gc_pauses() is not None and sum(engine.gc_pauses()[0][2]) >= 1)
    counts, sums = engine.gc_pauses()
    assert len(counts) == 3 and all(len(c) == len(GC_BUCKETS) + 1 for c in counts) and sums[2] > 0
    wait_until(lambda: gc.get_freeze_count() > 0)  # this side froze its own heap too, once ready
    engine.shutdown(timeout=10)
    assert gc.get_freeze_count() == 0  # and let it go at shutdown


def test_an_engine_failing_mid_serve_ends_its_streams_and_refuses_after(start_process):
    engine = start_process({"step_delay": 0.002, "fail_at_step": 5})

    async def main():
        streams = [engine.submit(req(c, max_tokens=20)) for c in "abc"]
        results = await asyncio.gather(*(collect(s) for s in streams))
        with pytest.raises(EngineUnavailableError, match="device on fire"):
            engine.submit(req("a"))
        return results

    for events in run(main()):
        assert events[-1].finish_reason == "error" and "device on fire" in events[-1].error
    stats = engine.stats()
    assert stats.state == "failed" and "device on fire" in stats.error
    assert engine._process.is_alive()  # the child answers until its shutdown, as the engine in process does


def test_constrained_requests_are_compiled_on_this_side_too(start_process):
    """A grammar the child would refuse is refused at submit here (a 400 to the server), and a
    good one runs in the child as in a thread."""
    from scheduler.types import Constraint

    engine = start_process()
    for bad in (Constraint("regex", "[", "guided_regex"), Constraint("gbnf", "root ::= x\nx ::= x", "grammar")):
        with pytest.raises(RequestValidationError) as err:
            run(shared.collect_one(engine, req("a", constraint=bad)))
        assert err.value.field == bad.field
    events = run(shared.collect_one(engine, req("hello a", max_tokens=20,
                                                 constraint=Constraint("regex", "[0-9]{3}-x")))).events
    assert text(events) == "012-x" and events[-1].finish_reason == "stop"
    assert engine.info()["constrained_decoding"] is True
