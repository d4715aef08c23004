"""Chooses the kernel for each op once at start-up and binds them into the `Kernels` the forward
pass is compiled with.

The choice follows the registry's order (GPU kernels first where the backend has them) or a
forced `--kernels op=impl,...`. Matmul is chosen per weight format: each implementation is
probed (traced, nothing compiled) on this model's own shapes, separately for decode (x of up to
`num_slots` rows) and prefill chunks, and one that refuses a format
with `NotImplementedError` is passed over for that format only; where no implementation takes
every shape of a format, each shape gets its own (`matmul_decode[q4_0 4096x5504]: triton`
beside `matmul_decode[q4_0 6144x4096]: mosaic_gpu`). Every choice is logged and
shown on /health (e.g. `matmul_decode[q4_0]: mosaic_gpu`, `matmul[q4_0]: mosaic_gpu` for prefill,
`matmul[q6_k]: triton`; `--kernels matmul_decode=...` forces the decode one alone); a chosen kernel
that fails at run time raises, it never falls back. With `EngineConfig.reuse_kernel_lowering`
the Mosaic GPU matmuls are lowered once for all the step programs (`LoweredOnce`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

# Importing the kernel modules registers their implementations.
import pallas_kernels.attention  # noqa: F401
import pallas_kernels.ggml_cpu as ggml_cpu
import pallas_kernels.attention_triton  # noqa: F401
import pallas_kernels.attention_triton_prefill  # noqa: F401
import pallas_kernels.matmul  # noqa: F401
import pallas_kernels.matmul_jax_triton  # noqa: F401
import pallas_kernels.matmul_mgpu  # noqa: F401
import pallas_kernels.matmul_triton  # noqa: F401
from model.config import EngineConfig, ModelConfig
from model import sharding
from model.forward import Kernels
from model.weights import LayerGroup, Params
from pallas_kernels import gated as gated_ops, lowering_cache, registry
from pallas_kernels.quant import QuantizedTensor

log = logging.getLogger(__name__)

# "matmul_decode" forces only the decode regime's matmul; "matmul" forces prefill, and decode too
# unless "matmul_decode" is given.
OPS = ("matmul", "matmul_decode", "embed", "attention_decode", "attention_prefill")


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _matrices(params: Params) -> dict[tuple[str, int, int], tuple[QuantizedTensor, set[str]]]:
    """One example per distinct (format, N, K) among the model's matrices, unstacked, with how
    tensor parallelism splits the matrices of that shape ("column" or "row", as
    model/sharding.py places them)."""
    found: dict[tuple[str, int, int], tuple[QuantizedTensor, set[str]]] = {}

    def visit(node: Any, split: str) -> None:
        if isinstance(node, QuantizedTensor):
            key = (node.fmt, *node.shape)
            if key not in found:
                stack = len(node.stack_shape)
                planes = {k: jax.ShapeDtypeStruct(v.shape[stack:], v.dtype) for k, v in node.planes.items()}
                found[key] = (QuantizedTensor(planes, node.fmt, node.shape), set())
            found[key][1].add(split)

    for entry in [params.layers] if isinstance(params.layers, dict) else params.layers:
        for layer in entry.phases if isinstance(entry, LayerGroup) else [entry]:
            for name, value in layer.items():
                visit(value, "row" if name in sharding.ROW_SPLIT else "column")
    visit(params.embed, "column")  # vocab-parallel
    if params.output is not None:
        visit(params.output, "column")
    return found


def _choose(op: str, forced: str | None, probes: list[tuple]) -> tuple[Any, str]:
    """The first implementation (or the forced one) that takes every probe."""
    fn = registry.choose(op, forced, probes=probes)
    return fn, registry.describe()[op]


def _shard_shapes(w: QuantizedTensor, splits: set[str], tp: int) -> list[QuantizedTensor]:
    """The per-device matrices a [N, K] weight becomes under tensor parallelism `tp`: its column
    split [N/tp, K] and/or its row split [N, K/tp] (each plane's N or packed X axis divides);
    model/sharding.py refuses a model whose matrices do not divide."""
    if tp == 1:
        return [w]
    n, k = w.shape
    fmt = w.format

    def split(axis_of, shape) -> QuantizedTensor | None:
        planes = {}
        for name, p in w.planes.items():
            dims = list(p.shape)
            axis = len(dims) + axis_of(name)
            if dims[axis] % tp:
                return None
            dims[axis] //= tp
            planes[name] = jax.ShapeDtypeStruct(tuple(dims), p.dtype)
        return QuantizedTensor(planes, w.fmt, shape)

    out = []
    if "column" in splits and n % tp == 0:
        out.append(split(fmt.n_axis, (n // tp, k)))
    if "row" in splits and k % tp == 0 and (row := split(fmt.x_axis, (n, k // tp))) is not None:
        out.append(row)
    return out


def _choose_matmuls(op: str, fmt: str, shapes: list[QuantizedTensor], rows: list[int], act_dtype, forced: str | None,
                    fns: dict, names: dict[str, str], wrap: Callable[[Any, str], Any] = lambda fn, name: fn) -> None:
    """The matmul of one format and regime: the first implementation that takes every shape,
    `{op}[{fmt}]`. Where none does, each shape (N, K) gets the first that takes it, named
    `{op}[{fmt} NxK]`: under tensor parallelism a shard can leave one kernel's tiling (the Mosaic
    decode kernel and a row-parallel 4096x5504 w_down shard of a 7B) and only that shard should
    lose it. Forced, one implementation must take them all. `wrap(fn, impl name)` is what the
    chosen function is called through."""
    def probes(ws):
        return [(jax.ShapeDtypeStruct((m, w.shape[1]), act_dtype), w) for w in ws for m in rows]

    unique = list({w.shape: w for w in shapes}.values())
    if forced is not None:
        fn, names[f"{op}[{fmt}]"] = _choose("matmul", forced, probes(unique))
        fns[fmt] = wrap(fn, names[f"{op}[{fmt}]"])
        return
    # Each shape's first taker; when they agree, no implementation before it takes every shape.
    per_shape = [_choose("matmul", None, probes([w])) for w in unique]
    if len({name for _, name in per_shape}) == 1:
        fn, names[f"{op}[{fmt}]"] = per_shape[0]
        fns[fmt] = wrap(fn, names[f"{op}[{fmt}]"])
        return
    for w, (fn, name) in zip(unique, per_shape):
        n, k = w.shape
        fns[(fmt, n, k)], names[f"{op}[{fmt} {n}x{k}]"] = wrap(fn, name), name


def choose_kernels(
    forced: Mapping[str, str], cfg: ModelConfig, params: Params, engine_cfg: EngineConfig
) -> tuple[Kernels, dict[str, str]]:
    """Under tensor parallelism (engine_cfg.tensor_parallel > 1) every implementation is probed on
    the per-device shapes it will see inside `model.sharding.shard_kernels`."""
    if engine_cfg.numerics in ("ggml", "auto"):
        why = ggml_refusal(forced, cfg, params, engine_cfg)
        if why is None:
            return _ggml_kernels(cfg, engine_cfg)
        if engine_cfg.numerics == "ggml":
            raise ValueError(f"--numerics ggml: {why}")
        log.info("numerics auto: native, since llama.cpp's arithmetic is not reproduced here (%s)", why)
    tp = engine_cfg.tensor_parallel
    unknown = sorted(set(forced) - set(OPS))
    if unknown:
        raise ValueError(f"--kernels names unknown ops {unknown}; ops are {list(OPS)}")
    names: dict[str, str] = {}
    f32 = jnp.float32
    # On a GPU the kernels take bf16 activations (tensor cores; f32 x costs a 3-pass split);
    # on the CPU the reference keeps f32. Matmuls are probed with the dtype they will get.
    act_dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16

    # Per weight format, one implementation for decode (x of up to num_slots rows: bandwidth-bound)
    # and one for prefill chunks (compute-bound, every chunk size above num_slots), each taking
    # every matrix shape of that format. A chunk of at most num_slots rows runs the decode one.
    decode_rows = engine_cfg.num_slots
    prefill_rows = [c for c in engine_cfg.prefill_chunks if c > decode_rows] or [decode_rows]
    mats: dict[str, list[QuantizedTensor]] = {}
    for (fmt, _, _), (w, splits) in sorted(_matrices(params).items()):
        mats.setdefault(fmt, []).extend(_shard_shapes(w, splits, tp))
    # Keyed by format, or by (format, N, K) for a shape whose choice differs from its format's.
    decode_fns: dict[Any, Any] = {}
    prefill_fns: dict[Any, Any] = {}
    wrap = _lowering_reuse(engine_cfg)
    for fmt, ws in mats.items():
        for op, fns, rows, force in (
            ("matmul_decode", decode_fns, [decode_rows], forced.get("matmul_decode", forced.get("matmul"))),
            ("matmul", prefill_fns, prefill_rows, forced.get("matmul")),
        ):
            _choose_matmuls(op, fmt, ws, rows, act_dtype, force, fns, names, wrap)

    embed_w = _matrices(Params(params.embed, None, params.output_norm, None, [], False))
    embed_fn, names["embed"] = _choose(
        "embed", forced.get("embed"), [(w, jax.ShapeDtypeStruct((8,), jnp.int32)) for w, _ in embed_w.values()]
    )

    kv = jnp.dtype(engine_cfg.kv_dtype)
    b, h, kh, d, s = engine_cfg.num_slots, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, engine_cfg.attention_buckets[0]
    if cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0:  # else sharding.check_divisible refuses the model
        h, kh = h // tp, kh // tp
    window = cfg.sliding_window
    dec_fn, names["attention_decode"] = _choose("attention_decode", forced.get("attention_decode"), [(
        jax.ShapeDtypeStruct((b, h, d), f32), jax.ShapeDtypeStruct((b, s, kh, d), kv),
        jax.ShapeDtypeStruct((b, s, kh, d), kv), jax.ShapeDtypeStruct((b,), jnp.int32), cfg.scale, window,
    )])
    few_rows_limit = _few_rows_limit(dec_fn if engine_cfg.few_rows_attention else None, b, kh, h // kh, d,
                                     kv.itemsize, engine_cfg.attention_buckets)
    t = engine_cfg.prefill_chunks[-1]
    pre_fn, names["attention_prefill"] = _choose("attention_prefill", forced.get("attention_prefill"), [(
        jax.ShapeDtypeStruct((t, h, d), f32), jax.ShapeDtypeStruct((max(s, t), kh, d), kv),
        jax.ShapeDtypeStruct((max(s, t), kh, d), kv), jax.ShapeDtypeStruct((), jnp.int32), cfg.scale, window,
    )])

    def chosen(w: QuantizedTensor, rows: int):
        fns = decode_fns if rows <= decode_rows else prefill_fns
        fn = fns.get((w.fmt, *w.shape)) or fns.get(w.fmt)
        if fn is None:
            raise KeyError(f"no matmul was chosen for a {w.fmt} matrix {list(w.shape)}: not a shape of this model")
        return fn

    def matmul(x: jax.Array, w: QuantizedTensor, layer=None, split: str | None = None,
               elementwise_x: bool = False, x_in_order: bool = False, gated: str | None = None) -> jax.Array:
        del split  # one device: nothing is split (model/sharding.py wraps this for tensor parallelism)
        fn = chosen(w, math.prod(x.shape[:-1]))
        if x_in_order:  # x comes in the order the implementation reads (x_order below)
            options = {"x_in_order": True}
        else:
            # x made by elementwise ops: an implementation that permutes x does it as a gather,
            # which XLA fuses into them (pallas_kernels/matmul_mgpu.py, `gather_x`)
            gathers = elementwise_x and engine_cfg.gather_x and getattr(fn, "takes_gather_x", False)
            options = {"gather_x": True} if gathers else {}
        if gated is not None and not hasattr(fn, "takes_gated"):  # no epilogue: the product after the call
            return gated_ops.from_interleaved(fn(x.astype(act_dtype), w, layer=layer, **options), gated)
        if gated is not None:
            options["gated"] = gated
        return fn(x.astype(act_dtype), w, layer=layer, **options)

    def takes_gated(w: QuantizedTensor, act: str) -> bool:
        """Whether the decode matmul for w makes act(gate) * up itself at no cost (its `takes_gated`)."""
        check = getattr(chosen(w, decode_rows), "takes_gated", None)
        return check is not None and check(w, decode_rows, act)

    def x_order(w: QuantizedTensor) -> np.ndarray | None:
        """The column order in which the implementation for w reads x at every row count the
        engine runs (decode's and each prompt chunk's: its `x_order(w, rows)`); None where one
        reads x as it is or they differ."""
        orders = []
        for rows in sorted({decode_rows, *engine_cfg.prefill_chunks}):  # a chunk of <= decode_rows: decode's
            order_of = getattr(chosen(w, rows), "x_order", None)
            orders.append(None if order_of is None else order_of(w, rows))
        if orders[0] is None or any(o is None or not np.array_equal(o, orders[0]) for o in orders[1:]):
            return None
        return orders[0]

    takes_dtype = getattr(dec_fn, "takes_out_dtype", False) and act_dtype != f32
    return Kernels(matmul=matmul, embed=embed_fn, attention_decode=dec_fn, attention_prefill=pre_fn,
                   decode_few_rows_limit=few_rows_limit,
                   decode_writes_cache=bool(getattr(dec_fn, "writes_cache", False)) and not engine_cfg.separate_kv_write,
                   decode_takes_slots=bool(getattr(dec_fn, "takes_slots", False)),
                   decode_write_rows=getattr(dec_fn, "write_rows", None),
                   x_order=x_order, attention_out_dtype=act_dtype if takes_dtype else None,
                   takes_gated=takes_gated), names


def ggml_refusal(forced: Mapping[str, str], cfg: ModelConfig, params: Params, engine_cfg: EngineConfig
                 ) -> str | None:
    """Why `--numerics ggml` cannot run this model with these settings (None: it can): it runs
    only what pallas_kernels/ggml_cpu.py reproduces of llama.cpp's x86-64 CPU build."""
    if forced:
        return f"it chooses every kernel itself (--kernels {dict(forced)} given)"
    if jax.default_backend() != "cpu":
        return f"it is a CPU path (the backend is {jax.default_backend()})"
    if engine_cfg.kv_dtype != "float16":
        return f"llama.cpp's cache is f16 (--kv-dtype {engine_cfg.kv_dtype})"
    if engine_cfg.tensor_parallel != 1:
        return "it runs on one device"
    if cfg.rope_scaling.kind != "none" or params.rope_freqs is not None:
        return "RoPE scaling and frequency factors are not reproduced"
    if cfg.sliding_window or cfg.activation != "silu" or cfg.embed_scale != 1.0 or cfg.final_logit_softcap:
        return f"the {cfg.arch} arch's sliding window, GELU, embedding scale or logit softcap are not reproduced"
    allowed = {"q4_1"}  # Q4_0 runs repacked (other sums) and Q8_0 by llamafile's GEMM in prompts
    for (fmt, n, k), _ in _matrices(params).items():
        head = (n == cfg.vocab_size)
        if fmt not in allowed and not (head and fmt in ("q8_0", "q4_1")):
            return f"{fmt} matrices [{n}, {k}] are not reproduced (Q4_1, and Q8_0 for the embedding and head)"
    return None


def _ggml_kernels(cfg: ModelConfig, engine_cfg: EngineConfig) -> tuple[Kernels, dict[str, str]]:
    """Every op as llama.cpp's x86-64 CPU build rounds it (pallas_kernels/ggml_cpu.py)."""
    # positions up to the context the engine will keep (it caps max_context at the model's)
    cos, sin = ggml_cpu.rope_tables(cfg.rope_theta, cfg.rope_dim, min(engine_cfg.max_context, cfg.context_length))
    names = {"matmul": "ggml_cpu", "embed": "reference", "attention_decode": "ggml_cpu",
             "attention_prefill": "ggml_cpu"}
    fns = {op: registry.choose(op, impl) for op, impl in names.items()}  # recorded for /health
    threads = {"threads": engine_cfg.ggml_threads}
    # llama.cpp's kq_scale is 1.0f / sqrtf(head_dim) in f32, which differs in the last bit from
    # head_dim ** -0.5 rounded to f32 for some sizes (24, 72, 96, ...; not 64 or 128)
    scale = cfg.attn_scale or float(np.float32(1) / np.sqrt(np.float32(cfg.head_dim)))

    def scaled(fn):
        def call(q, k, v, pos, _scale, *args, **kwargs):
            return fn(q, k, v, pos, scale, *args, **threads, **kwargs)
        return call

    prefill = scaled(fns["attention_prefill"])
    prefill.takes_num_valid = True
    if engine_cfg.prefill_chunks[-1] != 512:
        log.warning("numerics ggml: prompts run in chunks of %d: llama.cpp's tokens are matched where its ubatch "
                    "(n_ubatch) is %d too; its default is 512", engine_cfg.prefill_chunks[-1],
                    engine_cfg.prefill_chunks[-1])
    kernels = Kernels(
        matmul=lambda x, w, layer=None, split=None, elementwise_x=False: fns["matmul"](x, w, layer=layer),
        embed=fns["embed"],
        attention_decode=scaled(fns["attention_decode"]),
        attention_prefill=prefill,
        norm=ggml_cpu.rms_norm,
        rope=ggml_cpu.make_rope(cos, sin, cfg.rope_neox),
        gated_act=ggml_cpu.swiglu,
        numerics="ggml",
        decode_takes_slots=bool(getattr(fns["attention_decode"], "takes_slots", False)),
    )
    log.info("numerics ggml: llama.cpp's CPU arithmetic for every op, as run on %d threads (%s)",
             engine_cfg.ggml_threads, ", ".join(f"{k}: {v}" for k, v in names.items()))
    return kernels, names


def _lowering_reuse(engine_cfg: EngineConfig) -> Callable[[Any, str], Any]:
    """`wrap` for `_choose_matmuls`: with EngineConfig.reuse_kernel_lowering on one device, each
    Mosaic GPU matmul goes through a `LoweredOnce` of its own (shared by every program)."""
    if not engine_cfg.reuse_kernel_lowering:
        return lambda fn, name: fn
    if not lowering_cache.available():
        log.info("reuse_kernel_lowering: this jax cannot export without its forward-compatibility rules; "
                 "every program lowers its kernels")
        return lambda fn, name: fn
    if engine_cfg.tensor_parallel != 1:
        log.info("reuse_kernel_lowering is for one device; with tensor parallelism every program lowers its kernels")
        return lambda fn, name: fn
    wrapped: dict[int, lowering_cache.LoweredOnce] = {}  # one per implementation function: decode and prefill share theirs

    def wrap(fn: Any, name: str) -> Any:
        if not name.startswith("mosaic_gpu"):
            return fn
        return wrapped.setdefault(id(fn), lowering_cache.LoweredOnce(fn, "cuda"))

    return wrap


def _few_rows_limit(dec_fn, num_rows: int, kv_heads: int, groups: int, head_dim: int, itemsize: int,
                    buckets: tuple[int, ...]):
    """span -> the most busy rows for which the chosen decode attention runs its plan for few
    rows (`few_rows_limit` on the implementation, per context bucket; 0 without one, or with
    dec_fn None: not opted in), logged."""
    impl_limit = getattr(dec_fn, "few_rows_limit", None)
    limits = {span: impl_limit(num_rows, kv_heads, groups, head_dim, itemsize, span) if impl_limit else 0
              for span in buckets}
    if any(limits.values()):
        log.info("decode attention: a plan for few busy rows (up to %s) at context buckets %s",
                 max(limits.values()), [s for s, n in limits.items() if n])
    return lambda span: limits.get(span, 0)
