"""The runner on the real SmolLM2: batch invariance, seeded sampling under concurrency,
nothing compiled after warm-up."""

from __future__ import annotations

import copy
import dataclasses
import re
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import forward
from model.offline import generate, teacher_forced_logits
from model.step_types import PrefillChunk, PrefixCopy, SamplingParams, SlotSetup, StepPlan
from tests.model.conftest import no_compiles

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Paris is the capital of",
    "In 1969, the first humans",
    "A list of prime numbers: 2, 3, 5,",
    "Bonjour, je m'appelle",
    "The three laws of thermodynamics are",
    "Once upon a time in a small village there lived an old clockmaker who",
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def test_batch_invariance_greedy(smol_runner, prompt_ids):
    together = generate(smol_runner, prompt_ids, 12)
    for i, ids in enumerate(prompt_ids):
        alone = generate(smol_runner, [ids], 12, slots=[(i * 3) % 8])  # another slot, alone
        assert alone[0] == together[i], f"prompt {i}: {alone[0]} != {together[i]}"


def test_seeded_sampling_reproducible_under_concurrency(smol_runner, prompt_ids):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone = generate(smol_runner, [prompt_ids[0]], 10, sampling=seeded, slots=[5])
    crowd = generate(smol_runner, [prompt_ids[0]] + prompt_ids[1:], 10, sampling=seeded)
    assert crowd[0] == alone[0]
    other = generate(smol_runner, [prompt_ids[0]], 10, sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=99))
    assert other[0] != alone[0]  # the seed matters (10 sampled tokens colliding is ~impossible)


def test_llama_cpp_samplers_reproducible_under_concurrency(smol_runner, prompt_ids):
    """A request with llama.cpp's samplers (typical, top-n-sigma, XTC with its own draws, dynamic
    temperature) gets the same tokens alone as beside seven requests that use none of them."""
    seeded = SamplingParams(temperature=1.0, typical_p=0.9, top_n_sigma=2.5, xtc_probability=0.5, xtc_threshold=0.05,
                            dynatemp_range=0.4, seed=77)
    alone = generate(smol_runner, [prompt_ids[2]], 10, sampling=seeded, slots=[3])
    crowd = generate(smol_runner, [prompt_ids[2]] + prompt_ids[3:], 10, sampling=seeded)
    assert crowd[0] == alone[0]
    plain = generate(smol_runner, [prompt_ids[2]], 10, sampling=SamplingParams(temperature=1.0, seed=77), slots=[3])
    assert plain[0] != alone[0]  # the samplers change what is drawn
    # mirostat, its target surprise carried in the slot from the prefill's token through the decodes
    for version in (1, 2):
        miro = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=3.0, mirostat_eta=0.5, seed=77)
        alone = generate(smol_runner, [prompt_ids[2]], 10, sampling=miro, slots=[3])
        assert generate(smol_runner, [prompt_ids[2]] + prompt_ids[3:], 10, sampling=miro)[0] == alone[0]
        assert alone[0] != plain[0]


def test_nothing_compiles_after_warmup(smol_runner, prompt_ids):
    generate(smol_runner, prompt_ids[:2], 2)  # any lazy host-side setup happens here
    with no_compiles():
        long_prompt = prompt_ids[7] * 80  # > 1024 tokens: several chunks, the larger bucket
        generate(smol_runner, [long_prompt] + prompt_ids[1:4], 3,
                 sampling=SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.1, logit_bias=((5, 2.0),)))


def test_several_decode_steps_per_dispatch_match_single_steps(smollm2, smol_runner, prompt_ids):
    from model.step_types import PrefillChunk, SlotSetup, StepPlan
    from tests.model.conftest import SMOL_ENGINE

    # (a lean runner: with a DRY slot, its several steps run as the forward pass and sampler apart,
    # and its prompt of more than the smallest chunk ends in that chunk size's full-sampler program)
    cfg = dataclasses.replace(SMOL_ENGINE, num_slots=2, max_context=1024, context_buckets=(1024,),
                              decode_steps_per_dispatch=4, prompt_logprobs=False, constrained_overlap="on")
    runner = smollm2.make_runner(cfg)
    runner.warmup()
    assert runner.decode_steps == (1, 4) and runner._lean
    prompts = [prompt_ids[7] * 6, prompt_ids[1]]
    assert len(prompts[0]) > runner.prefill_chunks[0]
    for params in ([SamplingParams(temperature=0.0)] * 2, [LLAMA_SAMPLERS[0], SamplingParams(temperature=0.0)]):
        single = generate(runner, prompts, 9, sampling=params)
        assert single == generate(smol_runner, prompts, 9, sampling=params)
        setups = tuple(SlotSetup(s, sp) for s, sp in enumerate(params))
        prefills = tuple(PrefillChunk(s, np.asarray(ids, np.int32), 0, True) for s, ids in enumerate(prompts))
        with no_compiles():
            first = runner.dispatch(StepPlan(setups=setups, prefills=prefills)).results()
            assert len(first) == 1
            outs = runner.dispatch(StepPlan(decode_slots=(0, 1), num_decode_steps=4)).results()
            outs += runner.dispatch(StepPlan(decode_slots=(0, 1), num_decode_steps=4)).results()
        assert len(outs) == 8
        multi = [[int(first[0].tokens[s])] + [int(o.tokens[s]) for o in outs] for s in range(2)]
        assert multi == single


def test_unrolled_decode_layers_match_the_scanned_loop(synthetic_gguf):
    """`unroll_decode_layers` (on by default on GPU) changes the program's structure only: no
    while loop over the layers, the same tokens as the scanned body, in single steps and in
    several steps per dispatch. On a synthetic 7-layer model (bench/make_synthetic_gguf.py's
    "tiny", random weights): unrolled, SmolLM2's 30 layers cost minutes of compiling."""
    from model.loader import load_model
    from model.step_types import PrefillChunk, SlotSetup, StepPlan
    from tests.model.conftest import SMOL_ENGINE

    layers = 7  # a trip count no other loop of the decode program has (the sampler has loops of 5)
    loaded = load_model(synthetic_gguf("tiny", "q4_1", layers=layers), SMOL_ENGINE)
    assert loaded.config.num_layers == layers
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (13, 40)]

    def layer_loops(program) -> int:
        trips = re.findall(r' while\(.*"known_trip_count":\{"n":"(\d+)"\}', program.as_text())
        return trips.count(str(layers))

    tokens, loops = {}, {}
    for mode in ("off", "on"):
        cfg = dataclasses.replace(SMOL_ENGINE, num_slots=2, max_context=1024, context_buckets=(1024,),
                                  prefill_chunks=(64,), unroll_decode_layers=mode,
                                  decode_steps_per_dispatch=2 if mode == "on" else 1, prompt_logprobs=False)
        runner = loaded.make_runner(cfg)
        runner.warmup()
        tokens[mode] = generate(runner, prompts, 6)
        loops[mode] = layer_loops(runner._program("decode", 2, 1024))
    assert tokens["on"] == tokens["off"]
    assert len(set(tokens["off"][0] + tokens["off"][1])) > 2  # not a degenerate stream
    assert loops == {"off": 1, "on": 0}
    # the multi-step program (the last runner's) unrolls its layers too, with the same tokens
    assert layer_loops(runner._program("decode", 2, 1024, 2)) == 0
    setups = tuple(SlotSetup(s, SamplingParams(temperature=0.0)) for s in range(2))
    prefills = tuple(PrefillChunk(s, np.asarray(ids, np.int32), 0, True) for s, ids in enumerate(prompts))
    first = runner.dispatch(StepPlan(setups=setups, prefills=prefills)).results()
    outs = runner.dispatch(StepPlan(decode_slots=(0, 1), num_decode_steps=2)).results()
    outs += runner.dispatch(StepPlan(decode_slots=(0, 1), num_decode_steps=2)).results()
    multi = [[int(first[0].tokens[s])] + [int(o.tokens[s]) for o in outs] for s in range(2)]
    assert multi == [t[:5] for t in tokens["off"]]


def test_prefill_programs_have_no_conditionals(smol_runner):
    """The prefill step samples its one row without conditionals (`skip_unused=False`): on the
    GPU, XLA runs a conditional outside a CUDA graph on the host, blocking the call until the
    device reaches it (seen in bench/results/trace-20261130-000200-prefill.json). The decode
    program keeps its conditionals, which its graph runs on the device."""
    prefill = smol_runner._program("prefill", 64, 1024).as_text()
    assert " conditional(" not in prefill
    assert " conditional(" in smol_runner._program("decode", smol_runner.num_slots, 1024).as_text()


def test_parts_hand_over_the_steps_outputs_as_results_does(smol_runner, prompt_ids):
    """`parts()` gives the decode part, then each prompt's first token (a chunk that does not
    end its prompt gives nothing), with the same values `results()` copies at once."""
    from model.step_types import PrefillChunk, SlotSetup, StepPlan

    greedy = SamplingParams(temperature=0.0)
    a, b = np.asarray(prompt_ids[2], np.int32), np.asarray(prompt_ids[7], np.int32)
    smol_runner.dispatch(StepPlan(setups=(SlotSetup(0, greedy),), prefills=(PrefillChunk(0, a, 0, True),))).result()
    half = len(b) // 2
    pending = smol_runner.dispatch(StepPlan(
        setups=(SlotSetup(3, greedy),), decode_slots=(0,),
        prefills=(PrefillChunk(3, b[:half], 0, False), PrefillChunk(3, b[half:], half, True)),
    ))
    parts = list(pending.parts())
    whole = pending.results()[0]
    assert [slots for _, slots in parts] == [(0,), (3,)]
    for outs, (slot,) in parts:
        (out,) = outs
        assert out.valid[slot] and int(out.tokens[slot]) == int(whole.tokens[slot])
        assert out.logprobs[slot] == whole.logprobs[slot]
        np.testing.assert_array_equal(out.top_ids[slot], whole.top_ids[slot])
        assert out.valid.sum() == 1


def test_few_busy_slots_run_the_decode_programs_planned_for_them(smollm2, prompt_ids):
    """Where the decode attention has a plan for few busy rows (the Triton kernel on the GPU,
    unless `--no-few-rows-attention`: `Kernels.decode_few_rows_limit`), warm-up
    compiles the steady-state decode program (the most steps per dispatch) with it for each
    context bucket that has one, and such a step with at most that many decoding slots runs it;
    the tokens are those of the other programs. Here the CPU's reference attention stands in,
    recording the plan it was traced with."""
    from model.step_types import PrefillChunk, SlotSetup, StepPlan
    from pallas_kernels.attention import attention_decode_reference
    from tests.model.conftest import SMOL_ENGINE

    traced = []

    def attention(*args, few_rows=False, **kwargs):
        traced.append(few_rows)
        return attention_decode_reference(*args, **kwargs)

    cfg = dataclasses.replace(SMOL_ENGINE, num_slots=2, max_context=1024, context_buckets=(512, 1024),
                              decode_steps_per_dispatch=2, prompt_logprobs=False)
    runner = smollm2.make_runner(cfg)
    assert runner.kernels.decode_few_rows_limit(1024) == 0  # not opted in (nor has the reference such a plan)
    runner.kernels = dataclasses.replace(runner.kernels, attention_decode=attention,
                                         decode_few_rows_limit=lambda span: 1 if span == 1024 else 0)
    runner.warmup()
    decode_keys = {key for key in runner._compiled if key[0] == "decode"}
    assert decode_keys == {("decode", 2, attend, steps, False) for attend in (512, 1024) for steps in (1, 2)} | {
        ("decode", 2, 1024, 2, True)}
    assert True in traced and False in traced

    ran = []
    program = runner._program

    def spy(kind, size, attend, steps=1, few_rows=False):
        if kind == "decode":
            ran.append((attend, few_rows))
        return program(kind, size, attend, steps, few_rows)

    runner._program = spy
    long_prompt = prompt_ids[7] * 40  # > 512 tokens: decode attends over the 1024 bucket
    alone = generate(runner, [long_prompt], 5)  # one decode step per dispatch: the plan for all
    assert ran and all(r == (1024, False) for r in ran)
    setups = (SlotSetup(0, SamplingParams(temperature=0.0)),)
    first = runner.dispatch(StepPlan(setups=setups, prefills=tuple(
        PrefillChunk(0, np.asarray(long_prompt[i:i + 512], np.int32), i, i + 512 >= len(long_prompt))
        for i in range(0, len(long_prompt), 512)))).result()
    ran.clear()
    outs = runner.dispatch(StepPlan(decode_slots=(0,), num_decode_steps=2)).results()
    outs += runner.dispatch(StepPlan(decode_slots=(0,), num_decode_steps=2)).results()
    assert ran == [(1024, True)] * 2  # the steady-state program with one busy slot: the plan for few
    assert [int(first.tokens[0])] + [int(o.tokens[0]) for o in outs] == alone[0]
    ran.clear()
    runner.dispatch(StepPlan(decode_slots=(0, 1), num_decode_steps=2)).results()  # (slot 1: no prompt, no matter)
    assert ran == [(1024, False)]  # two busy slots: the plan for all


def test_prefill_programs_may_compile_without_cuda_graphs(smol_runner):
    """EngineConfig.prefill_cuda_graphs off: the prefill programs' XLA options turn command
    buffers off on a GPU; decode keeps them, and the CPU gets no options at all."""
    runner = copy.copy(smol_runner)
    assert runner._compiler_options("prefill") is None and runner._compiler_options("decode") is None
    runner.engine_cfg = dataclasses.replace(smol_runner.engine_cfg, prefill_cuda_graphs=False)
    assert runner._compiler_options("prefill") is None  # this CPU
    with unittest.mock.patch("jax.default_backend", return_value="gpu"):
        assert runner._compiler_options("prefill") == {"xla_gpu_enable_command_buffer": ""}
        assert runner._compiler_options("decode") is None
    # an option XLA takes (a misspelt one fails the compile: "No such compile option")
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})


def test_a_reused_prompt_prefix_gives_the_tokens_and_penalty_state_of_a_cold_prefill(smol_runner, prompt_ids):
    """A request that keeps the first 512 positions of its slot's cache (`PrefillChunk.reused`,
    prefilled there for an earlier request with the same tokens) and prefills only the rest gets
    the tokens a cold prefill of its whole prompt gets in another slot, and the same penalty state:
    its prompt mask holds the reused tokens too (from the slot's token history), and the counts
    of the earlier request's output are gone."""
    chunk = smol_runner.prefill_chunks[-1]
    head = (prompt_ids[7] * 40)[:chunk]
    first = head + prompt_ids[1] * 3
    second = head + prompt_ids[2] * 4  # the same first chunk, another tail
    sampled = SamplingParams(temperature=0.8, top_k=40, seed=11, repetition_penalty=1.3, frequency_penalty=0.5)
    for sampling in (SamplingParams(temperature=0.0), sampled):
        generate(smol_runner, [first], 6, slots=[3], sampling=sampling)  # leaves head's keys and values in slot 3
        warm = generate(smol_runner, [second], 1, slots=[3], sampling=sampling, reused=[chunk])
        warm_state = jax.tree_util.tree_map(lambda a: np.asarray(a)[3], smol_runner._state)
        cold = generate(smol_runner, [second], 1, slots=[6], sampling=sampling)
        cold_state = jax.tree_util.tree_map(lambda a: np.asarray(a)[6], smol_runner._state)
        assert warm == cold
        for name in ("prompt_mask", "counts", "step_index", "positions", "tokens"):
            np.testing.assert_array_equal(getattr(warm_state, name), getattr(cold_state, name), err_msg=name)
        assert warm_state.prompt_mask[head].all() and warm_state.counts.sum() == 1
        # and the whole continuation, decode steps after the reused prefill included
        warm = generate(smol_runner, [second], 8, slots=[3], sampling=sampling, reused=[chunk])
        cold = generate(smol_runner, [second], 8, slots=[6], sampling=sampling)
        assert warm == cold
        # the prefix copied into another slot (`PrefixCopy`, a whole context bucket), over what it held
        copied = generate(smol_runner, [second], 8, slots=[1], sampling=sampling, reused=[chunk],
                          copies=(PrefixCopy(3, 1, chunk),))
        assert copied == cold
        copied_state = jax.tree_util.tree_map(lambda a: np.asarray(a)[1], smol_runner._state)
        np.testing.assert_array_equal(copied_state.prompt_mask, jax.tree_util.tree_map(
            lambda a: np.asarray(a)[6], smol_runner._state).prompt_mask)


def test_allowed_tokens_hold_a_constrained_slot_and_leave_the_others_alone(smol_runner, prompt_ids):
    """StepPlan.allowed (constrained decoding): the slot's samples, greedy or drawn, and its top
    alternatives come from its allowed tokens, in the prefill's first token and the decodes
    alike; a free slot beside it decodes what it decodes alone."""
    from model.step_types import mask_words
    from model.step_types import PrefillChunk, SlotSetup, StepPlan

    free = generate(smol_runner, prompt_ids[:2], 4)
    vocab = smol_runner.vocab_size
    rng = np.random.default_rng(0)
    allowed = sorted(set(rng.choice(vocab, 40, replace=False).tolist()) - set(free[0]))
    row = np.zeros((mask_words(vocab),), np.uint32)
    for t in allowed:
        row[t // 32] |= np.uint32(1 << (t % 32))
    row = row.view(np.int32)
    for sp in (SamplingParams(temperature=0, top_logprobs=5), SamplingParams(temperature=1.0, seed=7, top_logprobs=5)):
        setups = (SlotSetup(0, sp), SlotSetup(1, SamplingParams(temperature=0)))
        chunks = tuple(PrefillChunk(s, np.asarray(ids, np.int32), 0, True) for s, ids in enumerate(prompt_ids[:2]))
        outs = [smol_runner.dispatch(StepPlan(setups=setups, prefills=chunks, allowed=((0, row),))).result()]
        for _ in range(3):
            outs.append(smol_runner.dispatch(StepPlan(decode_slots=(0, 1), allowed=((0, row),))).result())
        assert [int(o.tokens[1]) for o in outs] == free[1]
        for o in outs:
            assert int(o.tokens[0]) in allowed
            assert set(o.top_ids[0][:5].tolist()) <= set(allowed)
            assert np.isfinite(o.logprobs[0]) and o.logprobs[0] <= 0
            # the logprobs are the constrained distribution's: the 40 allowed tokens hold all the mass
            assert np.exp(o.top_logprobs[0][:5]).sum() <= 1.0 + 1e-5


@pytest.fixture(scope="module")
def lean_runner(smollm2):
    """A runner that builds the deferred decode's programs (EngineConfig.constrained_overlap on,
    a GPU's default), so its fused decode program is the lean one."""
    from model.config import EngineConfig

    runner = smollm2.make_runner(EngineConfig(num_slots=8, max_context=1024, context_buckets=(1024,),
                                              prefill_chunks=(64, 128), constrained_overlap="on",
                                              prompt_logprobs=False))
    assert runner.defers_allowed
    runner.warmup()
    return runner


def test_a_deferred_decode_samples_what_the_one_program_decode_does(smol_runner, lean_runner, prompt_ids):
    """StepPlan.deferred (EngineConfig.constrained_overlap): the forward pass at dispatch, the
    sampling at `supply`, with a prompt chunk of another slot dispatched between them, gives the
    tokens and logprobs of the same steps with the rows known at dispatch."""
    from model.step_types import mask_words
    from model.step_types import PrefillChunk, SlotSetup, StepPlan

    runner = lean_runner
    vocab = runner.vocab_size
    rng = np.random.default_rng(1)
    row = np.zeros((mask_words(vocab),), np.uint32)
    for t in rng.choice(vocab, 300, replace=False):
        row[t // 32] |= np.uint32(1 << (t % 32))
    row = row.view(np.int32)
    sp = SamplingParams(temperature=0, top_logprobs=3)
    first = (SlotSetup(0, sp), SlotSetup(1, sp))
    chunks = tuple(PrefillChunk(s, np.asarray(prompt_ids[s][:60], np.int32), 0, True) for s in (0, 1))
    late = PrefillChunk(2, np.asarray(prompt_ids[2][:60], np.int32), 0, True)

    def steps(r, deferred: bool):
        outs = [r.dispatch(StepPlan(setups=first, prefills=chunks, allowed=((0, row),))).result()]
        for i in range(3):
            extra = dict(setups=(SlotSetup(2, sp),), prefills=(late,)) if i == 1 else {}
            slots = (0, 1, 2) if i == 2 else (0, 1)
            if deferred:
                pending = r.dispatch(StepPlan(decode_slots=slots, deferred=(0,), **extra))
                pending.supply({0: row})
            else:
                pending = r.dispatch(StepPlan(decode_slots=slots, allowed=((0, row),), **extra))
            outs.append(pending.result())
        return outs

    one, split = steps(smol_runner, False), steps(runner, True)
    for a, b in zip(one, split):
        np.testing.assert_array_equal(a.valid, b.valid)
        np.testing.assert_array_equal(a.tokens[a.valid], b.tokens[b.valid])
        np.testing.assert_allclose(a.logprobs[a.valid], b.logprobs[b.valid], atol=1e-4)
    assert all(grammar_ok for grammar_ok in (int(o.tokens[0]) in set(np.flatnonzero(
        np.unpackbits(row.view(np.uint8), bitorder="little"))) for o in split))


# llama.cpp's samplers that the lean decode program leaves out, each beside plain greedy and sampled rows
LLAMA_SAMPLERS = (
    SamplingParams(temperature=0, dry_multiplier=1.5, dry_allowed_length=1),
    SamplingParams(temperature=1.0, typical_p=0.9, seed=5),
    SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05, seed=5),
    SamplingParams(temperature=1.0, dynatemp_range=0.4, seed=5),
    SamplingParams(temperature=1.0, top_n_sigma=1.0, seed=5),
    SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5, seed=6),
    SamplingParams(temperature=0, repetition_penalty=1.3, penalty_last_n=16),
)


def test_lean_sampling_runs_llama_cpp_samplers_in_programs_of_their_own(smol_runner, lean_runner, prompt_ids):
    """Where the deferred decode's programs are built, the fused decode and plain prefill
    programs leave llama.cpp's less common samplers out: a step with a slot that asks for one
    runs the forward pass and the full sampler as two programs, and such a request's last
    prompt chunk runs the full sampler's prefill program (a longer one its last tokens only:
    here a 210-token prompt's second chunk of 82). Every slot's tokens are those of a runner
    whose programs have them all; requests without them run the plain programs; nothing
    compiles after warm-up."""
    assert lean_runner._lean and not smol_runner._lean
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=3)]
    prompts = [prompt_ids[7] * 14, *prompt_ids[1:3]]
    assert len(prompts[0]) - lean_runner.prefill_chunks[-1] > lean_runner.prefill_chunks[0]
    generate(lean_runner, prompts[:2], 2, sampling=plain)  # any lazy host-side setup happens here
    with (unittest.mock.patch.object(lean_runner, "_decode_apart", wraps=lean_runner._decode_apart) as apart,
          unittest.mock.patch.object(lean_runner, "_program", wraps=lean_runner._program) as programs,
          no_compiles()):
        assert generate(lean_runner, prompts[:2], 6, sampling=plain) == generate(smol_runner, prompts[:2], 6,
                                                                                 sampling=plain)
        assert apart.call_count == 0
        assert {c.args[0] for c in programs.call_args_list} == {"prefill", "decode"}
        for sp in LLAMA_SAMPLERS:
            assert sp.uses_llama_samplers
            mixed = [sp, *plain]
            programs.reset_mock()
            assert (generate(lean_runner, prompts, 6, sampling=mixed)
                    == generate(smol_runner, prompts, 6, sampling=mixed)), sp
            assert [c.args[0] for c in programs.call_args_list].count("prefill_full") == 1
        assert apart.call_count == 5 * len(LLAMA_SAMPLERS)


def _scored(runner, prompt: list[int], slot: int, sampling: SamplingParams = SamplingParams(temperature=0.0)):
    """The prompt prefilled in scored chunks of the largest size (PrefillChunk.score): its
    first token and the PromptScores of its chunks, in order."""
    size = runner.prefill_chunks[-1]
    chunks = []
    for start in range(0, len(prompt), size):
        end = min(start + size, len(prompt))
        chunks.append(PrefillChunk(slot, np.asarray(prompt[start:end], np.int32), start, end == len(prompt),
                                   score=True, next_token=prompt[end] if end < len(prompt) else -1))
    out = smol_dispatch(runner, StepPlan(setups=(SlotSetup(slot, sampling),), prefills=tuple(chunks)))
    return int(out.tokens[slot]), out.scores


def smol_dispatch(runner, plan):
    return runner.dispatch(plan).result()


def test_scored_prompt_chunks_give_each_prompt_tokens_logprob_as_teacher_forcing_does(smollm2, smol_runner,
                                                                                      prompt_ids):
    """Prompt logprobs (PrefillChunk.score): over two chunks, each prompt token after the first
    gets the log-softmax of the logits a plain prefill of the tokens before it, then decode
    steps, give (model.offline.teacher_forced_logits), its rank there and the top tokens; the
    token after the first chunk is scored by that chunk's last row. The first token sampled is a
    plain prefill's."""
    chunk = smol_runner.prefill_chunks[-1]
    prompt = (prompt_ids[7] + prompt_ids[2] + prompt_ids[5]) * 30
    prompt = prompt[:chunk + 90]
    first, scores = _scored(smol_runner, prompt, slot=5)
    assert [(s.slot, s.first, len(s.logprobs)) for s in scores] == [(5, 1, chunk), (5, chunk + 1, 89)]
    lps = np.concatenate([s.logprobs for s in scores])
    ranks = np.concatenate([s.ranks for s in scores])
    top_ids = np.concatenate([s.top_ids for s in scores])
    top_lps = np.concatenate([s.top_logprobs for s in scores])
    assert lps.shape == (len(prompt) - 1,) and top_ids.shape == (len(prompt) - 1, smol_runner.max_top_logprobs)
    assert first == generate(smol_runner, [prompt], 1, slots=[2])[0][0]
    # the reference: positions 1..7, and 500..523 (across the chunks' boundary at 512)
    for k, m in ((1, 7), (chunk - 12, 24)):
        (ref,) = teacher_forced_logits(smollm2.config, smollm2.kernels, smollm2.params,
                                       [(prompt[:k], prompt[k:k + m])], max_context=smol_runner.max_context)
        ref_lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
        got = slice(k - 1, k - 1 + m)
        want = ref_lp[np.arange(m), prompt[k:k + m]]
        # (the reference's decode steps run the matmuls at one row, the chunk at 512: a few 1e-3 apart)
        np.testing.assert_allclose(lps[got], want, atol=1e-2)
        assert (1 + (ref_lp > want[:, None] + 1e-2).sum(axis=1) <= ranks[got]).all()
        assert (ranks[got] <= 1 + (ref_lp > want[:, None] - 1e-2).sum(axis=1)).all()
        np.testing.assert_array_equal(top_ids[got][:, :3], np.argsort(-ref_lp, axis=1)[:, :3])
        np.testing.assert_allclose(top_lps[got], np.sort(ref_lp, axis=1)[:, ::-1][:, :top_ids.shape[1]], atol=1e-2)
    assert (np.diff(top_lps, axis=1) <= 0).all() and (lps <= top_lps[:, 0] + 1e-6).all()
    assert ((ranks == 1) == (top_ids[:, 0] == np.asarray(prompt[1:]))).mean() > 0.99


def test_scored_chunks_pool_the_normed_hidden_states_a_whole_prefill_gives(smollm2, smol_runner, prompt_ids):
    """Embeddings (PromptScores.hidden_*): a prompt in three scored chunks of the smallest size
    pools the same normed last-layer rows as one plain-jnp prefill of the whole prompt in a
    fresh cache: their sum over each chunk's tokens, and its last token's."""
    size = smol_runner.prefill_chunks[0]
    prompt = (prompt_ids[3] + prompt_ids[6]) * 20
    prompt = prompt[:2 * size + 22]
    chunks = []
    for start in range(0, len(prompt), size):
        end = min(start + size, len(prompt))
        chunks.append(PrefillChunk(4, np.asarray(prompt[start:end], np.int32), start, end == len(prompt),
                                   score=True, next_token=prompt[end] if end < len(prompt) else -1))
    out = smol_dispatch(smol_runner, StepPlan(setups=(SlotSetup(4, SamplingParams(temperature=0.0)),),
                                              prefills=tuple(chunks)))
    assert [(s.first, s.hidden_tokens) for s in out.scores] == [(1, size), (size + 1, size), (2 * size + 1, 22)]
    cfg, kern, params = smollm2.config, smollm2.kernels, smollm2.params
    cache = forward.KVCache.create(cfg, 1, smol_runner.max_context, jnp.float32)
    x, _ = jax.jit(lambda p, c, t: forward.prefill_hidden(cfg, kern, p, c, jnp.int32(0), t, jnp.int32(0),
                                                          jnp.int32(len(prompt))))(params, cache, jnp.asarray(prompt))
    rows = np.asarray(forward.rms_norm(x, params.output_norm, cfg.rms_eps), np.float32)
    scale = np.abs(rows).max()
    for s, start in zip(out.scores, range(0, len(prompt), size)):
        got = rows[start:start + s.hidden_tokens]
        np.testing.assert_allclose(s.hidden_sum, got.sum(axis=0), atol=2e-3 * scale * len(got) ** 0.5)
        np.testing.assert_allclose(s.hidden_last, got[-1], atol=2e-3 * scale)


def test_dry_keeps_greedy_tokens_from_extending_repeats(smollm2, smol_runner, prompt_ids):
    """DRY with a multiplier far above any logit gap: no greedy token, the prefill's first or a
    decoded one, extends a repeat of 2 or more tokens of its prompt and output (llama.cpp's rule,
    as tests/model/test_sampling.py writes it plainly), unless a breaker; without DRY the same
    prompts do repeat; and a DRY request gets the same tokens beside seven others."""
    from tests.model.test_sampling import _dry_reference

    tok = smollm2.tokenizer
    breakers = tok.tokens_containing(SamplingParams.dry_sequence_breakers)
    dry = SamplingParams(temperature=0, dry_multiplier=1000.0, dry_breaker_ids=breakers)
    prompts = [tok.encode("one two three four five one two three four five one two three four five one two"),
               tok.encode("The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat")]

    def penalised(prompt: list[int], out: list[int]) -> int:
        seq, count = list(prompt), 0
        zeros = np.zeros((tok.vocab_size,), np.float32)
        for t in out:
            count += _dry_reference(seq, zeros, dry, set(breakers))[t] < 0
            seq.append(t)
        return count

    plain = generate(smol_runner, prompts, 12)
    got = generate(smol_runner, prompts, 12, sampling=dry)
    assert all(penalised(p, o) > 0 for p, o in zip(prompts, plain))  # these prompts do make it repeat
    assert all(penalised(p, o) == 0 for p, o in zip(prompts, got))
    crowd = generate(smol_runner, prompts + prompt_ids[:6], 12, sampling=dry)
    assert crowd[:2] == got


def test_mirostat_target_surprise_follows_each_token(smollm2, smol_runner, prompt_ids):
    """Mirostat 2's target surprise in the slot after a two-chunk prompt and its decodes is the
    recursion over the tokens drawn (mu starts at 2 tau, keeps the tokens of surprise at most
    mu, moves by eta times the drawn token's error), replayed on the host from the logits that
    chose them (model.offline.teacher_forced_logits): the first chunk did not move it, and each
    token moved it once."""
    chunk = smol_runner.prefill_chunks[-1]
    prompt = ((prompt_ids[7] + prompt_ids[2]) * 40)[:chunk + 40]
    tau, eta = 3.0, 0.3
    miro = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, mirostat_eta=eta, seed=11)
    (out,) = generate(smol_runner, [prompt], 12, sampling=miro, slots=[6])
    got = float(np.asarray(smol_runner._state.mu)[6])
    (logits,) = teacher_forced_logits(smollm2.config, smollm2.kernels, smollm2.params, [(prompt, out)],
                                      max_context=smol_runner.max_context)
    mu = 2 * tau
    for row, token in zip(logits.astype(np.float64), out):
        logp = row - np.logaddexp.reduce(row)
        keep = (-logp / np.log(2) <= mu) | (row == row.max())
        assert keep[token]
        kept = logp[keep]
        mu -= eta * (-(logp[token] - np.logaddexp.reduce(kept)) / np.log(2) - tau)
    assert mu != 2 * tau and got == pytest.approx(mu, rel=2e-3, abs=2e-3)


def test_llama_cpp_penalty_window_picks_what_the_window_gives(smollm2, smol_runner, prompt_ids):
    """llama.cpp's penalties over the last 16 tokens of prompt and output: each greedy token is
    the argmax of the model's logits (model.offline.teacher_forced_logits) with the penalties of
    the 16 tokens before it applied on the host (a near tie aside), and differs from OpenAI's
    counting over the same prompt; beside seven other requests the same tokens."""
    sp = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5,
                        penalty_last_n=16)
    prompt = prompt_ids[4] * 3
    (out,) = generate(smol_runner, [prompt], 16, sampling=sp, slots=[2])
    (logits,) = teacher_forced_logits(smollm2.config, smollm2.kernels, smollm2.params, [(prompt, out)],
                                      max_context=smol_runner.max_context)
    seq = list(prompt)
    for row, token in zip(logits.astype(np.float64), out):
        counts = np.bincount(seq[-16:], minlength=row.shape[0])
        seen = counts > 0
        row = np.where(seen, np.where(row > 0, row / 1.5, row * 1.5), row) - 0.5 * counts - 0.5 * seen
        assert row[token] >= row.max() - 1e-3
        seq.append(token)
    assert generate(smol_runner, [prompt], 16, sampling=dataclasses.replace(sp, penalty_last_n=None))[0] != out
    assert generate(smol_runner, [prompt] + prompt_ids[1:], 16, sampling=sp)[0] == out
