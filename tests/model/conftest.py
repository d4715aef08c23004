"""The real SmolLM2 model, loaded and compiled once per test run for the model tests; and a
check that nothing compiles (`no_compiles`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import pathlib
import subprocess
import sys
import tempfile
from typing import Iterator

import jax
import pytest

from model.config import EngineConfig
from model.loader import load_model

# Small enough to compile quickly on 2 cores, long enough for the >2,000-token fixture prompts.
SMOL_ENGINE = EngineConfig(num_slots=8, max_context=4096, context_buckets=(1024, 4096), prefill_chunks=(64, 512))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    return load_model(smollm2_path, SMOL_ENGINE)


MAKE_GGUF = pathlib.Path(__file__).resolve().parents[2] / "bench" / "make_synthetic_gguf.py"


@pytest.fixture(scope="session")
def synthetic_gguf(tmp_path_factory):
    """synthetic_gguf(shape, quant, layers=None) -> the path of bench/make_synthetic_gguf.py's
    file (run as a script: nothing imports bench/), each written once per test run."""
    files: dict[tuple, pathlib.Path] = {}

    def write(shape: str, quant: str, layers: int | None = None) -> pathlib.Path:
        key = (shape, quant, layers)
        if key not in files:
            out = tmp_path_factory.mktemp("synthetic") / f"{shape}-{quant}-{layers or 'all'}.gguf"
            cmd = [sys.executable, str(MAKE_GGUF), "--shape", shape, "--quant", quant, "--out", str(out)]
            subprocess.run(cmd + (["--layers", str(layers)] if layers else []), check=True, capture_output=True,
                           text=True, timeout=300)
            files[key] = out
        return files[key]

    return write


@contextlib.contextmanager
def compiling_alone(*key: object) -> Iterator[None]:
    """Holds a lock named by `key` across the test run's pytest-xdist workers: a worker that
    warms up the same programs as another (the same model and engine config) waits for it, then
    reads them from the run's shared compilation cache (tests/conftest.py) rather than compiling
    them at the same time on the other core."""
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    locks = pathlib.Path(jax.config.jax_compilation_cache_dir or tempfile.gettempdir())
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"warmup-{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(scope="session")
def smol_runner(smollm2, smollm2_path):
    runner = smollm2.make_runner(SMOL_ENGINE)
    with compiling_alone(smollm2_path, SMOL_ENGINE):  # test_runner, test_speculative, test_embeddings_agreement
        runner.warmup()
    return runner


@contextlib.contextmanager
def compiles_seen() -> Iterator[list[str]]:
    """The JAX compile events (their names) inside, as a list the block can read after."""
    compiles: list[str] = []

    def listener(event: str, duration: float, **_) -> None:
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def no_compiles() -> Iterator[None]:
    """Fails if JAX compiles anything inside."""
    with compiles_seen() as compiles:
        yield
    assert compiles == []
