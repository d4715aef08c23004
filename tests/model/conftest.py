"""The real SmolLM2 model, loaded and compiled once per test run for the model tests."""

from __future__ import annotations

import pytest

from model.config import EngineConfig
from model.loader import load_model

# Small enough to compile quickly on 2 cores, long enough for the >2,000-token fixture prompts.
SMOL_ENGINE = EngineConfig(num_slots=8, max_context=4096, context_buckets=(1024, 4096), prefill_chunks=(64, 512))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return load_model(smollm2_path, SMOL_ENGINE)


@pytest.fixture(scope="session")
def smol_runner(smollm2):
    runner = smollm2.make_runner(SMOL_ENGINE)
    runner.warmup()
    return runner
