"""Loads a GGUF file into everything the engine needs: config, device weights, tokenizer,
chat template and the chosen kernels. Logs load time and memory."""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time

import jax
from jax.sharding import Mesh

from model import sharding
from model.config import EngineConfig, ModelConfig
from model.forward import Kernels
from model.gguf_file import GGUFFile, GGUFLoadError
from model.runner import ModelRunner
from model.tokenizer import Tokenizer
from model.weights import Params, load_params, params_nbytes
from model.kernels import choose_kernels
from pallas_kernels import registry

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    kernels: Kernels
    kernel_names: dict[str, str]
    load_seconds: float
    mesh: Mesh | None = None  # tensor parallel > 1: the mesh the params are split over
    splits: frozenset[str] = frozenset()  # the formats split at load (`split_formats`)

    def make_runner(self, engine_cfg: EngineConfig) -> ModelRunner:
        return ModelRunner(self.config, self.params, self.kernels, engine_cfg, mesh=self.mesh)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def split_formats(engine_cfg: EngineConfig, mosaic_available: bool | None = None) -> frozenset[str]:
    """The GGML formats split at load ("q4_k", "q5_k", "q6_k", and "q4_1", "q5_0", "q5_1" with
    split_legacy): EngineConfig.split_q4_k, split_q5_k, split_q6_k and split_legacy
    resolved. "on" and "off" say; "auto" splits where the Mosaic GPU matmul will serve the split
    matrices (`mosaic_available`: by default, whether that implementation is available here, i.e.
    on a Hopper GPU): one device (a tensor-parallel shard of a row-parallel matrix may not fit
    its K steps) and neither the decode nor the prefill matmul forced to another implementation
    (no other GPU kernel serves Q6_K's split)."""
    forced = dict(engine_cfg.kernels)
    decode, prefill = forced.get("matmul_decode", forced.get("matmul")), forced.get("matmul")
    auto = engine_cfg.tensor_parallel == 1 and decode in (None, "mosaic_gpu") and prefill in (None, "mosaic_gpu")
    if auto and mosaic_available is None:
        mosaic_available = any(impl.name == "mosaic_gpu" and impl.is_available()
                               for impl in registry.implementations("matmul"))
    auto = auto and bool(mosaic_available)
    settings = {"q4_k": engine_cfg.split_q4_k, "q5_k": engine_cfg.split_q5_k, "q6_k": engine_cfg.split_q6_k,
                "q4_1": engine_cfg.split_legacy, "q5_0": engine_cfg.split_legacy, "q5_1": engine_cfg.split_legacy}
    return frozenset(fmt for fmt, s in settings.items() if s == "on" or (s == "auto" and auto))


def load_model(path: str | os.PathLike[str], engine_cfg: EngineConfig) -> LoadedModel:
    t0 = time.perf_counter()
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gf.metadata)
    except ValueError as e:
        raise GGUFLoadError(f"{gf.path}: cannot build the tokenizer: {e}") from e
    forced, mesh = dict(engine_cfg.kernels), None
    splits = split_formats(engine_cfg)
    if engine_cfg.tensor_parallel == 1:
        params = load_params(gf, cfg, splits=splits)
    else:
        sharding.check_divisible(cfg, engine_cfg.tensor_parallel)
        mesh = sharding.make_mesh(engine_cfg.tensor_parallel)
        # Each tensor goes straight to its shards as it is read: a model split for being too
        # large for one device never lands whole on one device, nor in host memory.
        params = load_params(gf, cfg, fuse=False, place=sharding.placer(mesh), splits=splits)
    kernels, kernel_names = choose_kernels(forced, cfg, params, engine_cfg)
    if splits and jax.default_backend() != "cpu":
        slow = sorted(op for op, impl in kernel_names.items() if "_split" in op and impl == "reference")
        if slow:  # the splits are for the GPU kernels: none of them took these shapes
            log.warning("split formats: %s run the XLA reference on this %s", ", ".join(slow), jax.default_backend())
    if mesh is not None:  # each op runs per device on its shard
        kernels = sharding.shard_kernels(kernels, mesh)
    seconds = time.perf_counter() - t0
    log.info(
        "loaded %s (%s, %d layers, E=%d, vocab %d) in %.2f s: %.1f MiB of weights on device, peak RSS %.0f MiB",
        gf.name, cfg.arch, cfg.num_layers, cfg.embed_dim, cfg.vocab_size, seconds,
        params_nbytes(params) / 2**20, _rss_mib(),
    )
    log.info("kernels: %s", ", ".join(f"{k}={v}" for k, v in kernel_names.items()))
    return LoadedModel(
        name=gf.name, path=str(gf.path), config=cfg, params=params, tokenizer=tokenizer,
        kernels=kernels, kernel_names=kernel_names, load_seconds=seconds, mesh=mesh, splits=splits,
    )
