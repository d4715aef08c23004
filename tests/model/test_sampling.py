"""Sampling: hand-computed penalties and masks, greedy = argmax, seeded draws independent of
the other rows and of the batch size, logprobs = log_softmax of the penalised logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import sampling
from model.step_types import SamplingParams

NUM_TOP = 4


@functools.partial(jax.jit, static_argnames=("num_top",))
def _sample(logits, arrays, prompt_mask, counts, step_index, num_top=NUM_TOP):
    return sampling.sample(logits, arrays, prompt_mask, counts, step_index, num_top)


def _run(logits, params, *, prompt_mask=None, counts=None, step_index=None, max_bias=4, num_top=NUM_TOP):
    logits = np.asarray(logits, np.float32)
    b, v = logits.shape
    arrays = sampling.pack_sampling(params, max_bias)
    prompt_mask = np.zeros((b, v), bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    counts = np.zeros((b, v), np.int32) if counts is None else np.asarray(counts, np.int32)
    step_index = np.zeros((b,), np.int32) if step_index is None else np.asarray(step_index, np.int32)
    out = _sample(logits, arrays, prompt_mask, counts, step_index, num_top=num_top)
    return tuple(np.asarray(x) for x in out)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    tokens, logprob, top_ids, top_lps = _run(logits, [SamplingParams(temperature=0, top_logprobs=NUM_TOP)] * 3)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    ref = _log_softmax(logits)
    np.testing.assert_allclose(logprob, ref[np.arange(3), tokens], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-logits, axis=-1)[:, :NUM_TOP])
    np.testing.assert_allclose(top_lps, np.sort(ref, axis=-1)[:, ::-1][:, :NUM_TOP], rtol=1e-5, atol=1e-5)
    assert top_ids.dtype == np.int32 and tokens.dtype == np.int32


def test_alternatives_only_when_a_row_asks():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    _, _, top_ids, top_lps = _run(logits, [SamplingParams(temperature=0)] * 3)
    assert (top_ids == 0).all() and np.isneginf(top_lps).all()  # nobody asked: padding
    rows = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_logprobs=2), SamplingParams(temperature=0)]
    _, _, top_ids, top_lps = _run(logits, rows)
    np.testing.assert_array_equal(top_ids[1], np.argsort(-logits[1])[:NUM_TOP])
    np.testing.assert_allclose(top_lps[1], np.sort(_log_softmax(logits[1]))[::-1][:NUM_TOP], rtol=1e-5, atol=1e-5)


def test_rows_outside_the_step_are_neutral():
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, top_logprobs=3, seed=1),
              SamplingParams(temperature=0.7, top_p=0.5, top_logprobs=2, seed=2)]
    arrays = sampling.for_rows(sampling.pack_sampling(params, 0), jnp.asarray([True, False]))
    assert np.asarray(arrays.temperature).tolist() == pytest.approx([0.8, 0.0])
    assert np.asarray(arrays.top_k).tolist() == [5, 0] and np.asarray(arrays.top_p).tolist() == pytest.approx([0.9, 1.0])
    assert np.asarray(arrays.top_logprobs).tolist() == [3, 0]
    logits = np.random.default_rng(4).normal(size=(2, 50)).astype(np.float32)
    out = _sample(logits, arrays, np.zeros((2, 50), bool), np.zeros((2, 50), np.int32), np.zeros((2,), np.int32))
    alone = _run(logits[:1], params[:1])
    np.testing.assert_array_equal(np.asarray(out[0])[:1], alone[0])  # the kept row samples as before
    assert np.asarray(out[0])[1] == logits[1].argmax() and (np.asarray(out[2])[1] == 0).all()


def test_penalties_and_logit_bias_hand_computed():
    logits = np.array([[1.0, -1.0, 2.0, 0.5, 0.0]], np.float32)
    prompt_mask = np.array([[True, True, False, False, False]])
    counts = np.array([[0, 0, 0, 2, 0]], np.int32)
    params = SamplingParams(
        temperature=0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((2, -3.0), (4, 0.25)),
        top_logprobs=5,
    )
    # bias:        [1, -1, -1, 0.5, 0.25]
    # repetition over {0, 1, 3} (prompt or generated): positive / 2, negative * 2
    #              [0.5, -2, -1, 0.25, 0.25]
    # presence 0.5 and frequency 0.25 * 2 on token 3: 0.25 - 0.5 - 0.5 = -0.75
    expected = np.array([0.5, -2.0, -1.0, -0.75, 0.25])
    arrays = sampling.pack_sampling([params], 4)
    got = sampling.apply_penalties(jnp.asarray(logits), arrays, jnp.asarray(prompt_mask), jnp.asarray(counts))
    np.testing.assert_allclose(np.asarray(got)[0], expected, rtol=1e-6)

    tokens, logprob, top_ids, top_lps = _run(logits, [params], prompt_mask=prompt_mask, counts=counts, num_top=5)
    assert tokens[0] == 0
    ref = _log_softmax(expected[None])[0]
    np.testing.assert_allclose(logprob[0], ref[0], rtol=1e-5)
    np.testing.assert_array_equal(top_ids[0], np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(top_lps[0], np.sort(ref)[::-1], rtol=1e-5)


def test_greedy_row_picks_argmax_of_penalised_logits_beside_sampling_rows():
    logits = np.array([[3.0, 2.9, 0.0, 0.0]] * 2, np.float32)
    greedy = SamplingParams(temperature=0, top_k=3, logit_bias=((1, 0.5),))
    sampled = SamplingParams(temperature=1.0, top_k=2, seed=1)
    tokens, *_ = _run(logits, [greedy, sampled])
    assert tokens[0] == 1


def _draw_sets(probs: list[float], params: SamplingParams, num_draws: int = 512) -> set[int]:
    """The set of tokens drawn over `num_draws` rows with distinct seeds."""
    logits = np.log(np.asarray(probs, np.float32))
    batch = np.tile(logits, (num_draws, 1))
    rows = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(num_draws)]
    tokens, *_ = _run(batch, rows)
    return set(tokens.tolist())


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.7), {0, 1}),  # mass before token 1 is 0.5 < 0.7, before token 2 0.8
        (SamplingParams(top_p=0.5), {0}),  # mass before token 1 is 0.5, not < 0.5
        (SamplingParams(top_p=0.9), {0, 1, 2}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # floor 0.2 * 0.5 = 0.1
        (SamplingParams(min_p=0.7), {0}),
    ],
)
def test_truncation_masks(params, expected):
    assert _draw_sets(PROBS, params) == expected


# PROBS' entropy is 1.142 nats; the surprises' distances from it are 0.449, 0.062, 0.755, 1.853,
# so locally typical sampling takes tokens 1, 0, 2, 3 in that order.
@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(typical_p=0.2), {1}),  # mass before token 0 (in that order) is 0.3 > 0.2
        (SamplingParams(typical_p=0.5), {0, 1}),
        (SamplingParams(typical_p=0.85), {0, 1, 2}),  # mass before token 3 is 0.95
        (SamplingParams(typical_p=0.99), {0, 1, 2, 3}),
        # top_k=2 leaves [0.625, 0.375], entropy 0.662: token 0's surprise is nearer
        (SamplingParams(top_k=2, typical_p=0.5), {0}),
        # typical 0.5 leaves {0, 1} -> [0.625, 0.375]; then top_p 0.6 keeps token 0 alone
        (SamplingParams(typical_p=0.5, top_p=0.6), {0}),
        (SamplingParams(typical_p=0.2, top_p=0.6), {1}),
    ],
)
def test_locally_typical_sampling(params, expected):
    assert _draw_sets(PROBS, params) == expected


@pytest.mark.parametrize("n, kept", [(0.5, 2), (0.9, 3), (3.0, 4), (0.0, 4), (-1.0, 4)])
def test_top_n_sigma_at_any_temperature(n, kept):
    # logits [2, 1.5, 1, -3] (and [-inf] beside them, not counted): mean 0.375, standard
    # deviation sqrt(3.922) = 1.980, so n = 0.5 keeps logits >= 1.01 and n = 0.9 those >= 0.218
    logits = np.array([[2.0, 1.5, 1.0, -3.0, -np.inf]], np.float32)
    for temperature in (1.0, 0.5, 2.0):
        out = np.asarray(sampling._top_n_sigma(jnp.asarray(logits / temperature), jnp.asarray([n], jnp.float32)))
        assert np.isfinite(out[0]).sum() == kept
        np.testing.assert_array_equal(out[0, :kept], logits[0, :kept] / temperature)
    if n == 0.5:
        probs = np.exp(logits[0, :4]) / np.exp(logits[0, :4]).sum()
        assert _draw_sets(probs.tolist(), SamplingParams(temperature=0.5, top_n_sigma=n)) == {0, 1}


@pytest.mark.parametrize(
    "params, expected",
    [
        # tokens 0, 1 and 2 have p >= 0.1: all but the least likely of them (2) go
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.1), {2, 3}),
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.2), {1, 2, 3}),
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.4), {0, 1, 2, 3}),  # one token above: none go
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.6), {0, 1, 2, 3}),  # above 0.5: off
        (SamplingParams(xtc_probability=0.0, xtc_threshold=0.1), {0, 1, 2, 3}),
        # after top_k=2 ([0.625, 0.375]) only token 1 is left
        (SamplingParams(top_k=2, xtc_probability=1.0, xtc_threshold=0.3), {1}),
        # a threshold of 0 takes in what is left, never the tokens top-k removed
        (SamplingParams(top_k=3, xtc_probability=1.0, xtc_threshold=0.0), {2}),
        # with min_tokens' bans on 0 and 1 (-inf): of {2, 3}, 3
        (SamplingParams(xtc_probability=1.0, xtc_threshold=0.0, min_tokens=5, min_tokens_ids=(0, 1)), {3}),
    ],
)
def test_exclude_top_choices(params, expected):
    assert _draw_sets(PROBS, params) == expected


def test_exclude_top_choices_keeps_one_of_a_tie():
    # 0.45, 0.45, 0.1 at threshold 0.2: one of the tied pair goes, the higher id (llama.cpp removes all but one)
    assert _draw_sets([0.45, 0.45, 0.1], SamplingParams(xtc_probability=1.0, xtc_threshold=0.2)) == {0, 2}


def test_exclude_top_choices_applies_with_its_probability():
    # Applied, the draw is token 2 or 3; not applied, one of them with probability 0.2: in all
    # 0.5 * 1 + 0.5 * 0.2 = 0.6 at xtc_probability 0.5.
    rows = [SamplingParams(xtc_probability=0.5, xtc_threshold=0.1, seed=i) for i in range(1024)]
    tokens, *_ = _run(np.tile(np.log(np.asarray(PROBS, np.float32)), (1024, 1)), rows)
    assert 0.55 < np.isin(tokens, [2, 3]).mean() < 0.65


def test_dynamic_temperature_follows_the_entropy():
    def temperatures(logits, params):
        arrays = sampling.pack_sampling(params, 0)
        return np.asarray(sampling._dynamic_temperature(jnp.asarray(logits, jnp.float32), arrays))

    flat = np.zeros((1, 8), np.float32)  # normalised entropy 1: the top of the range
    one = np.array([[0.0] + [-np.inf] * 7], np.float32)  # one finite token: entropy 0, the bottom
    assert temperatures(flat, [SamplingParams(temperature=1.0, dynatemp_range=0.5)]) == pytest.approx([1.5])
    assert temperatures(one, [SamplingParams(temperature=1.0, dynatemp_range=0.5)]) == pytest.approx([0.5])
    assert temperatures(flat, [SamplingParams(temperature=0.7)]) == pytest.approx([0.7])  # off
    peaked = np.array([[3.0, 1.0, 0.0, 0.0, -1.0, -2.0, -np.inf, -np.inf]], np.float32)
    p = np.exp(peaked[0, :6] - peaked[0, :6].max())
    p /= p.sum()
    normalised = -(p * np.log(p)).sum() / np.log(6)
    for exponent in (1.0, 2.0):
        want = 0.2 + (1.8 - 0.2) * normalised**exponent  # temperature 1 +- 0.8
        got = temperatures(peaked, [SamplingParams(temperature=1.0, dynatemp_range=0.8, dynatemp_exponent=exponent)])
        assert got == pytest.approx([want], rel=1e-5)
    # a range past the temperature stops at 0 and still samples (near greedy on a peaked row)
    cold = SamplingParams(temperature=0.3, dynatemp_range=1.0)
    assert temperatures(one, [cold]) == pytest.approx([1e-6])
    assert _draw_sets([0.9, 0.05, 0.05], SamplingParams(temperature=0.1, dynatemp_range=0.1), 256) == {0}


def test_top_k_then_top_p_on_renormalised_mass():
    # top_k=2 leaves [0.5, 0.3] -> [0.625, 0.375]; top_p=0.6 keeps only token 0.
    assert _draw_sets(PROBS, SamplingParams(top_k=2, top_p=0.6)) == {0}
    # Without top_k, top_p=0.6 keeps tokens 0 and 1 (mass before token 1 is 0.5).
    assert _draw_sets(PROBS, SamplingParams(top_p=0.6)) == {0, 1}


def test_temperature_sharpens():
    cold = _draw_sets([0.4, 0.3, 0.2, 0.1], SamplingParams(temperature=0.02))
    assert cold == {0}


def test_seeded_draws_reproducible_and_independent_of_neighbours_and_batch():
    rng = np.random.default_rng(1)
    vocab = 1000
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    target = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, seed=7),
        None,
        SamplingParams(temperature=1.3, seed=9, repetition_penalty=1.3, typical_p=0.9, xtc_probability=0.5,
                       top_n_sigma=1.5, dynatemp_range=0.5),
    ]
    alone = []
    for step in range(6):
        tok, lp, _, _ = _run(logits[2:3], [target], step_index=[step])
        alone.append((int(tok[0]), float(lp[0])))
    # Reproducible.
    again, _, _, _ = _run(logits[2:3], [target], step_index=[0])
    assert int(again[0]) == alone[0][0]
    # The draws change with the token index.
    assert len({t for t, _ in alone}) > 1
    # Same row inside a batch of 5 with other settings and other step indices.
    params = neighbours[:2] + [target] + neighbours[2:]
    for step in range(6):
        tok, lp, _, _ = _run(logits, params, step_index=[3, 1, step, 0, 5])
        assert (int(tok[2]), float(lp[2])) == alone[step]
    # And with neutral (no top_k / top_p) neighbours, so the sort branch does not run.
    target_plain = SamplingParams(temperature=1.0, seed=99)
    solo, _, _, _ = _run(logits[1:2], [target_plain], step_index=[4])
    both, _, _, _ = _run(logits[:2], [SamplingParams(temperature=1.0, seed=5, top_k=3), target_plain], step_index=[0, 4])
    assert int(solo[0]) == int(both[1])


def test_unseeded_requests_draw_different_seeds():
    arrays = sampling.pack_sampling([SamplingParams(), SamplingParams()], 0)
    assert not np.array_equal(arrays.seed[0], arrays.seed[1])


def test_pack_sampling_layout():
    big_seed = (5 << 32) | 7
    arrays = sampling.pack_sampling(
        [None, SamplingParams(temperature=0.5, top_k=3, seed=big_seed, logit_bias=((9, -1.5),))], 3
    )
    assert arrays.temperature.tolist() == [0.0, 0.5]
    assert arrays.top_k.tolist() == [0, 3]
    assert arrays.top_p.tolist() == [1.0, 1.0]
    assert arrays.repetition_penalty.tolist() == [1.0, 1.0]
    assert arrays.seed.dtype == np.uint32 and arrays.seed[1].tolist() == [5, 7]
    assert arrays.bias_ids.tolist() == [[-1, -1, -1], [9, -1, -1]]
    assert arrays.bias_values[1].tolist() == [-1.5, 0.0, 0.0]
    with pytest.raises(ValueError):
        sampling.pack_sampling([SamplingParams(logit_bias=((1, 1.0), (2, 1.0)))], 1)


def test_one_compilation_serves_any_settings():
    fn = jax.jit(sampling.sample, static_argnames=("num_top",))
    logits = np.zeros((2, 8), np.float32)
    mask, counts, steps = np.zeros((2, 8), bool), np.zeros((2, 8), np.int32), np.zeros((2,), np.int32)
    for params in (
        [None, None],
        [SamplingParams(temperature=0.3, top_k=2, seed=1), SamplingParams(temperature=0, repetition_penalty=1.2)],
        [SamplingParams(top_p=0.5, min_p=0.1, seed=2, logit_bias=((1, 3.0),)), None],
    ):
        fn(logits, sampling.pack_sampling(params, 2), mask, counts, steps, num_top=2)
    assert fn._cache_size() == 1


def test_update_counts():
    counts = jnp.zeros((3, 4), jnp.int32)
    counts = sampling.update_counts(counts, jnp.array([1, 2, 3]), jnp.array([True, False, True]))
    counts = sampling.update_counts(counts, jnp.array([1, 2, 0]), jnp.array([True, True, True]))
    np.testing.assert_array_equal(np.asarray(counts), [[0, 2, 0, 0], [0, 0, 1, 0], [1, 0, 0, 1]])


@pytest.mark.parametrize("num_top", [0, NUM_TOP])
def test_without_conditionals_the_same_outputs(num_top):
    """`skip_unused=False` (the prefill step's: no conditionals for XLA to run on the host) gives
    exactly the outputs of the conditional form, for greedy, sampled, truncated, llama.cpp's
    samplers (DRY and mirostat with their state) and logprob-asking rows side by side, and for an
    all-greedy batch; its program has no conditional."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((4, 64)).astype(np.float32) * 3
    mask, counts = rng.random((4, 64)) < 0.1, rng.integers(0, 3, (4, 64)).astype(np.int32)
    steps = np.array([0, 3, 5, 1], np.int32)
    batches = (
        [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3, top_logprobs=2),
         SamplingParams(temperature=1.2, top_k=5, top_p=0.7, seed=4), SamplingParams(temperature=0.5, min_p=0.2, seed=5,
                                                                                  repetition_penalty=1.3)],
        [SamplingParams(temperature=0)] * 4,
        [SamplingParams(temperature=0, top_logprobs=3)] + [SamplingParams(temperature=0)] * 3,
        [SamplingParams(temperature=0.8, seed=6), SamplingParams(temperature=0)] * 2,  # sampled, none truncated
        [SamplingParams(temperature=0.9, typical_p=0.6, seed=7), SamplingParams(temperature=1.1, seed=8, top_p=0.8),
         SamplingParams(temperature=0.7, seed=9, xtc_probability=1.0, xtc_threshold=0.05, top_n_sigma=2.0),
         SamplingParams(temperature=1.0, seed=10, dynatemp_range=0.6, dynatemp_exponent=1.5, top_k=6, typical_p=0.8)],
    )
    batches += (
        [SamplingParams(temperature=0.9, seed=11, mirostat=2, mirostat_tau=2.0), SamplingParams(temperature=0),
         SamplingParams(temperature=1.0, seed=12, mirostat=1), SamplingParams(temperature=0, dry_multiplier=0.8)],
        [SamplingParams(temperature=0.7, seed=13, dry_multiplier=1.5, dry_allowed_length=1)] + [SamplingParams()] * 3,
        [SamplingParams(temperature=0, frequency_penalty=0.5, penalty_last_n=8), SamplingParams(temperature=0)] * 2,
    )
    history = rng.integers(0, 6, (4, 40)).astype(np.int32)  # a small alphabet: repeats for DRY
    dry = sampling.TokenHistory(*map(jnp.asarray, (history, np.arange(4, dtype=np.int32), np.array([30, 39, 12, 25]),
                                                  history[:, 0], np.stack([sampling.token_bits([2], 64)] * 4))))
    mu = np.array([4.0, 1.0, 6.0, 3.0], np.float32)
    fns = {skip: jax.jit(lambda *a, skip=skip: sampling.sample_stateful(*a, num_top=num_top, mu=mu, skip_unused=skip,
                                                                        history=dry)) for skip in (True, False)}
    for params in batches:
        args = (logits, sampling.pack_sampling(params, 2), mask, counts, steps)
        with_conds, without = (tuple(np.asarray(x) for x in fns[skip](*args)) for skip in (True, False))
        for a, b in zip(with_conds, without):
            np.testing.assert_array_equal(a, b)
    assert "conditional(" in fns[True].lower(*args).compile().as_text()
    assert "conditional(" not in fns[False].lower(*args).compile().as_text()


def test_without_llama_samplers_the_same_outputs_for_rows_that_ask_for_none():
    """`llama_samplers=False` (the GPU's lean programs) gives exactly the full sampler's outputs
    for rows whose settings `SamplingParams.uses_llama_samplers` calls plain, their llama.cpp
    fields set where they change nothing (greedy rows, a threshold above 0.5, a window without a
    penalty, DRY over no tokens) beside plain sampled ones; and any one of those samplers, asked
    for by a sampled row, makes the property true."""
    neutral = (
        SamplingParams(temperature=0, typical_p=0.5, top_n_sigma=1.0, dynatemp_range=0.5, mirostat=2,
                       xtc_probability=1.0, xtc_threshold=0.1, top_logprobs=2),
        SamplingParams(temperature=0.9, seed=1, xtc_probability=1.0, xtc_threshold=0.6, top_n_sigma=-1.0),
        SamplingParams(temperature=0.8, seed=2, penalty_last_n=8, top_k=5, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.7, seed=3, dry_multiplier=2.0, dry_penalty_last_n=0, repetition_penalty=1.2,
                       presence_penalty=0.5, logit_bias=((3, 2.0),)),
    )
    assert not any(sp.uses_llama_samplers for sp in neutral)
    for fields in (dict(typical_p=0.9), dict(top_n_sigma=1.0), dict(dynatemp_range=0.3), dict(mirostat=1),
                   dict(xtc_probability=0.5), dict(dry_multiplier=0.8), dict(repetition_penalty=1.1, penalty_last_n=16)):
        assert SamplingParams(temperature=0.8, **fields).uses_llama_samplers, fields
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((4, 64)).astype(np.float32) * 3
    mask, counts = rng.random((4, 64)) < 0.1, rng.integers(0, 3, (4, 64)).astype(np.int32)
    history = rng.integers(0, 6, (4, 40)).astype(np.int32)
    ctx = sampling.TokenHistory(*map(jnp.asarray, (history, np.arange(4, dtype=np.int32), np.array([30, 39, 12, 25]),
                                                  history[:, 0], np.zeros((4, 2), np.int32))))
    mu = np.array([4.0, 1.0, 6.0, 3.0], np.float32)
    args = (logits, sampling.pack_sampling(list(neutral), 2), mask, counts, np.array([0, 3, 5, 1], np.int32))
    for skip in (True, False):
        full, lean = (jax.jit(lambda *a, full=full: sampling.sample_stateful(
            *a, num_top=NUM_TOP, mu=mu, skip_unused=skip, history=ctx, llama_samplers=full))(*args)
            for full in (True, False))
        for a, b in zip(full, lean):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_loop_in_the_gpu_lowering():
    """The sampler, lowered for CUDA (here, without a GPU), has no loop: its work runs under the
    decode step's conditionals, and on the GPU a loop inside a conditional kept that conditional
    out of the step's CUDA graph, so the host waited for the device at every step (a DRY loop did
    that: 4.2 ms a 7B decode step against 2.4 without it, on an H100)."""
    from jax import export

    rows, vocab, size = 4, 64, 40
    dry = sampling.TokenHistory(jnp.zeros((rows, size), jnp.int32), jnp.arange(rows, dtype=jnp.int32),
                                jnp.full((rows,), 5, jnp.int32), jnp.zeros((rows,), jnp.int32),
                                jnp.zeros((rows, vocab // 32), jnp.int32))

    def fn(logits, arrays, mask, counts, steps, mu, allowed):
        return sampling.sample_stateful(logits, arrays, mask, counts, steps, NUM_TOP, mu, allowed=allowed, history=dry)

    args = (jnp.zeros((rows, vocab)), sampling.pack_sampling([SamplingParams()] * rows, 2),
            jnp.zeros((rows, vocab), bool), jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows,), jnp.int32),
            jnp.zeros((rows,)), jnp.full((rows, vocab // 32), -1, jnp.int32))
    text = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "stablehlo.case" in text  # the conditionals are there
    assert "stablehlo.while" not in text


def test_allowed_tokens_follow_llguidances_bit_layout():
    """Token t is bit t % 32 of word t // 32 (bit 31 set makes the word negative as int32); the
    others get -inf, and a row with every bit set is untouched."""
    from model.sampling import apply_allowed

    vocab = 70
    logits = jnp.arange(2 * vocab, dtype=jnp.float32).reshape(2, vocab)
    words = np.zeros((2, 3), np.uint32)
    for t in (0, 31, 33, 69):
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    words[1] = 0xFFFFFFFF
    out = np.asarray(apply_allowed(logits, jnp.asarray(words.view(np.int32))))
    assert [t for t in range(vocab) if np.isfinite(out[0, t])] == [0, 31, 33, 69]
    np.testing.assert_array_equal(out[0, [0, 31, 33, 69]], np.asarray(logits)[0, [0, 31, 33, 69]])
    np.testing.assert_array_equal(out[1], np.asarray(logits)[1])


def test_min_tokens_bans_its_tokens_until_that_many_were_generated():
    """min_tokens: the banned tokens (the engine's stop tokens) get -inf, in the logprobs too,
    while a row has generated fewer than min_tokens tokens; its logit_bias holds throughout, and
    a row without min_tokens is untouched."""
    logits = np.tile(np.asarray([[0.0, 1.0, 2.0, 5.0, 3.0]], np.float32), (2, 1))
    banned = SamplingParams(temperature=0, top_logprobs=2, logit_bias=((1, 10.0),), min_tokens=2,
                            min_tokens_ids=(1, 3))
    plain = SamplingParams(temperature=0, top_logprobs=2)
    for step, want in ((0, 4), (1, 4), (2, 1)):
        tokens, logprob, top_ids, top_lps = _run(logits, [banned, plain], step_index=[step, step])
        assert tokens.tolist() == [want, 3]
        if step < 2:  # (the top 4 of 5 tokens: a banned one last, at -inf)
            assert top_ids[0][:3].tolist() == [4, 2, 0] and np.isneginf(top_lps[0][3])
    arrays = sampling.pack_sampling([banned, plain], 4)
    assert arrays.bias_ids[0].tolist() == [1, 1, 3, -1] and arrays.ban_from.tolist() == [1, 0]
    assert arrays.min_tokens.tolist() == [2, 0] and np.isneginf(arrays.bias_values[0][1:3]).all()
    # seeded draws never take a banned token either
    sampled = SamplingParams(temperature=1.5, seed=3, min_tokens=50, min_tokens_ids=(3,))
    draws = [_run(logits[:1], [sampled], step_index=[i])[0][0] for i in range(40)]
    assert 3 not in draws and len(set(draws)) > 1
    with pytest.raises(ValueError, match="min_tokens bans"):
        sampling.pack_sampling([SamplingParams(logit_bias=((1, 1.0),), min_tokens=1, min_tokens_ids=(2, 3))], 2)


def _dry_reference(tokens: list[int], logits: np.ndarray, p: SamplingParams, breakers: set[int]) -> np.ndarray:
    """llama.cpp's DRY (llama_sampler_dry_apply) over the whole sequence `tokens`, written plainly:
    the longest common suffix in place of its Z-algorithm."""
    out = logits.astype(np.float64).copy()
    window = len(tokens) if p.dry_penalty_last_n < 0 else min(len(tokens), p.dry_penalty_last_n)
    allowed = p.dry_allowed_length
    if p.dry_multiplier == 0 or window <= allowed:
        return out
    recent = tokens[len(tokens) - window:]
    limit = window
    for i in range(window):
        if recent[-1 - i] in breakers:
            limit = i
            break
    if limit < allowed:
        return out
    longest: dict[int, int] = {}
    for j in range(window - 1):
        length = 0
        while length <= j and length < limit and recent[j - length] == recent[-1 - length]:
            length += 1
        if length >= allowed:
            longest[recent[j + 1]] = max(longest.get(recent[j + 1], -1), length)
    most = int(88.7228391 / np.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    for token, length in longest.items():
        if token not in breakers:
            exponent = length - allowed
            exponent = min(exponent, most) if most > 0 else exponent
            out[token] -= p.dry_multiplier * p.dry_base**exponent
    return out


def _history(histories: list[list[int]], size: int = 64, stale: int = 4) -> "sampling.TokenHistory":
    rows = len(histories)
    history = np.full((rows, size), stale, np.int32)  # stale tokens past each row's last (in the vocabulary)
    for r, h in enumerate(histories):
        history[r, :len(h) - 1] = h[:-1]  # the input token comes through `inputs`
    return sampling.TokenHistory(
        history=jnp.asarray(history), rows=jnp.arange(rows, dtype=jnp.int32),
        last=jnp.asarray([len(h) - 1 for h in histories], jnp.int32), inputs=jnp.asarray([h[-1] for h in histories]),
        breakers=jnp.zeros((rows, 1), jnp.int32))


def _dry(histories: list[list[int]], params: list[SamplingParams], breakers: list[set[int]], vocab: int,
         size: int = 96) -> np.ndarray:
    bits = jnp.asarray(np.stack([sampling.token_bits(sorted(b), vocab) for b in breakers]))
    ctx = _history(histories, size, stale=7)._replace(breakers=bits)
    logits = np.random.default_rng(0).normal(size=(len(histories), vocab)).astype(np.float32)
    arrays = sampling.pack_sampling(params, 0)
    return logits, np.asarray(jax.jit(sampling.apply_dry)(jnp.asarray(logits), arrays, ctx))


def test_dry_matches_llama_cpps_rule():
    """Random sequences over a few tokens (many repeats), with breakers, windows, allowed lengths
    and bases, side by side in one batch, against the plain rule above."""
    rng = np.random.default_rng(3)
    vocab = 12
    cases = []
    for i in range(24):
        n = int(rng.integers(2, 90))
        tokens = rng.integers(0, 5 if i % 2 else 3, n).tolist()
        p = SamplingParams(dry_multiplier=float(rng.choice([0.0, 0.8, 1.5])), dry_base=float(rng.choice([1.0, 1.75, 3.0])),
                           dry_allowed_length=int(rng.integers(0, 4)), dry_penalty_last_n=int(rng.choice([-1, 5, 30, 200])))
        breakers = {int(t) for t in rng.choice(np.arange(vocab), int(rng.integers(0, 3)), replace=False)}
        cases.append((tokens, p, breakers))
    logits, got = _dry([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], vocab)
    for r, (tokens, p, breakers) in enumerate(cases):
        want = _dry_reference(tokens, logits[r], p, breakers if p.dry_multiplier else set())
        np.testing.assert_allclose(got[r], want, rtol=1e-5, err_msg=f"case {r}: {tokens} {p} {breakers}")
    assert (got != logits).any(axis=1).sum() >= 8  # most rows were penalised


def test_dry_hand_computed():
    # ... 1 2 3 | 9 | 1 2 3 -> 1 2 3 was followed by 9: a repeat of 3, 9 loses 0.8 * 1.75 ** 1; 2 3 was
    # also followed by 4 at the start (2 3 4): 4 loses 0.8 * 1.75 ** 0; a breaker (5) is never penalised
    tokens = [2, 3, 4, 1, 2, 3, 9, 1, 2, 3]
    p = SamplingParams(dry_multiplier=0.8)
    logits, got = _dry([tokens], [p], [set()], 12)
    delta = logits[0] - got[0]
    assert delta[9] == pytest.approx(0.8 * 1.75) and delta[4] == pytest.approx(0.8)
    assert np.count_nonzero(delta) == 2
    # a breaker in the last tokens limits the repeat: after 5, only "3" (1 token) matches: none
    logits, got = _dry([tokens[:-1] + [5, 3]], [p], [{5}], 12)
    np.testing.assert_array_equal(got, logits)
    # a long repeat's penalty holds at float32's range instead of overflowing
    long = [1, 2] * 60
    logits, got = _dry([long], [SamplingParams(dry_multiplier=1.0, dry_base=100.0)], [set()], 12, size=160)
    assert np.isfinite(got).all() and got[0, 1] < -1e30


def _stateful(logits, params, mu, step_index=None):
    logits = np.asarray(logits, np.float32)
    b, v = logits.shape
    arrays = sampling.pack_sampling(params, 0)
    steps = np.zeros((b,), np.int32) if step_index is None else np.asarray(step_index, np.int32)
    out = jax.jit(sampling.sample_stateful, static_argnames=("num_top",))(
        logits, arrays, np.zeros((b, v), bool), np.zeros((b, v), np.int32), steps, 0, np.asarray(mu, np.float32))
    return np.asarray(out[0]), np.asarray(out[4])


# PROBS' surprises in bits: 1.0, 1.74, 2.74, 4.32
@pytest.mark.parametrize("mu, expected", [(2.0, {0, 1}), (3.0, {0, 1, 2}), (0.5, {0}), (5.0, {0, 1, 2, 3})])
def test_mirostat_2_keeps_the_tokens_within_the_target_surprise(mu, expected):
    n = 512
    params = [SamplingParams(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.1, seed=i, top_k=1) for i in range(n)]
    tokens, new_mu = _stateful(np.tile(np.log(np.asarray(PROBS, np.float32)), (n, 1)), params, [mu] * n)
    assert set(tokens.tolist()) == expected  # (top_k is not applied: mirostat takes the truncations' place)
    kept = np.asarray([PROBS[t] for t in sorted(expected)])
    p = {t: PROBS[t] / kept.sum() for t in expected}
    want = [mu - 0.1 * (-np.log2(p[t]) - 3.0) for t in tokens]
    np.testing.assert_allclose(new_mu, want, rtol=1e-5)


def test_mirostat_1_keeps_the_top_k_its_zipf_estimate_gives():
    vocab = 300
    logits = -1.3 * np.log(np.arange(1, vocab + 1, dtype=np.float64))  # Zipf, exponent 1.3
    logits[150:] -= 2.0  # not quite Zipf past the first 100: the estimate reads the first 100
    for mu in (3.0, 6.0, 9.0):
        ordered = np.sort(logits)[::-1]
        i = np.arange(99)
        t, b = np.log((i + 2) / (i + 1)), ordered[i] - ordered[i + 1]
        s_hat = (t * b).sum() / (t * t).sum()
        e = s_hat - 1
        k = max(int((e * 2**mu / (1 - vocab ** -e)) ** (1 / s_hat)), 1)
        n = 256
        params = [SamplingParams(mirostat=1, temperature=1.0, seed=j) for j in range(n)]
        tokens, _ = _stateful(np.tile(logits, (n, 1)), params, [mu] * n)
        assert tokens.max() < k  # tokens are ranked as their ids
        assert 1 < k < vocab and (k <= 3 or tokens.max() >= k // 3)


def test_mirostat_rows_leave_the_others_alone():
    """A mirostat row beside others: theirs are the draws (and mu) they get without it."""
    logits = np.random.default_rng(5).normal(size=(3, 40)).astype(np.float32) * 2
    others = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0)]
    miro = SamplingParams(mirostat=2, mirostat_tau=4.0, seed=2)
    alone, mu_alone = _stateful(logits[1:], others, [7.0, 7.0], step_index=[3, 3])
    both, mu_both = _stateful(logits, [miro] + others, [8.0, 7.0, 7.0], step_index=[3, 3, 3])
    np.testing.assert_array_equal(both[1:], alone)
    np.testing.assert_array_equal(mu_both[1:], [7.0, 7.0])
    np.testing.assert_array_equal(mu_alone, [7.0, 7.0])
    assert mu_both[0] != 8.0


def test_window_penalties_hand_computed():
    """llama.cpp's penalties over the last n tokens (prompt and output alike; a negative logit
    multiplied), over all of them (-1), beside a row with OpenAI's counts and one with
    penalty_last_n 0 (no penalties), in one call; the stale history past a row's last token is
    a token of the vocabulary (4), never counted."""
    logits = np.tile(np.asarray([[1.0, -1.0, 2.0, 0.5, 0.0, 3.0]], np.float32), (4, 1))
    tokens = [5, 2, 1, 3, 3, 0]  # the last 4: 1, 3, 3, 0
    window = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            penalty_last_n=4, top_logprobs=6)
    whole = dataclasses.replace(window, penalty_last_n=-1)
    openai = dataclasses.replace(window, penalty_last_n=None)
    off = dataclasses.replace(window, penalty_last_n=0)
    arrays = sampling.pack_sampling([window, whole, openai, off], 0)
    prompt_mask = np.zeros((4, 6), bool)
    prompt_mask[:, [5, 2, 1]] = True
    counts = np.zeros((4, 6), np.int32)
    counts[:, 3], counts[:, 0] = 2, 1  # the output: 3, 3, 0
    out = jax.jit(sampling.sample, static_argnames=("num_top",))(
        logits, arrays, prompt_mask, counts, np.zeros((4,), np.int32), 6, history=_history([tokens] * 4))
    # window: 1 once (-1 * 2 - 0.25 - 0.5 = -2.75), 3 twice (0.5 / 2 - 0.5 - 0.5 = -0.75), 0 once
    #         (1 / 2 - 0.25 - 0.5 = -0.25); 5 and 2 are outside
    # whole:  the same, and 5 (3 / 2 - 0.75 = 0.75), 2 (2 / 2 - 0.75 = 0.25)
    # openai: repetition over {5, 2, 1, 3, 0} (prompt or output), presence and frequency over the output
    want = np.array([[-0.25, -2.75, 2.0, -0.75, 0.0, 3.0],
                     [-0.25, -2.75, 0.25, -0.75, 0.0, 0.75],
                     [-0.25, -2.0, 1.0, -0.75, 0.0, 1.5],
                     [1.0, -1.0, 2.0, 0.5, 0.0, 3.0]])
    lp, order = np.asarray(out[3]), np.asarray(out[2])
    for r in range(4):
        np.testing.assert_allclose(lp[r][np.argsort(order[r])], _log_softmax(want[r:r + 1])[0], rtol=1e-5, atol=1e-6)
    assert arrays.penalty_last_n.tolist() == [4, 2**30, 0, 0] and arrays.repetition_penalty.tolist() == [2, 2, 2, 1]
