"""Builds the real engine from a GGUF path: loads the model (weights to the device, tokenizer,
kernels) and hands the engine a factory for the runner; once started, the engine thread builds
the runner and compiles every step program before it reports ready."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pathlib

import jax

from model.config import EngineConfig
from model.loader import load_model
from model.gated_ffn import labels as gated_labels
from model.ordered_values import labels as ordered_labels
from scheduler.engine import Engine
from scheduler.gc_pauses import freeze_heap

log = logging.getLogger(__name__)


def fit_engine_config(engine_config: EngineConfig, model_context: int) -> EngineConfig:
    """Caps the per-slot context at the model's trained context."""
    if engine_config.max_context <= model_context:
        return engine_config
    log.info("max context %d capped at the model's %d", engine_config.max_context, model_context)
    return dataclasses.replace(engine_config, max_context=model_context)


def resolve_kv_dtype(engine_config: EngineConfig) -> EngineConfig:
    if engine_config.kv_dtype != "auto":
        return engine_config
    if engine_config.numerics == "ggml" or (engine_config.numerics == "auto" and jax.default_backend() == "cpu"):
        kv = "float16"  # llama.cpp's (auto: also where the model then runs native)
    else:
        kv = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return dataclasses.replace(engine_config, kv_dtype=kv)


def load_resolved(model_path: str | os.PathLike[str], engine_config: EngineConfig):
    """The loaded model and the engine config resolved for it (KV dtype, context cap): the same
    on every process of a multi-process job, and what bench/trace_step.py builds its programs of."""
    engine_config = resolve_kv_dtype(engine_config)
    loaded = load_model(model_path, engine_config)
    return loaded, fit_engine_config(engine_config, loaded.config.context_length)


def build_engine(
    model_path: str | os.PathLike[str],
    engine_config: EngineConfig,
    chat_template_path: pathlib.Path | None = None,  # rendered by the server; accepted for the seam
) -> Engine:
    del chat_template_path
    loaded, engine_config = load_resolved(model_path, engine_config)
    info = {
        "model_path": loaded.path,
        "arch": loaded.config.arch,
        # embeddings: their length, and the GGUF's pooling (None: unset; the server's default)
        "embedding_length": loaded.config.embed_dim,
        "pooling": loaded.config.pooling,
        "kernels": dict(loaded.kernel_names),
        "split_formats": sorted(loaded.splits),
        # the output projections whose values are stored in the order they read x in
        # (model/ordered_values.py): /health shows whether that layout took effect
        "ordered_values": ordered_labels(loaded.kernels.ordered_values),
        # the gate/up matrices whose matmul makes the gated activation (model/gated_ffn.py)
        "gated_ffn": gated_labels(loaded.kernels.gated_ffn),
        "load_seconds": round(loaded.load_seconds, 2),
        "kv_dtype": engine_config.kv_dtype,
        "backend": jax.default_backend(),
        "numerics": loaded.kernels.numerics,  # auto resolved
    }
    if loaded.kernels.numerics == "ggml":
        info["ggml_threads"] = engine_config.ggml_threads
    def factory():
        runner = loaded.make_runner(engine_config)
        if jax.process_count() == 1:
            return runner
        from model.multihost import LeaderRunner  # process 0 of several: the others follow its plans

        return LeaderRunner(runner)

    engine = Engine(
        factory,
        loaded.tokenizer,
        engine_config,
        model_name=loaded.name,
        info=info,
    )
    return engine  # the caller starts it (server/__main__.py: start, wait_ready, info)


def run_follower(model_path: str | os.PathLike[str], engine_config: EngineConfig) -> int:
    """A process other than 0 after `jax.distributed.initialize`: loads the same model with the
    same config as process 0, compiles the same programs and runs process 0's step plans until
    its engine stops (model/multihost.py). Returns the number of steps run."""
    from model.multihost import follow

    loaded, engine_config = load_resolved(model_path, engine_config)
    try:
        return follow(loaded.make_runner(engine_config), after_warmup=freeze_heap if engine_config.gc_freeze else None)
    finally:
        if engine_config.gc_freeze:
            gc.unfreeze()
