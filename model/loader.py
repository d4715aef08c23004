"""Loads a GGUF file into everything the engine needs: config, device weights, tokenizer,
chat template and the chosen kernels. Logs load time and memory."""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time

import jax
import numpy as np
from jax.sharding import Mesh

from model import sharding
from model.config import EngineConfig, ModelConfig
from model.forward import Kernels, KVCache
from model.gguf_file import GGUFFile, GGUFLoadError
from model.runner import ModelRunner
from model.tokenizer import Tokenizer
from model.weights import Q6_K_SPLIT6, SPLITS, Params, is_split, load_params, params_nbytes, split_key
from model.kernels import choose_kernels
from model.gated_ffn import interleave_gate_up, labels as gated_labels
from model.ordered_values import labels as ordered_labels, order_values
from pallas_kernels import quant, registry

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


def split_formats(engine_cfg: EngineConfig, mosaic_available: bool | None = None,
                  jax_triton_available: bool | None = None) -> frozenset[str]:
    """The GGML formats split at load ("q4_k", "q5_k", "q6_k", and "q4_1", "q5_0", "q5_1" with
    split_legacy): EngineConfig.split_q4_k, split_q5_k, split_q6_k and split_legacy
    resolved. "on" and "off" say; "auto" splits where the Mosaic GPU matmul will serve the split
    matrices (`mosaic_available`: by default, whether that implementation is available here, i.e.
    on a Hopper GPU) or the jax-triton one, forced, will (it takes every split form;
    `jax_triton_available` likewise): one device (a tensor-parallel shard of a row-parallel
    matrix may not fit its K steps) and neither the decode nor the prefill matmul forced to
    another implementation (the Pallas Triton kernels take no Q6_K split)."""
    chosen = _forced_matmuls(engine_cfg)
    auto = engine_cfg.tensor_parallel == 1 and chosen <= {None, "mosaic_gpu", "jax_triton"}
    if auto and chosen & {None, "mosaic_gpu"}:  # the Mosaic kernel serves decode or prefill
        if mosaic_available is None:
            mosaic_available = _available("mosaic_gpu")
        auto = bool(mosaic_available)
    if auto and "jax_triton" in chosen:  # forced where it cannot run: the kernel choice will say so
        auto = _available("jax_triton") if jax_triton_available is None else jax_triton_available
    return frozenset(fmt for fmt, s in _split_settings(engine_cfg).items() if s == "on" or (s == "auto" and auto))


def _available(impl_name: str) -> bool:
    return any(impl.name == impl_name and impl.is_available() for impl in registry.implementations("matmul"))


def _split_settings(engine_cfg: EngineConfig) -> dict[str, str]:
    legacy = engine_cfg.split_legacy
    return {"q4_k": engine_cfg.split_q4_k, "q5_k": engine_cfg.split_q5_k,
            _q6_k_split(engine_cfg): engine_cfg.split_q6_k, "q4_1": legacy, "q5_0": legacy, "q5_1": legacy}


def _q6_k_split(engine_cfg: EngineConfig) -> str:
    """The Q6_K split's `SPLITS` key: the 6-bit one ("q6_k_split6", for the Mosaic GPU matmul and
    the reference) with EngineConfig.q6_k_split_bits 6, unless the jax-triton matmul is forced (it
    takes the 8-bit one only); else the 8-bit one."""
    jax_triton = "jax_triton" in _forced_matmuls(engine_cfg)
    return Q6_K_SPLIT6 if engine_cfg.q6_k_split_bits == 6 and not jax_triton else "q6_k"


def _forced_matmuls(engine_cfg: EngineConfig) -> set[str | None]:
    """The implementations `--kernels` forces on the decode and prefill matmuls (None: not forced)."""
    forced = dict(engine_cfg.kernels)
    return {forced.get("matmul_decode", forced.get("matmul")), forced.get("matmul")}


# Of a device's memory, the share the weights (as placed) and the KV cache may take for the "auto"
# splits to stay on: the rest is left to activations, the compiled programs and XLA's buffers.
SPLIT_MEMORY_SHARE = 0.85


def tensor_bytes(gf: GGUFFile, name: str, splits: frozenset[str]) -> int:
    """Device bytes of tensor `name` as `load_params` places it with `splits` (a vector as f32;
    the token embedding split only where it is also the output)."""
    info = gf.tensors[name]
    if len(info.shape) != 2:
        return int(np.prod(info.shape)) * 4
    fmt = quant.format_for(info.ggml_type)
    n, k = (int(d) for d in info.shape)
    untied_embed = name == "token_embd.weight" and "output.weight" in gf.tensors
    if not untied_embed and is_split(fmt.name, n, k, splits):
        fmt = quant.format_for(SPLITS[split_key(fmt.name, splits)][0])
    dtypes = fmt.plane_dtypes()
    return sum(int(np.prod(s)) * dtypes[p].itemsize for p, s in fmt.plane_shapes(n, k).items())


def weight_bytes(gf: GGUFFile, splits: frozenset[str]) -> int:
    """Device bytes of the model's weights as `load_params` places them with `splits`."""
    return sum(tensor_bytes(gf, name, splits) for name in gf.tensors)


def kv_cache_bytes(cfg: ModelConfig, engine_cfg: EngineConfig) -> int:
    """The KV cache's bytes (keys and values, the context capped at the model's); 2 bytes per
    value for a dtype still "auto" (a GPU's bf16)."""
    itemsize = 2 if engine_cfg.kv_dtype == "auto" else np.dtype(jax.numpy.dtype(engine_cfg.kv_dtype)).itemsize
    context = min(engine_cfg.max_context, cfg.context_length or engine_cfg.max_context)
    return 2 * int(np.prod(KVCache.shape(cfg, engine_cfg.num_slots, context))) * itemsize


def splits_that_fit(gf: GGUFFile, splits: frozenset[str], optional: frozenset[str], budget: int | None
                    ) -> frozenset[str]:
    """`splits` less those of `optional` (the "auto" ones) whose extra bytes would take the
    weights past `budget` (None: no limit known), the costliest dropped first, each with a
    warning; the splits asked for with "on" are kept whatever they cost. A matrix has one
    format, so each split's extra bytes add up independently."""
    chosen = set(splits)
    if budget is None:
        return frozenset(chosen)
    total = weight_bytes(gf, frozenset(chosen))
    base = weight_bytes(gf, frozenset())
    extra = {f: weight_bytes(gf, frozenset({f})) - base for f in chosen & optional}
    for fmt in sorted(extra, key=lambda f: (-extra[f], f)):
        if total <= budget:
            break
        chosen.remove(fmt)
        total -= extra[fmt]
        log.warning("not splitting %s matrices (auto): they would add %.2f GiB and the weights would not fit "
                    "%.2f GiB of this device's memory beside the KV cache", fmt, extra[fmt] / 2**30, budget / 2**30)
    return frozenset(chosen)


def _split_budget(cfg: ModelConfig, engine_cfg: EngineConfig) -> int | None:
    """The bytes the weights may take on the one device (`SPLIT_MEMORY_SHARE` of its memory less
    the KV cache); None where the device reports no limit (the CPU)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    return None if not limit else int(SPLIT_MEMORY_SHARE * limit) - kv_cache_bytes(cfg, engine_cfg)


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
    if splits and engine_cfg.tensor_parallel == 1:  # "auto" splits only where the weights still fit
        on = {fmt for fmt, s in _split_settings(engine_cfg).items() if s == "on"}
        splits = splits_that_fit(gf, splits, splits - on, _split_budget(cfg, engine_cfg))
    if engine_cfg.tensor_parallel == 1:
        params = load_params(gf, cfg, splits=splits)
    else:
        sharding.check_divisible(cfg, engine_cfg.tensor_parallel)
        mesh = sharding.make_mesh(engine_cfg.tensor_parallel)
        # Each tensor goes straight to its shards as it is read: a model split for being too
        # large for one device never lands whole on one device, nor in host memory.
        params = load_params(gf, cfg, fuse=False, place=sharding.placer(mesh), splits=splits)
    kernels, kernel_names = choose_kernels(forced, cfg, params, engine_cfg)
    if mesh is None and engine_cfg.ordered_values:
        params, kernels = order_values(cfg, params, kernels)
        if kernels.ordered_values:
            log.info("values stored in the order of the output projections %s read x in",
                     ", ".join(ordered_labels(kernels.ordered_values)))
    if mesh is None and engine_cfg.gated_ffn:
        params, kernels = interleave_gate_up(cfg, params, kernels)
        if kernels.gated_ffn:
            log.info("gate/up rows interleaved for the gated activation in the matmul of %s",
                     ", ".join(gated_labels(kernels.gated_ffn)))
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
