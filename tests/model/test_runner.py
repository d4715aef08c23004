"""The runner on the real SmolLM2: batch invariance, seeded sampling under concurrency,
nothing compiled after warm-up."""

from __future__ import annotations

import jax
import pytest

from model.offline import generate
from model.step_types import SamplingParams

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


def test_nothing_compiles_after_warmup(smol_runner, prompt_ids):
    compiles = []

    def listener(event: str, duration: float, **_) -> None:
        if "compile" in event:
            compiles.append(event)

    generate(smol_runner, prompt_ids[:2], 2)  # any lazy host-side setup happens here
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        long_prompt = prompt_ids[7] * 80  # > 1024 tokens: several chunks, the larger bucket
        generate(smol_runner, [long_prompt] + prompt_ids[1:4], 3,
                 sampling=SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.1, logit_bias=((5, 2.0),)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
