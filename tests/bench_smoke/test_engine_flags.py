"""bench/engine.py takes the server's engine flags (`server.__main__.add_engine_arguments`): the
same argv gives the server's EngineConfig, and its cold-start child's argv parses."""

from __future__ import annotations

import pytest

from bench import engine
from server.__main__ import build_configs
from server.__main__ import build_parser as server_parser

FLAGS = ["--model", "m.gguf", "--slots", "4", "--max-context", "256", "--kv-dtype", "bfloat16", "--decode-steps",
         "3", "--few-rows-attention", "--split-q4-k", "off", "--kernels", "attention_decode=reference",
         "--prefill-budget", "64", "--no-gc-freeze"]


def test_the_bench_builds_the_servers_engine_config():
    args = engine.build_parser().parse_args([*FLAGS, "--decode-tokens", "8", "--no-cold-start"])
    # the one default of its own: --numerics native (it measures speed; on a GPU auto is native too)
    want, _ = build_configs(server_parser().parse_args([*FLAGS, "--numerics", "native"]), {})
    assert engine.config_of(args) == want
    # and the server's defaults where no flag is given (e.g. the KV dtype: auto)
    bare = engine.build_parser().parse_args(["--model", "m.gguf"])
    server_bare = ["--model", "m.gguf", "--numerics", "native"]
    assert engine.config_of(bare) == build_configs(server_parser().parse_args(server_bare), {})[0]
    assert engine.config_of(bare).kv_dtype == "auto"


def test_the_cold_start_child_parses_the_parents_own_flags():
    argv = [*FLAGS, "--decode-tokens", "8", "--cache-dir", "/tmp/a"]
    parent = engine.build_parser().parse_args(argv)
    parent.argv = argv
    child = engine.build_parser().parse_args(engine.cold_start_argv(parent, "/tmp/b"))
    assert child.startup_only and str(child.cache_dir) == "/tmp/b"
    assert engine.config_of(child) == engine.config_of(parent)


def test_traced_user_counts():
    parse = engine.build_parser().parse_args
    assert engine.trace_user_counts(parse(["--model", "m.gguf"]), [1, 4, 8]) == []
    assert engine.trace_user_counts(parse(["--model", "m.gguf", "--trace-decode"]), [1, 4, 8]) == [8]
    assert engine.trace_user_counts(parse(["--model", "m.gguf", "--trace-users", "8,1,1"]), [1, 4, 8]) == [1, 8]
    # not a list of counts from 1 to --slots: refused before the engine starts
    for bad in ("1,x", "0", "9"):
        with pytest.raises(SystemExit):
            engine.main(["--model", "m.gguf", "--slots", "8", "--trace-users", bad])


def test_the_scored_decode_needs_the_scoring_programs():
    assert engine.build_parser().parse_args(["--model", "m.gguf", "--scored-decode"]).scored_decode
    with pytest.raises(SystemExit):  # refused before the engine starts
        engine.main(["--model", "m.gguf", "--scored-decode", "--no-prompt-logprobs"])


@pytest.mark.parametrize("shared", [False, True])
def test_the_chat_turn_measure_reuses_the_history_and_agrees_with_the_cold_prefill(shared):
    """`measure_chat_turn` on the engine over the scheduler tests' fake model (chunks of 8, whose
    tokens hash every cached position): turn 2 reuses the history's two whole chunks when asked,
    none when not, with the same first token; `shared`: copied from turn 1's busy slot."""
    import asyncio

    import numpy as np

    from model.config import EngineConfig
    from scheduler.engine import Engine
    from tests.scheduler.conftest import ByteDetokenizer, ByteTokenizer, FakeModel

    model = FakeModel(num_slots=3, context_tokens=True, dispatch_ahead=1, step_delay=0.001)
    config = EngineConfig(num_slots=3, max_context=256, prefill_chunks=(4, 8), prefill_budget=16, max_top_logprobs=3,
                          gc_freeze=False)
    eng = Engine(lambda: model, ByteTokenizer(), config, detokenizer_factory=ByteDetokenizer)
    eng.start()
    try:
        assert eng.wait_ready(10)
        out = asyncio.run(engine.measure_chat_turn(eng, 20, 5, 3, np.random.default_rng(0), shared=shared))
    finally:
        eng.shutdown(10)
    assert out["cached_tokens"] == [16] and out["same_first_token"] == "3/3"
    reused = [c.reused for plan in model.plans for c in plan.prefills if c.is_first]
    assert reused == [0, 16, 0] * 4  # per round: turn 1, turn 2 warm, turn 2 cold
    assert len([c for plan in model.plans for c in plan.copies]) == (4 if shared else 0)


def test_the_scored_and_dry_decodes_run_what_they_name():
    """`measure_decode` with prompt_logprobs (--scored-decode): every prompt chunk of its streams
    is a scored one; with `first` (--dry-decode) the first stream alone samples with DRY; each
    decodes as many tokens as the plain run."""
    import asyncio

    import numpy as np

    from model.config import EngineConfig
    from scheduler.engine import Engine
    from tests.scheduler.conftest import ByteDetokenizer, ByteTokenizer, FakeModel

    model = FakeModel(num_slots=3, dispatch_ahead=1)
    config = EngineConfig(num_slots=3, max_context=256, prefill_chunks=(4, 8), prefill_budget=16, gc_freeze=False)
    eng = Engine(lambda: model, ByteTokenizer(), config, detokenizer_factory=ByteDetokenizer)
    eng.start()
    try:
        assert eng.wait_ready(10)
        timings = engine.TimingLog()
        eng.add_observer(timings)
        runs = {lp: asyncio.run(engine.measure_decode(eng, timings, 3, 12, 5, np.random.default_rng(0),
                                                      label=f"run{lp}", prompt_logprobs=lp))
                for lp in (None, 0)}
        dry = asyncio.run(engine.measure_decode(eng, timings, 3, 12, 5, np.random.default_rng(1), label="dry",
                                                first=engine.DRY_SAMPLING))
    finally:
        eng.shutdown(10)
    assert runs[None]["tokens"] == runs[0]["tokens"] == dry["tokens"] == 15
    chunks = [c for plan in model.plans for c in plan.prefills]
    assert len(chunks) == 18 and [c.score for c in chunks] == [False] * 6 + [True] * 6 + [False] * 6
    samplers = [s.sampling.uses_llama_samplers for plan in model.plans for s in plan.setups]
    assert samplers == [False] * 6 + [True, False, False]
    assert engine.DRY_SAMPLING.uses_llama_samplers
