"""An `EngineSpec.builder` for tests/scheduler/test_engine_process.py: in the engine process, an
`Engine` over conftest's `FakeModel` and byte tokenizer. `model_path` is a JSON object of
FakeModel keyword arguments, plus "load_error": a message the model factory raises with,
"build_error": one this builder raises with, "load_s": seconds the builder takes."""

from __future__ import annotations

import json
import time

from model.config import EngineConfig
from scheduler.engine import Engine
from tests.scheduler.conftest import ByteDetokenizer, ByteTokenizer, FakeModel


def build(model_path: str, engine_config: EngineConfig) -> Engine:
    options = json.loads(model_path)
    load_error = options.pop("load_error", None)
    time.sleep(options.pop("load_s", 0))
    if "build_error" in options:
        raise ValueError(options["build_error"])
    model = FakeModel(num_slots=engine_config.num_slots, max_context=engine_config.max_context,
                      prefill_chunks=engine_config.prefill_chunks, **options)

    def factory() -> FakeModel:
        if load_error is not None:
            raise OSError(load_error)
        return model

    return Engine(factory, ByteTokenizer(), engine_config, model_name="fake", info={"kernels": {"attention": "fake"}},
                  detokenizer_factory=ByteDetokenizer)
