"""Forward passes: pure functions of (params, KV cache, inputs) -> (logits, new cache).

Legend: B slots, T tokens, S cache positions, H query heads, K kv heads, D head dim,
E embed, F ffn, V vocab, L layers.

`decode` runs one new token for each of B slots; `prefill` runs a fixed-size chunk of one
slot's prompt that continues from the slot's cached prefix. Both write their keys/values into
the cache (positions beyond a row's valid tokens are dropped) and are jitted by
`model/runner.py` with the cache donated. The ops (`Kernels`) are chosen once at start-up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from model import gated_ffn
from model.config import ModelConfig
from model.ordered_values import wo_key
from model.weights import LayerGroup, Params, numbered
from pallas_kernels.attention import pack_decode_write
from pallas_kernels.quant import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The op implementations one compiled program uses (hashable: a static jit argument)."""

    # (x [M, K], w, layer, split, elementwise_x=False[, x_in_order=True]) -> [M, N] f32; a stacked
    # w is read at `layer` in place. `split` ("column" | "row" | "vocab") is how the matrix divides
    # under tensor parallelism (model/sharding.py; "vocab": column-split output head whose logits
    # are gathered whole); single-device kernels ignore it. `elementwise_x`: x is made by
    # elementwise ops (an implementation that permutes x may then do it in a form XLA fuses into
    # them). `x_in_order` (passed only when true): x is in the order `x_order(w)` names.
    matmul: Callable
    embed: Callable  # (w, ids [T]) -> [T, E] f32
    # Both read the whole [L, B, S, K, D] cache in place at (traced) `layer` (and `slot`), keys
    # [0, span): a slice of it passed to a kernel would be a copy every layer.
    attention_decode: Callable
    attention_prefill: Callable
    # span -> the most busy rows for which decode should call attention_decode(...,
    # few_rows=True), a plan made for a lone row (pallas_kernels/attention_triton.py); 0: never
    # (the engine did not opt in, EngineConfig.few_rows_attention, or the implementation has no
    # such plan). The runner compiles its steady-state decode program (the most steps per
    # dispatch) with that plan as well.
    decode_few_rows_limit: Callable[[int], int] = lambda span: 0
    # attention_decode takes the step's cache write: attention_decode(pack_decode_write(q, k, v),
    # ..., write_pos=...) -> (out, k_cache, v_cache), in one kernel where the write would
    # otherwise be two scatters of its own (pallas_kernels/attention_triton.py); False:
    # KVCache.write_decode first.
    decode_writes_cache: bool = False
    # attention_decode takes `slots=` (each row's cache row): decode(..., slots=...), the engine's
    # speculative decode, can run on it.
    decode_takes_slots: bool = False
    # (packed, k_cache, v_cache, write_pos, slots, layer=) -> (k_cache, v_cache): writes every
    # row's key and value (packed as for the write_pos call) before decode(..., slots=) attends
    # them, in one kernel where KVCache.write_decode makes two scatters; None: write_decode.
    decode_write_rows: Callable | None = None
    # The arithmetic of the norms, RoPE and the gated activation where it must be an op's own
    # (`--numerics ggml`: pallas_kernels/ggml_cpu.py); None: this module's jnp forms.
    # norm(x, w, eps) -> RMS-normed x times w; rope(x [..., N, D], pos [...]) -> roped x (its own
    # tables: the model's theta, no scaling); gated_act(gate, up) -> act(gate) * up.
    norm: Callable | None = None
    rope: Callable | None = None
    gated_act: Callable | None = None
    numerics: str = "native"  # EngineConfig.numerics as resolved: "native" or "ggml"
    # w -> the column order [K] (np.ndarray) in which matmul reads x for w in every regime (it
    # permutes x itself unless called with x_in_order=True); None: x as it is, or no one order.
    x_order: Callable[[QuantizedTensor], Any] = lambda w: None
    # The output projections ((fmt, N, K), `ordered_values.wo_key`) whose layers' value rows were
    # permuted at load into the order they read x in (model/ordered_values.py): the attention's
    # output is passed to them with x_in_order=True.
    ordered_values: frozenset = frozenset()
    # The dtype attention_decode is asked to write its output in (out_dtype=): the matmuls'
    # activation dtype where the implementation takes it; None: its own (f32).
    attention_out_dtype: Any = None
    # (w, act) -> whether the decode matmul for an interleaved gate/up matrix w makes act(gate) *
    # up in its own epilogue at no cost (`matmul(..., gated=act)`; pallas_kernels/gated.py).
    # matmul takes `gated=act` (passed only when set) whatever the answer: an implementation
    # without the epilogue is followed by the product in XLA.
    takes_gated: Callable[[QuantizedTensor, str], bool] = lambda w, act: False
    # The layers whose gate/up rows were interleaved at load (`model.gated_ffn.ffn_key`: the
    # gate/up and down matrices' (fmt, N, K) and whether the product comes in the down
    # projection's x order): their FFN calls the gate/up matmul with gated=activation.
    gated_ffn: frozenset = frozenset()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values per layer and slot, each slot a contiguous run of positions.

    Writes go through `write_*`; attention reads the layer's slot rows. A paged layout (a block
    table per slot, shared prefix blocks) replaces this class and those reads.
    """

    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]

    @staticmethod
    def shape(cfg: ModelConfig, num_slots: int, max_context: int) -> tuple[int, ...]:
        """The shape of the keys, and of the values."""
        return (cfg.num_layers, num_slots, max_context, cfg.num_kv_heads, cfg.head_dim)

    @staticmethod
    def create(cfg: ModelConfig, num_slots: int, max_context: int, dtype: jnp.dtype) -> "KVCache":
        shape = KVCache.shape(cfg, num_slots, max_context)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_context(self) -> int:
        return self.k.shape[2]

    def write_decode(self, layer, rows, positions, k, v, distinct: bool = True) -> "KVCache":
        """k, v [B, K, D] at positions [B] of each row's cache row `rows` [B]; out-of-range
        positions are dropped. With `distinct`, `rows` must be distinct and ascending (one write
        per row: the indices are declared sorted and unique, which lets XLA write without
        atomics); without, rows may repeat (at distinct positions)."""
        hints = dict(mode="drop", indices_are_sorted=True, unique_indices=True) if distinct else dict(mode="drop")
        return KVCache(
            self.k.at[layer, rows, positions].set(k.astype(self.k.dtype), **hints),
            self.v.at[layer, rows, positions].set(v.astype(self.v.dtype), **hints),
        )

    def write_prefill(self, layer, slot, start, num_valid, k, v) -> "KVCache":
        """k, v [T, K, D] (rows >= num_valid are padding) at positions [start, start + num_valid)
        of one slot; the slot's other positions keep their values.

        A window of T positions is read, blended and written back in place (a dynamic-slice and
        a dynamic-update-slice at the same offset, which XLA fuses into one in-place kernel): a
        scatter at per-token positions ran 10x below the copy rate on the GPU. The window starts
        at `start`, or earlier where the chunk's padding would run past the cache's end (the
        update slice would be clamped anyway); the chunk's rows are shifted into it to match.
        """
        t, s = k.shape[0], self.max_context
        if t > s:  # a chunk size above the context: per-token positions, the padding dropped
            pos = jnp.where(jnp.arange(t) < num_valid, start + jnp.arange(t), s)
            return KVCache(
                self.k.at[layer, slot, pos].set(k.astype(self.k.dtype), mode="drop"),
                self.v.at[layer, slot, pos].set(v.astype(self.v.dtype), mode="drop"),
            )
        zero = jnp.zeros((), jnp.int32)
        begin = jnp.minimum(start, s - t).astype(jnp.int32)
        src = jnp.arange(t) - (start - begin)  # the chunk row that lands at each window row
        is_new = ((src >= 0) & (src < num_valid))[:, None, None]
        src = jnp.clip(src, 0, t - 1)
        at = (jnp.asarray(layer, jnp.int32), jnp.asarray(slot, jnp.int32), begin, zero, zero)

        def put(buf: jax.Array, new: jax.Array) -> jax.Array:
            old = jax.lax.dynamic_slice(buf, at, (1, 1, t, *buf.shape[3:]))[0, 0]
            window = jnp.where(is_new, new.astype(buf.dtype)[src], old)
            return jax.lax.dynamic_update_slice(buf, window[None, None], at)

        return KVCache(put(self.k, k), put(self.v, v))


def _fit_cache(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """New keys or values for a cache of `dtype`: an 8-bit float cache (e4m3fn, no inf) saturates
    them at its largest value, where a plain conversion would turn them into NaN."""
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(x, -top, top)
    return x


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(cfg: ModelConfig, theta: jax.Array | float, rope_freqs: jax.Array | None) -> jax.Array:
    half = cfg.rope_dim // 2
    inv = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / cfg.rope_dim))
    if rope_freqs is not None:
        inv = inv / rope_freqs[:half]
    sc = cfg.rope_scaling
    if sc.kind == "linear":
        inv = inv / sc.factor
    elif sc.kind == "yarn":
        inv = _yarn_inv_freq(cfg, inv)
    return inv


def _yarn_inv_freq(cfg: ModelConfig, inv: jax.Array) -> jax.Array:
    # YaRN "NTK-by-parts": interpolate long wavelengths by `factor`, keep short ones (llama.cpp rope_yarn).
    sc = cfg.rope_scaling
    orig = sc.original_context or cfg.context_length
    dims = jnp.arange(cfg.rope_dim // 2, dtype=jnp.float32) * 2

    def corr_dim(n_rot: float) -> float:
        return cfg.rope_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(0.0, math.floor(corr_dim(sc.yarn_beta_fast)))
    high = min(cfg.rope_dim - 1.0, math.ceil(corr_dim(sc.yarn_beta_slow)))
    ramp = jnp.clip((dims / 2 - low) / max(high - low, 1e-3), 0.0, 1.0)
    extrapolate = 1.0 - ramp
    return inv / sc.factor * (1 - extrapolate) + inv * extrapolate


def _yarn_mscale(cfg: ModelConfig) -> float:
    if cfg.rope_scaling.kind != "yarn":
        return 1.0
    return 0.1 * math.log(cfg.rope_scaling.factor) + 1.0


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [..., N, D] at positions pos [...] (broadcast over heads N)."""
    angles = pos.astype(jnp.float32)[..., None] * inv_freq  # [..., D_rot/2]
    cos = jnp.cos(angles)[..., None, :] * _yarn_mscale(cfg)
    sin = jnp.sin(angles)[..., None, :] * _yarn_mscale(cfg)
    rot, rest = x[..., : cfg.rope_dim], x[..., cfg.rope_dim :]
    if cfg.rope_neox:
        x1, x2 = rot[..., : cfg.rope_dim // 2], rot[..., cfg.rope_dim // 2 :]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:  # adjacent pairs (x0, x1), (x2, x3), ...
        pairs = rot.reshape(*rot.shape[:-1], cfg.rope_dim // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def _norm(kern: Kernels, x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return kern.norm(x, w, eps) if kern.norm is not None else rms_norm(x, w, eps)


def _rope(kern: Kernels, x: jax.Array, pos: jax.Array, inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
    return kern.rope(x, pos) if kern.rope is not None else apply_rope(x, pos, inv_freq, cfg)


def _act(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def _mm(kern: Kernels, x: jax.Array, w: QuantizedTensor, layer, split: str, elementwise_x: bool = False,
        x_in_order: bool = False, gated: str | None = None) -> jax.Array:
    """x @ w.T; a stacked w (the scanned layers) is read at `layer` by the kernel itself.
    split: "column" (output features split under tensor parallelism), "row" (input features) or
    "vocab" (the output head: split like "column", its logits gathered whole on every device).
    elementwise_x: x is made by elementwise ops, not a reduction (`Kernels.matmul`).
    x_in_order: x is already in the column order the matmul reads (`Kernels.x_order`).
    gated: w is an interleaved gate/up matrix, and the call returns act(gate) * up (`Kernels.gated_ffn`)."""
    options = {"x_in_order": True} if x_in_order else {}  # only kernels that name an order take it
    if gated is not None:
        options["gated"] = gated
    return kern.matmul(x, w, layer if w.stack_shape else None, split, elementwise_x=elementwise_x, **options)


def _split_cols(y: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
    out, at = [], 0
    for n in sizes:
        out.append(y[:, at : at + n])
        at += n
    return out


def _qkv(cfg: ModelConfig, kern: Kernels, lp: dict, layer, h: jax.Array, pos: jax.Array, inv_freq: jax.Array):
    """h [M, E] normed hidden, pos [M] -> q [M, H, D], k/v [M, K, D] (roped)."""
    m = h.shape[0]
    kv_dim = cfg.kv_dim
    if "wqkv" in lp:  # fused at load (model/weights.py): one read of x, one kernel
        q, k, v = _split_cols(_mm(kern, h, lp["wqkv"], layer, "column"), (cfg.q_dim, kv_dim, kv_dim))
    elif "wqk" in lp:  # v in a format of its own
        q, k = _split_cols(_mm(kern, h, lp["wqk"], layer, "column"), (cfg.q_dim, kv_dim))
        v = _mm(kern, h, lp["wv"], layer, "column")
    else:
        q = _mm(kern, h, lp["wq"], layer, "column")
        k = _mm(kern, h, lp["wk"], layer, "column")
        v = _mm(kern, h, lp["wv"], layer, "column")
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(m, cfg.num_heads, cfg.head_dim)
    k = k.reshape(m, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(m, cfg.num_kv_heads, cfg.head_dim)
    if "q_norm" in lp:
        q = _norm(kern, q, lp["q_norm"], cfg.rms_eps)
        k = _norm(kern, k, lp["k_norm"], cfg.rms_eps)
    q = _rope(kern, q, pos, inv_freq, cfg)
    k = _rope(kern, k, pos, inv_freq, cfg)
    return q, k, v


def _attn_out_and_ffn(cfg: ModelConfig, kern: Kernels, lp: dict, layer, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The rest of a layer after attention: output projection, residual, FFN block.
    x [M, E], attn [M, H, D] -> [M, E]."""
    # values stored in wo's x order at load: the attention's output is in it already
    in_order = wo_key(lp["wo"]) in kern.ordered_values
    out = _mm(kern, attn.reshape(attn.shape[0], cfg.q_dim), lp["wo"], layer, "row", elementwise_x=True,
              x_in_order=in_order)
    if "post_attn_norm" in lp:
        out = _norm(kern, out, lp["post_attn_norm"], cfg.rms_eps)
    return _ffn(cfg, kern, lp, layer, x + out)


def _ffn(cfg: ModelConfig, kern: Kernels, lp: dict, layer, x: jax.Array) -> jax.Array:
    h = _norm(kern, x, lp["ffn_norm"], cfg.rms_eps)
    key = gated_ffn.layer_key(kern, lp)
    if key is not None:  # gate/up interleaved at load: the matmul makes act(gate) * up itself
        act = _mm(kern, h, lp["w_gate_up"], layer, "column", gated=cfg.activation)
        out = _mm(kern, act, lp["w_down"], layer, "row", elementwise_x=True, x_in_order=key[-1])
    else:
        if "w_gate_up" in lp:  # fused at load
            gate, up = _split_cols(_mm(kern, h, lp["w_gate_up"], layer, "column"), (cfg.ffn_dim, cfg.ffn_dim))
        else:
            gate = _mm(kern, h, lp["w_gate"], layer, "column")
            up = _mm(kern, h, lp["w_up"], layer, "column")
        act = kern.gated_act(gate, up) if kern.gated_act is not None else _act(cfg, gate) * up
        out = _mm(kern, act, lp["w_down"], layer, "row", elementwise_x=True)
    if "post_ffn_norm" in lp:
        out = _norm(kern, out, lp["post_ffn_norm"], cfg.rms_eps)
    return x + out


def _layer_consts(cfg: ModelConfig, params: Params, layer: jax.Array | int):
    """Per-layer rope frequencies and attention window (gemma3 alternates local/global)."""
    if not cfg.sliding_window:
        return _inv_freq(cfg, cfg.rope_theta, params.rope_freqs), 0
    is_global = (layer + 1) % cfg.sliding_window_pattern == 0 if cfg.sliding_window_pattern else False
    theta = jnp.where(is_global, cfg.rope_theta, cfg.rope_theta_local or cfg.rope_theta)
    window = jnp.where(is_global, 0, cfg.sliding_window)
    return _inv_freq(cfg, theta, params.rope_freqs), window


def _run_layers(params: Params, cache: KVCache, body: Callable, unroll: bool = False):
    """Applies body(layer_params, cache, layer_index, x, stack_index) -> (x, cache) over all
    layers; the body reads a stacked matrix at `stack_index`, the cache and per-layer constants
    at `layer_index`.

    The body writes into the whole [L, ...] cache in place (scatter at [layer, ...]): slicing a
    layer out and setting it back copies the cache every layer, which dominated decode time.
    Stacked layers are scanned over the layer index alone: the matrices stay whole [L, N, K]
    stacks that the kernels read at the index (scanning over them as `xs` made XLA copy every
    layer's weights out of the stack each step, 25% of a decode step on the H200), and only the
    small vectors (norms, biases) are sliced. `unroll` emits the body once per layer with the
    layer index a Python int: no while loop, and every index the kernels take is an HLO constant
    (an unrolled scan's indices are slices of an iota, one small kernel per layer on the GPU).
    A list of layers runs in order: a layer dict once, a `LayerGroup` as a scan over its
    repeats (each step its phases in order), unrolled with `unroll`.
    """

    def sliced(layers: dict, i):
        return {k: v if isinstance(v, QuantizedTensor) else jax.lax.dynamic_index_in_dim(v, i, 0, keepdims=False)
                for k, v in layers.items()}

    def run_group(group: LayerGroup, x, c):
        def repeat(carry, r):
            x, c = carry
            for j, phase in enumerate(group.phases):
                x, c = body(sliced(phase, r), c, group.layer(r, j), x, r)
            return (x, c), None

        if unroll:
            for r in range(group.repeats):
                (x, c), _ = repeat((x, c), r)
            return x, c
        (x, c), _ = jax.lax.scan(repeat, (x, c), jnp.arange(group.repeats))
        return x, c

    def run(x):
        if params.is_stacked:
            return run_group(LayerGroup([params.layers], 0, cache.k.shape[0]), x, cache)
        c = cache
        for i, entry in numbered(params.layers):
            if isinstance(entry, LayerGroup):
                x, c = run_group(entry, x, c)
            else:
                x, c = body(entry, c, i, x, None)
        return x, c

    return run


def _embed(cfg: ModelConfig, kern: Kernels, params: Params, tokens: jax.Array) -> jax.Array:
    x = kern.embed(params.embed, tokens)
    return x * cfg.embed_scale if cfg.embed_scale != 1.0 else x


def head_logits(cfg: ModelConfig, kern: Kernels, params: Params, x: jax.Array) -> jax.Array:
    """The output head's logits [R, V] f32 of the last layer's outputs x [R, E]."""
    h = _norm(kern, x, params.output_norm, cfg.rms_eps)
    w = params.output if params.output is not None else params.embed
    # vocab-parallel head; its logits are gathered once, so that sampling runs whole on every
    # device instead of XLA spreading a dozen small collectives through the sort and reductions
    logits = _mm(kern, h, w, None, "vocab")
    if cfg.final_logit_softcap:
        c = cfg.final_logit_softcap
        logits = jnp.tanh(logits / c) * c
    return logits


def decode(
    cfg: ModelConfig,
    kern: Kernels,
    params: Params,
    cache: KVCache,
    tokens: jax.Array,  # [B] int32
    positions: jax.Array,  # [B] int32; rows with position < 0 are inactive (nothing written)
    attend: int | None = None,  # static: attention reads cache positions [0, attend); > every position
    unroll: bool = False,  # static: unroll the layer loop (EngineConfig.unroll_decode_layers)
    few_rows: bool = False,  # static: attention planned for few busy rows (Kernels.decode_few_rows_limit)
    # [B] int32: the cache row (slot) of each input row; None: row b's is b. Rows may share a slot
    # at consecutive positions (a speculative decode's next token and drafts): every row's key
    # is in the cache before any row attends, so each row computes what a plain decode of its
    # slot at its position would, bit for bit (the attention implementation must take `slots`)
    slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:  # logits [B, V] f32
    b = tokens.shape[0]
    s = cache.max_context
    active = positions >= 0
    pos = jnp.where(active, positions, 0)
    write_pos = jnp.where(active, positions, s)  # out of range: dropped
    by_slot = slots is not None
    if by_slot and few_rows:
        raise ValueError("rows by slot take the plan made for all rows (few_rows=False): its rows are row-invariant")
    # distinct and ascending without slots: write_decode declares its indices sorted and unique
    rows = slots if by_slot else jnp.arange(b)
    # only implementations with a few-rows plan, or an output dtype, or rows by slot take them
    options = {"few_rows": True} if few_rows else {}
    if kern.attention_out_dtype is not None:
        options["out_dtype"] = kern.attention_out_dtype
    if by_slot:
        options["slots"] = slots

    def body(lp, c: KVCache, i, x, w_index):  # x [B, E]
        inv_freq, window = _layer_consts(cfg, params, i)
        h = _norm(kern, x, lp["attn_norm"], cfg.rms_eps)
        q, k, v = _qkv(cfg, kern, lp, w_index, h, pos, inv_freq)
        k, v = _fit_cache(k, c.k.dtype), _fit_cache(v, c.v.dtype)
        if kern.decode_writes_cache:
            packed = pack_decode_write(q, k, v)
            # by slot: the other rows' keys in the cache first, as the kernel writes them (through q's dtype)
            if by_slot and kern.decode_write_rows is not None:
                c = KVCache(*kern.decode_write_rows(packed, c.k, c.v, write_pos, rows, layer=i))
            elif by_slot:
                c = c.write_decode(i, rows, write_pos, k.astype(q.dtype), v.astype(q.dtype), distinct=False)
            attn, ck, cv = kern.attention_decode(packed, c.k, c.v, pos, cfg.scale, window,
                                                 layer=i, span=attend or s, write_pos=write_pos, **options)
            c = KVCache(ck, cv)
        else:
            c = c.write_decode(i, rows, write_pos, k, v, distinct=not by_slot)
            attn = kern.attention_decode(q, c.k, c.v, pos, cfg.scale, window, layer=i, span=attend or s,
                                         **options)  # [B, H, D]
        return _attn_out_and_ffn(cfg, kern, lp, w_index, x, attn), c

    x = _embed(cfg, kern, params, tokens)
    x, cache = _run_layers(params, cache, body, unroll)(x)
    return head_logits(cfg, kern, params, x), cache


def prefill_hidden(
    cfg: ModelConfig,
    kern: Kernels,
    params: Params,
    cache: KVCache,
    slot: jax.Array,  # [] int32
    tokens: jax.Array,  # [T] int32, padded
    start_pos: jax.Array,  # [] int32
    num_valid: jax.Array,  # [] int32, 1 <= num_valid <= T
    attend: int | None = None,  # static: attention reads cache positions [0, attend); >= start + num_valid
) -> tuple[jax.Array, KVCache]:  # the last layer's output [T, E], before the output norm
    """A prompt chunk's forward pass: its keys and values written into the slot's cache."""
    t = tokens.shape[0]
    s = cache.max_context
    pos = start_pos + jnp.arange(t)
    # the chunk's row count, for an implementation whose arithmetic depends on it (ggml_cpu's)
    valid = {"num_valid": num_valid} if getattr(kern.attention_prefill, "takes_num_valid", False) else {}

    def body(lp, c: KVCache, i, x, w_index):  # x [T, E]
        inv_freq, window = _layer_consts(cfg, params, i)
        h = _norm(kern, x, lp["attn_norm"], cfg.rms_eps)
        q, k, v = _qkv(cfg, kern, lp, w_index, h, pos, inv_freq)
        c = c.write_prefill(i, slot, start_pos, num_valid, _fit_cache(k, c.k.dtype), _fit_cache(v, c.v.dtype))
        attn = kern.attention_prefill(q, c.k, c.v, start_pos, cfg.scale, window, layer=i, slot=slot,
                                      span=attend or s, **valid)  # [T, H, D]
        return _attn_out_and_ffn(cfg, kern, lp, w_index, x, attn), c

    x = _embed(cfg, kern, params, tokens)
    x, cache = _run_layers(params, cache, body)(x)
    return x, cache


def prefill(cfg: ModelConfig, kern: Kernels, params: Params, cache: KVCache, slot: jax.Array, tokens: jax.Array,
            start_pos: jax.Array, num_valid: jax.Array, attend: int | None = None,
            ) -> tuple[jax.Array, KVCache]:  # logits [V] f32 of the last valid token
    """`prefill_hidden`, then the logits of the chunk's last valid token."""
    x, cache = prefill_hidden(cfg, kern, params, cache, slot, tokens, start_pos, num_valid, attend)
    return last_logits(cfg, kern, params, x, num_valid), cache


def last_logits(cfg: ModelConfig, kern: Kernels, params: Params, x: jax.Array, num_valid: jax.Array) -> jax.Array:
    """The logits [V] f32 of a chunk's last valid row of `prefill_hidden`'s output x [T, E]."""
    last = jax.lax.dynamic_slice_in_dim(x, num_valid - 1, 1, axis=0)  # [1, E]
    return head_logits(cfg, kern, params, last)[0]


def pooled_hidden(cfg: ModelConfig, kern: Kernels, params: Params, x: jax.Array,
                  num_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A chunk's last-layer outputs x [T, E] after the output norm (the rows the output head
    reads, llama.cpp's embeddings), pooled: their sum over the valid rows and the last valid
    row, each [E] f32."""
    h = _norm(kern, x, params.output_norm, cfg.rms_eps).astype(jnp.float32)
    valid = jnp.arange(x.shape[0]) < num_valid
    total = jnp.sum(jnp.where(valid[:, None], h, 0.0), axis=0)
    return total, jax.lax.dynamic_slice_in_dim(h, num_valid - 1, 1, axis=0)[0]


SCORE_ROWS = 64  # rows of a chunk whose logits `token_scores` holds at once


def token_scores(cfg: ModelConfig, kern: Kernels, params: Params, x: jax.Array, targets: jax.Array,
                 num_top: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For each row of a chunk's hidden states `x` [T, E]: the log-probability of `targets` [T]
    under the row's logits (raw: log-softmax, no sampling settings), the target's rank among
    them (1 + the tokens with a larger logit), and the `num_top` most likely tokens' ids and
    log-probabilities, descending. SCORE_ROWS rows at a time, so that the logits in memory are
    [SCORE_ROWS, V] whatever the chunk (a 262k vocabulary's 512 rows would be 512 MiB)."""
    t = x.shape[0]
    rows = min(SCORE_ROWS, t)
    pad = -t % rows
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, rows, x.shape[1])
    ts = jnp.pad(targets, (0, pad)).reshape(-1, rows)

    def block(args):
        xb, tb = args
        logits = head_logits(cfg, kern, params, xb).astype(jnp.float32)  # [R, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, tb[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)
        if num_top:
            top_lps, top_ids = jax.lax.top_k(logits, num_top)
        else:
            top_lps, top_ids = jnp.zeros((rows, 0), jnp.float32), jnp.zeros((rows, 0), jnp.int32)
        return chosen - lse, rank, top_ids.astype(jnp.int32), top_lps - lse[:, None]

    outs = jax.lax.map(block, (xs, ts))
    return tuple(o.reshape(-1, *o.shape[2:])[:t] for o in outs)
