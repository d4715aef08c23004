"""The speculative decode (model/speculative.py): the row layout, the n-gram lookup against a
brute-force search, the acceptance rule, and on the real SmolLM2 the tokens of a plain decode,
alone, beside other requests and beside sampled ones."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import speculative
from model.offline import generate
from model.step_types import PrefillChunk, SamplingParams, SlotSetup, StepPlan
from tests.model.conftest import no_compiles


def test_layout_gives_each_busy_slot_a_row_and_the_spare_rows_in_turn():
    lay = speculative.layout_rows(8, (2,), (7,))
    assert lay.tolist() == [[2] * 8, list(range(8)), [1] * 8]
    lay = speculative.layout_rows(8, (0, 3, 5), (3, 0, 7))  # slot 3 does not speculate
    assert lay[0].tolist() == [0, 0, 0, 0, 3, 5, 5, 5]  # 5 spare rows: 0, 5, 0, 5, 0 in turn, slot 0 capped at 3
    assert lay[1].tolist() == [0, 1, 2, 3, 0, 0, 1, 2]
    assert lay[2].tolist() == [1] * 8
    lay = speculative.layout_rows(8, (1, 4), (2, 1))  # caps leave rows unused
    assert lay[0, :5].tolist() == [1, 1, 1, 4, 4] and lay[1, :5].tolist() == [0, 1, 2, 0, 1]
    assert lay[2].tolist() == [1] * 5 + [0] * 3
    assert speculative.layout_rows(8, tuple(range(8)), (7,) * 8) is None  # no spare row
    assert speculative.layout_rows(8, (0, 1), (0, 0)) is None  # nobody speculates
    with pytest.raises(ValueError):
        speculative.layout_rows(2, (0, 1, 2), (1, 1, 1))


def _brute_drafts(seq: list[int], num: int, nmax: int, nmin: int) -> list[int]:
    """The drafts for a slot whose tokens (cache and next input, the last) are `seq`."""
    p = len(seq) - 1
    for n in range(nmax, nmin - 1, -1):
        if n > p + 1:
            continue
        tail = seq[p - n + 1:]
        ends = [i for i in range(n - 1, p) if seq[i - n + 1:i + 1] == tail]  # occurrences ending at i < p
        if ends:  # the most tokens after it (at most num), then the latest
            i = max(ends, key=lambda i: (min(num, p - i), i))
            return seq[i + 1:i + 1 + min(num, p - i)]
    return []


@pytest.mark.parametrize("vocab", [2, 4, 30])
def test_ngram_drafts_match_a_brute_force_search(vocab):
    rng = np.random.default_rng(vocab)
    b, s, num = 6, 40, 5
    lookup = jax.jit(speculative.ngram_drafts, static_argnums=(3, 4, 5))
    for trial in range(20):
        positions = rng.integers(0, s, b)
        positions[0], positions[1] = 0, s - 1
        history = rng.integers(0, vocab, (b, s)).astype(np.int32)
        tokens = rng.integers(0, vocab, b).astype(np.int32)
        for nmax, nmin in ((3, 1), (2, 2), (4, 2)):
            drafts, count = lookup(jnp.asarray(history), jnp.asarray(tokens), jnp.asarray(positions, jnp.int32), num,
                                   nmax, nmin)
            for r in range(b):
                seq = history[r, :positions[r]].tolist() + [int(tokens[r])]
                want = _brute_drafts(seq, num, nmax, nmin)
                got = np.asarray(drafts[r, :int(count[r])]).tolist()
                assert got == want, (trial, vocab, nmax, nmin, r, seq)


def test_accept_takes_each_slots_drafts_while_they_match_the_row_before():
    # slot 0: rows 0-3 (drafts 1-3), slot 5: rows 4-6, slot 2: row 7 alone
    layout = jnp.asarray([[0, 0, 0, 0, 5, 5, 5, 2], [0, 1, 2, 3, 0, 1, 2, 0], [1] * 8], jnp.int32)
    valid = jnp.asarray([1, 1, 1, 1, 1, 1, 0, 1], bool)  # slot 5's draft 2 did not exist
    inputs = jnp.asarray([9, 10, 11, 99, 40, 41, 0, 7])
    chosen = jnp.asarray([10, 11, 12, 13, 41, 42, 43, 8])
    # slot 0: draft 1 (10) = row 0's 10, draft 2 (11) = row 1's 11, draft 3 (99) != 12: rows 0-2
    # slot 5: draft 1 (41) = 41: rows 4, 5; row 6 invalid. slot 2: row 7.
    got = speculative.accept(layout, valid, inputs, chosen)
    assert np.asarray(got).tolist() == [True, True, True, False, True, True, False, True]


# ---- on the real model


SPEC_PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


@pytest.fixture(scope="module")
def spec_runners(smollm2, smol_runner):
    """The model tests' plain runner and one that speculates (up to 7 drafts), its context cut
    to the plain one's first bucket (the prompts here stay in it, so both run the same bucket)."""
    from tests.model.conftest import SMOL_ENGINE

    cfg = dataclasses.replace(SMOL_ENGINE, max_context=1024, context_buckets=(1024,), draft_max=7, prompt_logprobs=False)
    assert SMOL_ENGINE.context_buckets[0] == 1024
    spec = smollm2.make_runner(cfg)
    spec.warmup()
    return smol_runner, spec


@pytest.fixture(scope="module")
def spec_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in SPEC_PROMPTS]


def test_speculative_greedy_tokens_are_the_plain_decodes(spec_runners, spec_ids):
    """Alone (7 drafts a step) and four together (1 or 2 each): the same tokens as a plain
    decode, with drafts accepted (so steps did give several tokens)."""
    plain, spec = spec_runners
    for ids in spec_ids:
        before = spec.drafts_accepted
        assert generate(spec, [ids], 40, slots=[3]) == generate(plain, [ids], 40, slots=[3])
        if ids is spec_ids[3]:  # counting: the model continues the pattern
            assert spec.drafts_accepted - before >= 10
    assert generate(spec, spec_ids, 30) == generate(plain, spec_ids, 30)
    assert spec.drafts_run > spec.drafts_accepted > 0


def test_speculation_beside_sampled_and_penalized_requests(spec_runners, spec_ids):
    """Greedy, seeded sampled, penalized and capped requests together, all speculating: each gets a
    plain decode's tokens (a sampled row draws with its slot's key at its own token index, a
    penalized row counts the drafts before it)."""
    plain, spec = spec_runners
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=7),
             SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0, draft_max=2)]

    def run(runner):
        setups = tuple(SlotSetup(s, sp) for s, sp in enumerate(kinds))
        prefills = tuple(PrefillChunk(s, np.asarray(ids, np.int32), 0, True) for s, ids in enumerate(spec_ids))
        out = runner.dispatch(StepPlan(setups=setups, prefills=prefills)).result()
        tokens = [[int(out.tokens[s])] for s in range(4)]
        while min(len(t) for t in tokens) < 20:
            for res in runner.dispatch(StepPlan(decode_slots=(0, 1, 2, 3))).results():
                for s in range(4):
                    if res.valid[s]:
                        tokens[s].append(int(res.tokens[s]))
        return [t[:20] for t in tokens]

    assert run(spec) == run(plain)


def test_the_hosts_positions_come_back_to_the_tokens_emitted(spec_runners, spec_ids):
    """The runner counts a speculative step's rows as positions at dispatch (for the context
    bucket) and takes back what was not emitted when the step is read."""
    _, spec = spec_runners
    out = generate(spec, [spec_ids[2]], 25, slots=[6])
    assert spec._positions[6] == len(spec_ids[2]) + len(out[0]) - 1  # the last token is not in the cache yet


def test_speculation_compiles_nothing_after_warmup(spec_runners, spec_ids):
    _, spec = spec_runners
    generate(spec, spec_ids[:1], 3)
    with no_compiles():
        generate(spec, spec_ids, 12)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs jax's default backend to be a GPU")
def test_speculative_tokens_on_the_gpu_kernels(synthetic_gguf):
    """On the GPU's kernels (Mosaic matmuls, Triton attention writing the cache itself, the
    other rows' keys scattered first): a 4-layer Llama-2-7B-shaped Q4_0 file's greedy tokens with
    drafts are a plain decode's, alone and beside three others. Random weights repeat tokens, so
    drafts are accepted often."""
    from model.config import EngineConfig
    from model.loader import load_model

    cfg = EngineConfig(num_slots=8, max_context=1024, context_buckets=(512, 1024), prefill_chunks=(64, 512),
                       kv_dtype="bfloat16", compute_dtype="bfloat16", prompt_logprobs=False)
    loaded = load_model(synthetic_gguf("llama2-7b", "q4_0", layers=4), cfg)
    plain, spec = loaded.make_runner(cfg), loaded.make_runner(dataclasses.replace(cfg, draft_max=7))
    plain.warmup()
    spec.warmup()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 30000, n)] for n in (5, 40, 300, 600)]
    for ids in prompts:
        assert generate(spec, [ids], 48, slots=[2]) == generate(plain, [ids], 48, slots=[2])
    assert generate(spec, prompts, 48) == generate(plain, prompts, 48)
    assert spec.drafts_accepted > 0


def test_several_speculative_steps_per_dispatch(smollm2, spec_runners, spec_ids):
    """With --decode-steps 3 a dispatch scans three speculative steps: the same tokens again,
    several offsets' outputs per step in order."""
    from model.step_types import StepPlan as Plan
    from tests.model.conftest import SMOL_ENGINE

    plain, _ = spec_runners
    cfg = dataclasses.replace(SMOL_ENGINE, num_slots=4, max_context=512, context_buckets=(512,), prefill_chunks=(64,),
                              draft_max=3, decode_steps_per_dispatch=3, prompt_logprobs=False)
    runner = smollm2.make_runner(cfg)
    runner.warmup()
    assert runner.decode_steps == (1, 3)
    ids = spec_ids[3]
    want = generate(plain, [ids], 40, slots=[0])[0]
    first = generate(runner, [ids], 1, slots=[1])[0]  # the prompt, its first token
    got = list(first)
    while len(got) < 40:
        outs = runner.dispatch(Plan(decode_slots=(1,), num_decode_steps=3)).results()
        got += [int(o.tokens[1]) for o in outs if o.valid[1]]
    assert got[:40] == want
    assert len(outs) > 3  # some step gave several tokens
    # A request below the gain bar probes again after DRAFT_PROBE_STEPS decode steps, not
    # dispatches: with 3 steps a dispatch, in every fourth dispatch (8 steps reached at the fourth).
    from model.runner import DRAFT_PROBE_STEPS

    assert DRAFT_PROBE_STEPS == 8
    runner.engine_cfg = dataclasses.replace(cfg, draft_min_gain=100.0)  # no average reaches it
    generate(runner, [ids], 1, slots=[1])  # a new prompt: its count from 0
    spec = []
    for _ in range(12):
        before = runner.spec_steps
        runner.dispatch(Plan(decode_slots=(1,), num_decode_steps=3)).results()
        spec.append(runner.spec_steps > before)
    assert spec == [False, False, False, True] * 3


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.2, seed=1),
    SamplingParams(temperature=1.2, seed=2),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=1.0),
    SamplingParams(temperature=0.8, seed=3, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.2, top_n_sigma=3.0,
                   dynatemp_range=0.3),
], ids=["t0.7-seed1", "t1.2-seed1", "t1.2-seed2", "presence", "frequency", "llama-samplers"])
def test_sampled_and_penalized_requests_alone_get_a_plain_decodes_tokens(spec_runners, spec_ids, sp):
    """Alone (7 drafts a step), on the list the prompt repeats: seeded sampled requests get a
    plain decode's tokens with the same seed, penalized greedy ones a plain decode's, and drafts
    are kept. These settings and prompt are ones where a row drawing with its slot's key at the
    wrong token index, or counting penalties without the drafts before it, changed the tokens
    (each of those faults made 6 of 12 and 2 of 9 such runs differ)."""
    plain, spec = spec_runners
    before = spec.drafts_accepted
    got = generate(spec, [spec_ids[0]], 30, slots=[4], sampling=sp)
    assert got == generate(plain, [spec_ids[0]], 30, slots=[4], sampling=sp)
    assert spec.drafts_accepted > before


def test_prompts_beside_speculative_steps_and_a_slot_reused_before_its_step_is_read(spec_runners, spec_ids):
    """As the engine plans them: a long prompt's chunks in the same steps as a speculating
    slot's decode, and a slot given a new prompt while its last speculative step is still
    unread (the engine dispatches a step before reading the one before it). Each request gets a
    plain decode's tokens, and the reused slot's host position is its new prompt's, not rolled
    back by the old step's unemitted rows."""
    plain, spec = spec_runners
    greedy = SamplingParams(temperature=0.0)
    long_ids = np.asarray((spec_ids[3] * 20)[:150], np.int32)  # three chunks: 64, 64, 22

    def run(runner):
        toks: dict[int, list[int]] = {0: [], 5: [], 1: []}

        def take(pending):
            for o in pending.results():
                for s in toks:
                    if o.valid[s]:
                        toks[s].append(int(o.tokens[s]))

        take(runner.dispatch(StepPlan(setups=(SlotSetup(0, greedy),),
                                      prefills=(PrefillChunk(0, np.asarray(spec_ids[0], np.int32), 0, True),))))
        for i in range(0, len(long_ids), 64):  # slot 0 decodes while slot 5's prompt goes in
            chunk = PrefillChunk(5, long_ids[i:i + 64], i, i + 64 >= len(long_ids))
            take(runner.dispatch(StepPlan(setups=(SlotSetup(5, greedy),) if i == 0 else (), decode_slots=(0,),
                                          prefills=(chunk,))))
        for _ in range(4):
            take(runner.dispatch(StepPlan(decode_slots=(0, 5))))
        # slot 0 decodes once more; before that step is read, slot 0 takes a new request (slot 1
        # then stands for its tokens)
        last = runner.dispatch(StepPlan(decode_slots=(0, 5)))
        fresh = np.asarray(spec_ids[2], np.int32)
        nxt = runner.dispatch(StepPlan(setups=(SlotSetup(0, greedy),), decode_slots=(5,),
                                       prefills=(PrefillChunk(0, fresh, 0, True),)))
        take(last)
        n0 = len(toks[0])
        take(nxt)
        position = int(runner._positions[0])
        toks[1] = toks[0][n0:]
        del toks[0][n0:]
        for _ in range(5):
            for o in runner.dispatch(StepPlan(decode_slots=(0, 5))).results():
                if o.valid[0]:
                    toks[1].append(int(o.tokens[0]))
                if o.valid[5]:
                    toks[5].append(int(o.tokens[5]))
        return toks, position

    (got, position), (want, _) = run(spec), run(plain)
    assert position == len(spec_ids[2])
    assert len(want[0]) == 9 and got[0][:9] == want[0]  # its prompt's token, 8 decode steps
    assert len(got[0]) > 9  # drafts were kept
    n = min(len(want[5]), len(got[5]))
    assert n >= 10 and got[5][:n] == want[5][:n]
    n = min(len(want[1]), len(got[1]))
    assert n >= 6 and got[1][:n] == want[1][:n]


def test_a_request_whose_drafts_do_not_pay_stops_speculating(spec_runners, spec_ids):
    """A request whose drafts are rarely kept (sampled hot: its draws seldom equal a draft) has
    its moving average fall below `draft_min_gain`: most of its steps then run the plain decode
    program, with a speculative one every DRAFT_PROBE_STEPS dispatches; a repeating one keeps
    speculating. The tokens are a plain decode's either way; with a bar of 0 every step
    speculates."""
    import dataclasses as dc

    from model.runner import DRAFT_PROBE_STEPS

    plain, spec = spec_runners
    hot = SamplingParams(temperature=1.5, seed=3)

    def run(ids, sp, n):
        before = spec.spec_steps
        got = generate(spec, [ids], n, slots=[2], sampling=sp)
        assert got == generate(plain, [ids], n, slots=[2], sampling=sp)
        return spec.spec_steps - before, len(got[0]) - 1  # the first token is the prompt's

    spec_steps, steps = run(spec_ids[2], hot, 60)
    assert spec_steps <= 8 + steps // DRAFT_PROBE_STEPS + 2, (spec_steps, steps)
    spec_steps, _ = run(spec_ids[3], SamplingParams(temperature=0.0), 60)  # counting: drafts kept
    assert spec_steps >= 10
    cfg = spec.engine_cfg
    spec.engine_cfg = dc.replace(cfg, draft_min_gain=0.0)
    try:
        spec_steps, steps = run(spec_ids[2], hot, 30)
    finally:
        spec.engine_cfg = cfg
    assert spec_steps == steps


def test_dry_mirostat_and_window_requests_check_no_drafts_and_get_a_plain_decodes_tokens(smollm2, spec_runners,
                                                                                          spec_ids):
    """DRY and llama.cpp's penalty window read each row's tokens so far, which a draft row's are
    not assembled for, and mirostat the target surprise the tokens before left: such a request's
    slot gets no draft rows, and its tokens are a plain decode's."""
    plain, spec = spec_runners
    breakers = smollm2.tokenizer.tokens_containing(SamplingParams.dry_sequence_breakers)
    for sp in (SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_breaker_ids=breakers),
               SamplingParams(temperature=1.5, mirostat=2, mirostat_tau=1.0, seed=5),
               SamplingParams(temperature=0.0, frequency_penalty=1.0, penalty_last_n=8)):
        before = spec.drafts_run
        got = generate(spec, [spec_ids[0]], 20, slots=[4], sampling=sp)
        assert got == generate(plain, [spec_ids[0]], 20, slots=[4], sampling=sp)
        assert spec.drafts_run == before
        # the sampler changed them (the prompt repeats a list)
        assert got != generate(plain, [spec_ids[0]], 20, slots=[4], sampling=SamplingParams(temperature=sp.temperature,
                                                                                               seed=5))
