"""The model runner: compiled step programs over device-resident slot state.

Holds params, the KV cache and per-slot state (next input token, position, penalty counts,
sampling arrays) on the device. `dispatch(StepPlan)` enqueues one compiled decode program for
the decoding slots and one compiled prefill program per prompt chunk, each sampling its next
token on the device, and returns at once, the copies of its outputs to the host started
(`_start_copies`); `PendingStep.result()` waits for them. Every (program, shape) is compiled in
`warmup()`; afterwards only those executables run, so a shape miss is an error, never a
silent recompile. Only the engine thread calls this.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model import forward, sampling, sharding, speculative, transfer
from model.config import EngineConfig, ModelConfig
from model.forward import Kernels, KVCache
from model.pending import (
    DRAFT_GAIN_START,
    DRAFT_PROBE_STEPS,
    _DeferredPending,
    _draft_cap,
    _Pending,
    _SpecPending,
)
from model.slot_snapshot import SlotSnapshots
from model.step_types import PrefillChunk, SamplingParams, StepPlan, mask_words
from model.weights import Params

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    tokens: jax.Array  # [B] int32: next input token (the last sampled one)
    positions: jax.Array  # [B] int32: tokens already in the cache
    prompt_mask: jax.Array  # [B, V] bool: token appears in the prompt (repetition penalty)
    counts: jax.Array  # [B, V] int32: generated-token counts (presence/frequency penalties)
    step_index: jax.Array  # [B] int32: tokens generated so far (RNG stream position)
    # [B, S] int32: the token at each cache position (stale past the slot's last), so that a
    # request reusing a cached prompt prefix gets that prefix's prompt mask, and for DRY, the
    # penalty windows and the speculative decode's drafts
    history: jax.Array
    breakers: jax.Array  # [B, W] int32 bitmask: the slot's request's DRY breaker tokens
    mu: jax.Array  # [B] f32: the slot's request's mirostat target surprise (2 tau at its start)

    @staticmethod
    def create(num_slots: int, vocab: int, max_context: int) -> "SlotState":
        return SlotState(
            tokens=jnp.zeros((num_slots,), jnp.int32),
            positions=jnp.zeros((num_slots,), jnp.int32),
            prompt_mask=jnp.zeros((num_slots, vocab), jnp.bool_),
            counts=jnp.zeros((num_slots, vocab), jnp.int32),
            step_index=jnp.zeros((num_slots,), jnp.int32),
            history=jnp.zeros((num_slots, max_context), jnp.int32),
            breakers=jnp.zeros((num_slots, mask_words(vocab)), jnp.int32),
            mu=jnp.zeros((num_slots,), jnp.float32),
        )


def _decode_step(cfg: ModelConfig, kern: Kernels, num_top: int, attend: int, params, cache, st: SlotState, samp, active,
                 allowed=None, *, unroll: bool = False, few_rows: bool = False, llama_samplers: bool = True):
    """One decode step of the busy slots (`active` [B]). `allowed` ([B, W] int32 bitmask, or
    None): the tokens each row may sample (constrained decoding; all bits set where free). Each
    input token goes into the slot's history at its position (DRY and the penalty windows read
    it, and the speculative decode's drafts are looked up there). `llama_samplers`: as
    `sampling.sample_stateful`'s (False: `ModelRunner`'s lean decode)."""
    positions = jnp.where(active, st.positions, -1)
    logits, cache = forward.decode(cfg, kern, params, cache, st.tokens, positions, attend, unroll, few_rows)
    st, out = _sample_decode(num_top, st, samp, active, allowed, logits, llama_samplers=llama_samplers)
    return cache, st, out


def _decode_logits(cfg: ModelConfig, kern: Kernels, attend: int, params, cache, st: SlotState, active,
                   *, unroll: bool = False, few_rows: bool = False):
    """A deferred decode's first program (StepPlan.deferred): `_decode_step`'s forward pass
    alone, the logits [B, V] left on the device for `_sample_decode`, which runs once the host
    has the constrained rows' allowed tokens."""
    positions = jnp.where(active, st.positions, -1)
    logits, cache = forward.decode(cfg, kern, params, cache, st.tokens, positions, attend, unroll, few_rows)
    return cache, logits


def _sample_decode(num_top: int, st: SlotState, samp, active, allowed, logits, *, llama_samplers: bool = True):
    """A decode step's sampling and slot-state update over its logits (`_decode_step`'s second
    half; alone, a deferred decode's second program)."""
    samp = sampling.for_rows(samp, active)  # inactive rows' outputs are discarded: no draw, sort or top-k for them
    rows = jnp.arange(active.shape[0], dtype=jnp.int32)
    recent = sampling.TokenHistory(st.history, rows, st.positions, st.tokens, st.breakers)
    tok, lp, top_ids, top_lps, mu = sampling.sample_stateful(logits, samp, st.prompt_mask, st.counts, st.step_index,
                                                             num_top, st.mu, allowed=allowed, history=recent,
                                                             llama_samplers=llama_samplers)
    inc = active.astype(jnp.int32)
    history = st.history.at[rows, jnp.where(active, st.positions, st.history.shape[1])].set(st.tokens, mode="drop")
    st = SlotState(
        tokens=jnp.where(active, tok, st.tokens),
        positions=st.positions + inc,
        prompt_mask=st.prompt_mask,
        counts=sampling.update_counts(st.counts, tok, active),
        step_index=st.step_index + inc,
        history=history,
        breakers=st.breakers,
        mu=jnp.where(active, mu, st.mu),
    )
    return st, _pack_outputs(tok, active, lp, top_ids, top_lps)


@dataclasses.dataclass(frozen=True)
class Speculation:
    """The speculative decode's static settings (EngineConfig.draft_max, ngram_max, ngram_min)."""

    draft_max: int
    ngram_max: int
    ngram_min: int


def _spec_decode_step(cfg: ModelConfig, kern: Kernels, num_top: int, attend: int, spec: Speculation, params, cache,
                      st: SlotState, samp, layout, *, unroll: bool = False):
    """One speculative decode step (model/speculative.py): each row of `layout` [3, R] runs its
    slot's next token (offset 0) or draft `offset`, the drafts looked up in the slot's history;
    returns the rows' outputs, flag bit 0 set where the row's choice is emitted, bit 1 where the
    row held a draft."""
    slot, off, used = layout[0], layout[1], layout[2] != 0
    s = st.history.shape[1]
    drafts, count = speculative.ngram_drafts(st.history, st.tokens, st.positions, max(spec.draft_max, 1),
                                             spec.ngram_max, spec.ngram_min)
    row_pos = st.positions[slot] + off
    valid = used & (off <= count[slot]) & (row_pos < s)
    drafted = jnp.take_along_axis(drafts[slot], jnp.clip(off - 1, 0, drafts.shape[1] - 1)[:, None], axis=1)[:, 0]
    inputs = jnp.where(off == 0, st.tokens[slot], drafted)
    logits, cache = forward.decode(cfg, kern, params, cache, inputs, jnp.where(valid, row_pos, -1), attend, unroll,
                                   slots=slot)
    gather = lambda a: a[slot]  # noqa: E731  (each row takes its slot's settings and state)
    row_samp = sampling.for_rows(jax.tree_util.tree_map(gather, samp), valid)
    # A row's penalty counts: its slot's, plus the drafts before it (the tokens a plain decode at
    # its position would have generated by then, where they are accepted); its draw: the slot's
    # key at the row's own token index. So a sampled or penalized row chooses what a plain decode
    # at its position would.
    r = slot.shape[0]
    before = speculative.precedes(layout) & valid[:, None]  # [q, r]: draft q comes before row r
    row_counts = st.counts[slot].at[jnp.broadcast_to(jnp.arange(r)[None, :], (r, r)),
                                    jnp.broadcast_to(inputs[:, None], (r, r))].add(before.astype(st.counts.dtype))
    # (a slot with DRY, a penalty window or mirostat checks no drafts, `model.pending._draft_cap`:
    # its rows' tokens so far are its slot's history and its row's input, its target surprise the slot's)
    recent = sampling.TokenHistory(st.history, slot, row_pos, inputs, st.breakers)
    tok, lp, top_ids, top_lps, mu = sampling.sample_stateful(logits, row_samp, st.prompt_mask[slot], row_counts,
                                                             st.step_index[slot] + off, num_top, st.mu[slot],
                                                             history=recent)
    emitted = speculative.accept(layout, valid, inputs, tok)
    b = st.tokens.shape[0]
    n = jnp.zeros((b,), jnp.int32).at[slot].add(emitted.astype(jnp.int32))  # tokens each slot emits
    last = emitted & (off == n[slot] - 1)  # the row whose choice is the slot's next input
    st = SlotState(
        tokens=st.tokens.at[jnp.where(last, slot, b)].set(tok, mode="drop"),
        positions=st.positions + n,
        prompt_mask=st.prompt_mask,
        counts=st.counts.at[jnp.where(emitted, slot, b), tok].add(1, mode="drop"),
        step_index=st.step_index + n,
        history=st.history.at[jnp.where(emitted, slot, b), row_pos].set(inputs, mode="drop"),
        breakers=st.breakers,
        mu=st.mu.at[jnp.where(last, slot, b)].set(mu, mode="drop"),
    )
    flag = emitted.astype(jnp.int32) + 2 * (valid & (off >= 1)).astype(jnp.int32)
    return cache, st, _pack_outputs(tok, flag, lp, top_ids, top_lps)


def _multi_spec_decode_step(cfg: ModelConfig, kern: Kernels, num_top: int, attend: int, spec: Speculation,
                            num_steps: int, params, cache, st: SlotState, samp, layout, *, unroll: bool = False):
    """num_steps speculative decode steps in one program; outputs stacked on a leading axis."""

    def one(carry, _):
        cache, st = carry
        cache, st, out = _spec_decode_step(cfg, kern, num_top, attend, spec, params, cache, st, samp, layout,
                                           unroll=unroll)
        return (cache, st), out

    (cache, st), outs = jax.lax.scan(one, (cache, st), None, length=num_steps)
    return cache, st, outs


def _pack_outputs(tok, flag, lp, top_ids, top_lps):
    """A step's outputs as one int32 array, one copy to the host (model/transfer.py): on the
    last axis the token, the flag (active, is_last), the logprob's bits, the top ids and the top
    logprobs' bits; `model.pending._unpack_outputs` reads it back."""
    def column(a, ndim):
        a = jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.float32 else a.astype(jnp.int32)
        return a[..., None] if a.ndim == ndim else a

    return jnp.concatenate([column(a, tok.ndim) for a in (tok, flag, lp, top_ids, top_lps)], axis=-1)


def _multi_decode_step(cfg: ModelConfig, kern: Kernels, num_top: int, attend: int, num_steps: int, params, cache, st: SlotState, samp, active,
                       *, unroll: bool = False, few_rows: bool = False, llama_samplers: bool = True):
    """num_steps decode steps in one program; outputs stacked on a leading [num_steps] axis."""

    def one(carry, _):
        cache, st = carry
        cache, st, out = _decode_step(cfg, kern, num_top, attend, params, cache, st, samp, active, unroll=unroll,
                                      few_rows=few_rows, llama_samplers=llama_samplers)
        return (cache, st), out

    (cache, st), outs = jax.lax.scan(one, (cache, st), None, length=num_steps)
    return cache, st, outs


PREFILL_HEAD = 5  # prefill_args' scalars


def prefill_args(slot: int, tokens: np.ndarray, start: int, num_valid: int, is_last: bool,
                 samp_words: np.ndarray, allowed: np.ndarray, breakers: np.ndarray, reused: int = 0) -> np.ndarray:
    """`_prefill_step`'s host arguments as one int32 vector, one transfer (model/transfer.py):
    slot, start, num_valid, is_last, reused (`PrefillChunk.reused`), every slot's sampling
    settings as `transfer.pack_words` gives them, the tokens the chunk's sample may take ([W]
    bitmask, all bits set where free), the request's DRY breaker tokens ([W] bitmask, read at
    its first chunk), then the chunk's (padded) tokens."""
    head = np.asarray([slot, start, num_valid, int(is_last), reused], np.int32)
    return np.concatenate([head, samp_words, np.asarray(allowed, np.int32), np.asarray(breakers, np.int32),
                           np.asarray(tokens, np.int32)])


COPY_LAYERS = 4  # layers per iteration of `_copy_prefix`'s loop (bench/prefix_copy.py measured 1, 4, 8, all)


def _copy_prefix(span: int, layers: int, params, cache: KVCache, st: SlotState, args):
    """`PrefixCopy`: positions [0, span) of slot args[0]'s keys, values and prompt tokens into
    slot args[1] (a whole context bucket), in place. The keys and values go `layers` layers an
    iteration of a loop: one slice of them all at once is a temporary copy of the source slot's
    rows (on the CPU, 90 MiB where a loop of single layers needed 1.5)."""
    src, dst = args[0], args[1]
    zero = jnp.zeros((), jnp.int32)

    def move(buf: jax.Array) -> jax.Array:  # [L, B, S, K, D]
        num_layers = buf.shape[0]
        group = min(layers, num_layers)

        def body(i, buf):
            first = jnp.minimum(i * group, num_layers - group)  # the last group may overlap the one before
            rows = jax.lax.dynamic_slice(buf, (first, src, zero, zero, zero), (group, 1, span, *buf.shape[3:]))
            return jax.lax.dynamic_update_slice(buf, rows, (first, dst, zero, zero, zero))

        return jax.lax.fori_loop(0, -(-num_layers // group), body, buf)

    rows = jax.lax.dynamic_slice(st.history, (src, zero), (1, span))
    history = jax.lax.dynamic_update_slice(st.history, rows, (dst, zero))  # (the breakers: set by dst's prefill)
    return KVCache(move(cache.k), move(cache.v)), dataclasses.replace(st, history=history)


def _prefill_step(cfg: ModelConfig, kern: Kernels, num_top: int, attend: int, samp_layout: transfer.WordsLayout,
                  params, cache, st: SlotState, args, *, score: bool = False, llama_samplers: bool = True):
    """One prompt chunk (`prefill_args`); returns (cache, state, the sampling arrays it unpacked
    for the decode programs after it, its outputs). `score` (a scored chunk, PrefillChunk.score):
    `args` ends with the prompt's token after the chunk (-1: none), and the outputs go on with
    the length of `forward.pooled_hidden`'s two vectors (2E), their f32 bits, then each row's
    `forward.token_scores` of the token after it (`_pack_outputs`' columns: the token, its
    rank, its logprob, the top ids and logprobs), row by row. `llama_samplers`: as
    `sampling.sample_stateful`'s (False: `ModelRunner`'s lean sampling)."""
    words = transfer.words_size(samp_layout)
    vocab, s = st.prompt_mask.shape[1], st.history.shape[1]
    slot, start, num_valid, is_last, reused = args[0], args[1], args[2], args[3] != 0, args[4]
    samp = transfer.unpack_words(args[PREFILL_HEAD:PREFILL_HEAD + words], samp_layout)
    w = mask_words(vocab)
    allowed = args[PREFILL_HEAD + words:PREFILL_HEAD + words + w]
    breakers = args[PREFILL_HEAD + words + w:PREFILL_HEAD + words + 2 * w]
    tokens = args[PREFILL_HEAD + words + 2 * w:]
    if score:
        tokens, next_token = tokens[:-1], tokens[-1]
    t = tokens.shape[0]
    fresh = start == reused  # a new request's first chunk: reset the slot's penalty state
    row_history = st.history[slot]
    kept = jnp.where(jnp.arange(s) < reused, row_history, vocab)  # the reused prompt prefix's tokens
    row_mask = jnp.where(fresh, jnp.zeros((vocab,), jnp.bool_).at[kept].set(True, mode="drop"), st.prompt_mask[slot])
    row_counts = jnp.where(fresh, 0, st.counts[slot])
    row_step = jnp.where(fresh, 0, st.step_index[slot])
    row_breakers = jnp.where(fresh, breakers, st.breakers[slot])
    row_mu = jnp.where(fresh, 2 * samp.mirostat_tau[slot], st.mu[slot])
    valid = jnp.arange(t) < num_valid
    ids = jnp.where(valid, tokens, vocab)  # padding: dropped
    row_mask = row_mask.at[ids].set(True, mode="drop")
    row_history = row_history.at[jnp.where(valid, start + jnp.arange(t), s)].set(tokens, mode="drop")

    x, cache = forward.prefill_hidden(cfg, kern, params, cache, slot, tokens, start, num_valid, attend)
    logits = forward.last_logits(cfg, kern, params, x, num_valid)
    row_samp = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0), samp)
    # no conditionals: on the GPU this program's would run on the host and block the call
    last = start + num_valid - 1
    recent = sampling.TokenHistory(row_history[None], jnp.zeros((1,), jnp.int32), last[None],
                                   jax.lax.dynamic_slice_in_dim(tokens, num_valid - 1, 1), row_breakers[None])
    tok, lp, top_ids, top_lps, mu = sampling.sample_stateful(
        logits[None], row_samp, row_mask[None], row_counts[None], row_step[None], num_top, row_mu[None],
        skip_unused=False, allowed=allowed[None], history=recent, llama_samplers=llama_samplers,
    )
    tok = tok[0]
    row_counts = jnp.where(is_last, row_counts.at[tok].add(1), row_counts)
    st = SlotState(
        tokens=st.tokens.at[slot].set(jnp.where(is_last, tok, st.tokens[slot])),
        positions=st.positions.at[slot].set(start + num_valid),
        prompt_mask=st.prompt_mask.at[slot].set(row_mask),
        counts=st.counts.at[slot].set(row_counts),
        step_index=st.step_index.at[slot].set(row_step + is_last.astype(jnp.int32)),
        history=st.history.at[slot].set(row_history),
        breakers=st.breakers.at[slot].set(row_breakers),
        mu=st.mu.at[slot].set(jnp.where(is_last, mu[0], row_mu)),
    )
    out = jnp.concatenate([slot[None], _pack_outputs(tok, is_last, lp[0], top_ids[0], top_lps[0])])
    if score:
        targets = jnp.where(jnp.arange(t) == num_valid - 1, next_token, jnp.roll(tokens, -1))
        targets = jnp.clip(targets, 0, vocab - 1)  # past the prompt: scored, never read
        lps, ranks, ids, top = forward.token_scores(cfg, kern, params, x, targets, num_top)
        pooled = jax.lax.bitcast_convert_type(jnp.concatenate(forward.pooled_hidden(cfg, kern, params, x, num_valid)),
                                              jnp.int32)
        out = jnp.concatenate([out, jnp.asarray([pooled.shape[0]], jnp.int32), pooled,
                               _pack_outputs(targets, ranks, lps, ids, top).reshape(-1)])
    return cache, st, samp, out


def _start_copies(outputs: Any) -> Any:
    """Starts the device-to-host copies of a program's outputs as soon as it is dispatched, so
    that they queue behind that program alone. Asked for only when the engine reads them, after
    it has dispatched the next step, the copies waited for that step too on the H200 (the
    runtime orders them after the work queued by then): each step's results came a program
    late, and the device idled while the host caught up (bench/results, twenty-fourth
    session)."""
    for leaf in jax.tree_util.tree_leaves(outputs):
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
    return outputs


class ModelRunner(SlotSnapshots):
    """Implements `model.step_types.StepModel` over a loaded model."""

    def __init__(
        self, cfg: ModelConfig, params: Params, kernels: Kernels, engine_cfg: EngineConfig, mesh: Mesh | None = None
    ) -> None:  # mesh: tensor parallel > 1, params already placed on it (model/sharding.py)
        if engine_cfg.max_context > cfg.context_length:
            raise ValueError(f"max context {engine_cfg.max_context} exceeds the model's {cfg.context_length}")
        self.cfg, self.params, self.kernels, self.engine_cfg = cfg, params, kernels, engine_cfg
        self.num_slots = engine_cfg.num_slots
        self.vocab_size = cfg.vocab_size  # the logits' V (the engine's allowed-token rows are ceil(V / 32) words)
        self.max_context = engine_cfg.max_context
        self.prefill_chunks = engine_cfg.prefill_chunks
        self.max_top_logprobs = engine_cfg.max_top_logprobs
        # PrefillChunk.score: a scoring program per chunk size and context bucket
        self.scores_prompts = engine_cfg.prompt_logprobs
        self.decode_steps = tuple(sorted({1, engine_cfg.decode_steps()}))
        self.dispatch_ahead = engine_cfg.dispatch_ahead
        self._mesh = mesh
        self._unroll_decode = engine_cfg.unrolls_decode(jax.default_backend())
        log.info("decode layer loop: %s (unroll_decode_layers=%s)", "unrolled" if self._unroll_decode else "scanned",
                 engine_cfg.unroll_decode_layers)
        if mesh is None:
            self._cache = KVCache.create(cfg, self.num_slots, self.max_context, jnp.dtype(engine_cfg.kv_dtype))
            self._state = SlotState.create(self.num_slots, cfg.vocab_size, self.max_context)
        else:  # the cache splits over kv heads; the slot state is replicated
            self._cache = sharding.create_cache(cfg, self.num_slots, self.max_context, jnp.dtype(engine_cfg.kv_dtype), mesh)
            self._state = jax.device_put(SlotState.create(self.num_slots, cfg.vocab_size, self.max_context),
                                         sharding.replicated(mesh))
        self._slot_params: list[SamplingParams | None] = [None] * self.num_slots
        self._rng = np.random.default_rng()
        # Every slot's sampling settings, as the host packs them (repacked at each SlotSetup) and
        # as the device holds them: each prefill chunk takes the packed words with its tokens and
        # gives back the arrays, for the decode programs after it (a slot decodes only after its
        # prompt's last chunk). No transfer of their own ahead of a new prompt's first program.
        pack = self._pack_sampling()
        self._samp = jax.device_put(pack, None if mesh is None else sharding.replicated(mesh))
        # the outputs' sharding: in pinned host memory where there is some (a GPU) and asked for
        host = transfer.host_outputs(mesh) if engine_cfg.host_outputs else None
        # (a decode program's outputs placed there made its steps 26-30% slower on the H200)
        self._out_shardings = {"prefill": self._step_out_shardings(mesh, 4, host),
                               "prefill_full": self._step_out_shardings(mesh, 4, host),
                               "score": self._step_out_shardings(mesh, 4, host),
                               "decode": self._step_out_shardings(mesh, 3, None),
                               "copy": self._step_out_shardings(mesh, 2, None)}
        log.info("prefill outputs written to %s", "pinned host memory by the programs" if host else "device memory")
        self.context_buckets = engine_cfg.attention_buckets
        # Host mirror of SlotState.positions, to pick the attention bucket without a device sync.
        self._positions = np.zeros((self.num_slots,), np.int64)
        self._compiled: dict[tuple, Any] = {}
        self._masks: dict[tuple[int, ...], jax.Array] = {}  # _active_mask's
        # Constrained decoding (StepPlan.allowed): a one-step decode program takes each row's
        # allowed tokens as a [B, W] bitmask; this one, every bit set, where no row is constrained
        # (kept on the device: no transfer), and each prefill chunk carries its slot's row.
        self._mask_words = mask_words(cfg.vocab_size)
        self._free_row = np.full((self._mask_words,), -1, np.int32)
        self._no_tokens = np.zeros((self._mask_words,), np.int32)
        self._breaker_rows = [self._no_tokens] * self.num_slots  # each slot's request's DRY breakers
        self._free_rows = jax.device_put(np.full((self.num_slots, self._mask_words), -1, np.int32),
                                         None if mesh is None else sharding.replicated(mesh))
        # StepPlan.deferred (EngineConfig.constrained_overlap): one device only
        self.defers_allowed = mesh is None and engine_cfg.overlaps_constrained(jax.default_backend())
        # Lean sampling: where the deferred decode's two programs are built, the fused decode
        # program samples without llama.cpp's less common samplers (`sampling.sample_stateful`'s
        # llama_samplers: their conditionals slowed every GPU step), and a step with a slot that
        # asks for them runs those two programs instead (`_decode_apart`). The plain prefill
        # programs sample the first token without them too (decode ran slower after prefills
        # that ran them); a prompt's last chunk that needs them ends in the full sampler's
        # program of the smallest chunk size ("prefill_full", `_dispatch_prefill`).
        self._lean = self.defers_allowed
        self._llama_rows = np.zeros((self.num_slots,), bool)  # SamplingParams.uses_llama_samplers by slot
        # Speculative decode (model/speculative.py): requests verify drafts of their next tokens
        # in the rows idle slots leave.
        self._spec = None
        if engine_cfg.draft_max > 0:
            if not kernels.decode_takes_slots:
                raise ValueError("speculative decoding (draft_max > 0) needs a decode attention that takes each row's "
                                 "slot; the chosen one does not")
            if mesh is not None:
                raise ValueError("speculative decoding (draft_max > 0) runs on one device only")
            self._spec = Speculation(engine_cfg.draft_max, engine_cfg.ngram_max, engine_cfg.ngram_min)
        log.info("speculative decode: %s", "off" if self._spec is None else
                 f"up to {engine_cfg.draft_max} drafts a step from n-grams of {engine_cfg.ngram_min} to "
                 f"{engine_cfg.ngram_max} tokens")
        self._layouts: dict[tuple, tuple[np.ndarray, jax.Array] | None] = {}  # _spec_layout's
        # Per slot: prompts dispatched into it (a speculative step's correction of the host
        # positions applies only to the request it ran for).
        self._epochs = np.zeros((self.num_slots,), np.int64)
        # The drafts the device checked and accepted, steps dispatched past a request's end
        # included (the engine counts those its requests kept: StepOutput.drafts, .drafted).
        self.drafts_run = self.drafts_accepted = 0
        self.spec_steps = 0  # decode steps run by the speculative program
        # Per slot: its accepted drafts per speculative step, a moving average from DRAFT_GAIN_START
        # at each new prompt, and the decode steps since it last speculated
        # (EngineConfig.draft_min_gain).
        self._gain = np.full((self.num_slots,), DRAFT_GAIN_START)
        self._since_spec = np.zeros((self.num_slots,), np.int64)

    def _pack_sampling(self) -> sampling.SamplingArrays:
        """Every slot's sampling settings packed (`sampling.pack_sampling`), kept as the words the
        next prefill chunk carries (`_samp_words`, `_samp_layout`); returns the pack."""
        pack = sampling.pack_sampling(self._slot_params, self.engine_cfg.max_logit_bias)
        self._samp_words, self._samp_layout = transfer.pack_words(pack)
        return pack

    def _active_mask(self, slots: tuple[int, ...]) -> jax.Array:
        """The decode program's mask of busy slots, kept on the device for each set of slots seen
        (at most 256 sets): in the steady state, the same slots busy, a dispatch copies nothing
        to the device (each small copy costs host callbacks, model/transfer.py)."""
        mask = self._masks.get(slots)
        if mask is None:
            host = np.zeros((self.num_slots,), bool)
            host[list(slots)] = True
            if len(self._masks) >= 256:
                self._masks.clear()
            mask = self._masks[slots] = jax.device_put(host, None if self._mesh is None else sharding.replicated(self._mesh))
        return mask

    def _speculates(self, slot: int) -> bool:
        """Whether the slot's request checks drafts this step: its recent drafts paid
        (EngineConfig.draft_min_gain), or it has not tried for DRAFT_PROBE_STEPS decode steps."""
        return self._gain[slot] >= self.engine_cfg.draft_min_gain or self._since_spec[slot] >= DRAFT_PROBE_STEPS

    def _spec_layout(self, busy: tuple[int, ...]) -> tuple[np.ndarray, jax.Array] | None:
        """The speculative step's row layout for these busy slots (host copy, device copy), kept
        per set of busy slots and of those that may speculate (at most 256 sets); None where no
        slot gets a draft row: the plain decode runs."""
        caps = tuple(_draft_cap(self._slot_params[s], self._spec.draft_max) if self._speculates(s) else 0 for s in busy)
        key = (busy, caps)
        if key not in self._layouts:
            layout = speculative.layout_rows(self.num_slots, busy, caps)
            if len(self._layouts) >= 256:
                self._layouts.clear()
            self._layouts[key] = None if layout is None else (layout, jax.device_put(layout))
        return self._layouts[key]

    def _jitted(self, kind: str, attend: int, num_steps: int = 1, few_rows: bool = False):
        if kind == "spec":
            args = (self.cfg, self.kernels, self.max_top_logprobs, attend, self._spec)
            fn = (functools.partial(_multi_spec_decode_step, *args, num_steps, unroll=self._unroll_decode)
                  if num_steps > 1 else functools.partial(_spec_decode_step, *args, unroll=self._unroll_decode))
            return self._jit("decode", fn)
        if kind == "logits":
            fn = functools.partial(_decode_logits, self.cfg, self.kernels, attend, unroll=self._unroll_decode,
                                   few_rows=few_rows)
            return jax.jit(fn, donate_argnums=(1,))  # the cache
        if kind == "sample":
            return jax.jit(functools.partial(_sample_decode, self.max_top_logprobs),
                           donate_argnums=(0,))  # the slot state
        if kind == "decode" and num_steps > 1:
            fn = functools.partial(_multi_decode_step, self.cfg, self.kernels, self.max_top_logprobs, attend, num_steps,
                                   unroll=self._unroll_decode, few_rows=few_rows, llama_samplers=not self._lean)
            return self._jit(kind, fn)
        if kind == "decode":
            fn = functools.partial(_decode_step, self.cfg, self.kernels, self.max_top_logprobs, attend,
                                   unroll=self._unroll_decode, few_rows=few_rows, llama_samplers=not self._lean)
        elif kind == "copy":
            fn = functools.partial(_copy_prefix, attend, COPY_LAYERS)
        else:  # "prefill", "prefill_full", "score" (scored chunks are rare: always the full sampler)
            fn = functools.partial(_prefill_step, self.cfg, self.kernels, self.max_top_logprobs, attend,
                                   self._samp_layout, score=kind == "score",
                                   llama_samplers=kind != "prefill" or not self._lean)
        return self._jit(kind, fn)

    @staticmethod
    def _step_out_shardings(mesh: Mesh | None, num_results: int, outputs: Any) -> Any:
        """A step's out_shardings: (cache, state, ...) of `num_results`, the last its outputs,
        placed by `outputs`; None throughout: the compiler's choice."""
        if mesh is not None:
            cache, state, _ = sharding.step_out_shardings(mesh)
            return (cache, *[state] * (num_results - 2), outputs or state)
        return None if outputs is None else (*[None] * (num_results - 1), outputs)

    def _jit(self, kind: str, fn):
        """A step program: cache and state donated; over a mesh SPMD, XLA partitioning the step
        from the inputs' shardings."""
        if self._out_shardings[kind] is None:
            return jax.jit(fn, donate_argnums=(1, 2))
        return jax.jit(fn, donate_argnums=(1, 2), out_shardings=self._out_shardings[kind])

    def _example_args(self, kind: str, size: int, steps: int = 1) -> tuple:
        if kind == "logits":
            return (self.params, self._cache, self._state, self._active_mask(()))
        if kind == "sample":
            logits = jax.ShapeDtypeStruct((self.num_slots, self.cfg.vocab_size), jnp.float32)
            return (self._state, self._samp, self._active_mask(()), self._free_rows, logits)
        if kind == "decode" and steps == 1:  # one step: with the constrained rows' allowed tokens
            return (self.params, self._cache, self._state, self._samp, self._active_mask(()), self._free_rows)
        if kind == "decode":
            return (self.params, self._cache, self._state, self._samp, self._active_mask(()))
        if kind == "spec":
            return (self.params, self._cache, self._state, self._samp,
                    jnp.zeros((speculative.LAYOUT_ROWS, self.num_slots), jnp.int32))
        if kind == "copy":
            return (self.params, self._cache, self._state, jnp.zeros((2,), jnp.int32))
        extra = 1 if kind == "score" else 0  # the token after the chunk
        args = jnp.zeros((PREFILL_HEAD + self._samp_words.size + 2 * self._mask_words + size + extra,), jnp.int32)
        return (self.params, self._cache, self._state, args)

    def warmup(self) -> None:
        """Compiles every program the serving path can run: decode (once per decode-steps count)
        and one prefill per chunk size, each for every context bucket, and a prefix copy per
        bucket; on several threads where `EngineConfig.compile_workers` allows (XLA compiles
        without holding the GIL)."""
        targets = [("decode", self.num_slots, k) for k in self.decode_steps]
        targets += [("prefill", t, 1) for t in self.prefill_chunks]
        if self.scores_prompts:
            targets += [("score", t, 1) for t in self.prefill_chunks]
        if self._lean:
            targets += [("prefill_full", self.prefill_chunks[0], 1)]
        jobs = [(kind, size, steps, attend, False) for kind, size, steps in targets for attend in self.context_buckets]
        jobs += [("copy", attend, 1, attend, False) for attend in self.context_buckets]
        jobs += [("decode", self.num_slots, steps, attend, True) for steps in self.decode_steps
                 for attend in self.context_buckets if self._few_rows_limit(attend, steps)]
        if self._spec is not None:
            jobs += [("spec", self.num_slots, steps, attend, False) for steps in self.decode_steps
                     for attend in self.context_buckets]
        if self.defers_allowed:  # a deferred decode's two programs (StepPlan.deferred)
            jobs += [("logits", self.num_slots, 1, attend, few) for attend in self.context_buckets
                     for few in (False, True) if not few or self._few_rows_limit(attend, 1)]
            jobs += [("sample", self.num_slots, 1, 0, False)]
        workers = self.engine_cfg.compile_workers(jax.default_backend(), len(jobs))

        def build(job):
            kind, size, steps, attend, few_rows = job
            t0 = time.perf_counter()
            lowered = self._jitted(kind, attend, steps, few_rows).lower(*self._example_args(kind, size, steps))
            t1 = time.perf_counter()
            compiled = lowered.compile(compiler_options=self._compiler_options(kind))
            t2 = time.perf_counter()
            log.debug("compiled %s[%d]x%d attending %d%s in %.1f s (tracing and lowering %.1f s)", kind, size, steps,
                      attend, " (few rows)" if few_rows else "", t2 - t0, t1 - t0)
            return (kind, size, attend, steps, few_rows), compiled, (t1 - t0, t2 - t1)

        t_all = time.perf_counter()
        if workers > 1:
            pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
            try:
                built = list(pool.map(build, jobs))
            finally:  # a failed compile: the queued ones are dropped, not compiled first
                pool.shutdown(wait=True, cancel_futures=True)
        else:
            built = [build(job) for job in jobs]
        self._compiled.update((key, compiled) for key, compiled, _ in built)
        # each job's wall times, summed: on several threads they include waits for the GIL
        # (tracing and lowering hold it) and for the cores, so they exceed the work done
        lowering, compiling = (sum(times[i] for _, _, times in built) for i in (0, 1))
        log.info(
            "compiled %d step programs (decode[%d] x steps %s, prefill%s, prefix copies%s%s%s; context buckets %s) in "
            "%.1f s on %d thread(s); per-program wall times summed: tracing and lowering %.1f s, XLA compiling %.1f s",
            len(self._compiled), self.num_slots, list(self.decode_steps), list(self.prefill_chunks),
            "" if self._spec is None else ", speculative decode", ", scored prompt chunks" if self.scores_prompts else "",
            f", the full sampler's prefill[{self.prefill_chunks[0]}]" if self._lean else "", list(self.context_buckets),
            time.perf_counter() - t_all, workers, lowering, compiling,
        )

    def _compiler_options(self, kind: str) -> dict[str, str] | None:
        """XLA options of a program of `kind`: none but, on a GPU with
        EngineConfig.prefill_cuda_graphs off, no command buffers for the prefill programs."""
        if (kind in ("prefill", "prefill_full", "score") and not self.engine_cfg.prefill_cuda_graphs
                and jax.default_backend() == "gpu"):
            return {"xla_gpu_enable_command_buffer": ""}
        return None

    def _few_rows_limit(self, attend: int, steps: int) -> int:
        """The most busy slots for which decode runs its program with attention planned for few
        busy rows (Kernels.decode_few_rows_limit; 0: no such program). Only the steady state's
        program (the most steps per dispatch) has one: each costs a compile (about 10 s on the
        H200)."""
        return self.kernels.decode_few_rows_limit(attend) if steps == self.decode_steps[-1] else 0

    def _program(self, kind: str, size: int, attend: int, steps: int = 1, few_rows: bool = False):
        try:
            return self._compiled[(kind, size, attend, steps, few_rows)]
        except KeyError:
            raise RuntimeError(
                f"no compiled program for {kind}[{size}] x{steps} attending {attend}"
                f"{' for few rows' if few_rows else ''}: call warmup() first"
            ) from None

    def _bucket(self, end: int) -> int:
        """The smallest attention bucket holding positions [0, end)."""
        for b in self.context_buckets:
            if end <= b:
                return b
        return self.context_buckets[-1]

    def _chunk_size(self, n: int) -> int:
        for size in self.prefill_chunks:
            if n <= size:
                return size
        raise ValueError(f"prefill chunk of {n} tokens exceeds the largest compiled chunk {self.prefill_chunks[-1]}")

    def dispatch(self, plan: StepPlan):
        if plan.setups:
            for setup in plan.setups:
                sp = setup.sampling
                if sp.seed is None:
                    sp = dataclasses.replace(sp, seed=int(self._rng.integers(0, 2**63)))
                self._slot_params[setup.slot] = sp
                self._breaker_rows[setup.slot] = (sampling.token_bits(sp.dry_breaker_ids, self.vocab_size)
                                                  if sp.uses_dry else self._no_tokens)
                self._llama_rows[setup.slot] = sp.uses_llama_samplers
            self._pack_sampling()
        decode_out = None
        steps = plan.num_decode_steps
        allowed = self._allowed_rows(plan.allowed)
        # a constrained step runs the plain decode: the speculative program takes no allowed tokens
        layout = (None if self._spec is None or not plan.decode_slots or allowed or plan.deferred
                  else self._spec_layout(plan.decode_slots))
        if self._spec is not None and plan.decode_slots:
            drafting = np.zeros((self.num_slots,), bool)
            if layout is not None:
                drafting[layout[0][0][layout[0][1] >= 1]] = True
            self._since_spec[list(plan.decode_slots)] += steps
            self._since_spec[drafting] = 0
        if layout is not None:
            host_layout, dev_layout = layout
            self.spec_steps += steps
            rows = np.bincount(host_layout[0][host_layout[2] != 0], minlength=self.num_slots)  # rows per slot
            attend = self._bucket(int(self._positions[rows > 0].max()) + steps * int(rows.max()))
            self._cache, self._state, decode_out = self._program("spec", self.num_slots, attend, steps)(
                self.params, self._cache, self._state, self._samp, dev_layout)
            _start_copies(decode_out)
            self._positions += steps * rows  # at most; `_SpecPending` takes back what was not emitted
        elif plan.deferred:
            if not self.defers_allowed:
                raise ValueError("a plan with deferred slots for a runner that does not defer allowed tokens")
            active = np.zeros((self.num_slots,), bool)
            active[list(plan.decode_slots)] = True
            attend = self._bucket(int(self._positions[active].max()) + 1)
            few_rows = len(plan.decode_slots) <= self._few_rows_limit(attend, 1)
            # (its sampling runs after the step's prompt chunks: `parts` hands its decode tokens
            # over after them, where a plain step's come first)
            self._cache, logits = self._program("logits", self.num_slots, attend, 1, few_rows)(
                self.params, self._cache, self._state, self._active_mask(plan.decode_slots))
            self._positions[active] += 1
        elif plan.decode_slots:
            active = np.zeros((self.num_slots,), bool)
            active[list(plan.decode_slots)] = True
            attend = self._bucket(int(self._positions[active].max()) + steps)
            few_rows = len(plan.decode_slots) <= self._few_rows_limit(attend, steps)
            if self._lean and self._llama_rows[active].any():
                decode_out = self._decode_apart(plan.decode_slots, steps, attend, allowed)
            else:
                args = [self.params, self._cache, self._state, self._samp, self._active_mask(plan.decode_slots)]
                if steps == 1:
                    args.append(self._device_rows(allowed))
                program = self._program("decode", self.num_slots, attend, steps, few_rows)
                self._cache, self._state, decode_out = program(*args)
            _start_copies(decode_out)
            self._positions[active] += steps
        for copy in plan.copies:  # after the decode, whose tokens need not wait for them
            if not 0 < copy.num_tokens < self.max_context or copy.src == copy.dst:
                raise ValueError(f"prefix copy {copy} outside the context or onto its own slot")
            span = self._bucket(copy.num_tokens)
            self._cache, self._state = self._program("copy", span, span)(
                self.params, self._cache, self._state, np.asarray([copy.src, copy.dst], np.int32))
        epochs = self._epochs.copy()  # before the prefills: a prompt in a slot is a new request there
        prefill_outs = [self._dispatch_prefill(chunk, allowed.get(chunk.slot) if chunk.is_last else None)
                        for chunk in plan.prefills]
        if layout is not None:
            return _SpecPending(self, layout[0], decode_out, steps, epochs, prefill_outs, plan.decode_slots,
                                plan.prefills)
        if plan.deferred:
            return _DeferredPending(self, logits, allowed, plan, prefill_outs)
        return _Pending(self.num_slots, self.max_top_logprobs, decode_out, prefill_outs,
                        steps if decode_out is not None else 1, plan.decode_slots, plan.prefills)

    def _decode_apart(self, slots: tuple[int, ...], steps: int, attend: int, allowed: dict[int, np.ndarray]):
        """Decode steps of `slots` where one asks for llama.cpp's samplers that the lean decode
        program leaves out: the deferred decode's two programs (forward pass, then the full
        sampler) back to back, `steps` times; returns the outputs as the fused program's (several
        steps' as a list, which `_Pending` indexes as it does the fused program's stacked ones:
        stacking them here would compile a program after warm-up)."""
        few_rows = len(slots) <= self._few_rows_limit(attend, 1)
        mask = self._active_mask(slots)
        rows = self._device_rows(allowed)
        outs = []
        for _ in range(steps):
            self._cache, logits = self._program("logits", self.num_slots, attend, 1, few_rows)(
                self.params, self._cache, self._state, mask)
            self._state, out = self._program("sample", self.num_slots, 0)(self._state, self._samp, mask, rows, logits)
            outs.append(out)
        return outs[0] if steps == 1 else outs

    def _allowed_rows(self, pairs: Iterable[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
        """(slot, allowed-token row) pairs by slot, each row checked for its width."""
        rows = {}
        for slot, row in pairs:
            row = np.asarray(row)
            if row.shape != (self._mask_words,) or row.dtype != np.int32:
                raise ValueError(f"slot {slot}'s allowed tokens: an int32 row of {self._mask_words} words expected, "
                                 f"got {row.dtype} {row.shape}")
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"allowed tokens for slot {slot}, outside the {self.num_slots} slots")
            rows[int(slot)] = row
        return rows

    def _sample_deferred(self, logits: jax.Array, decode_slots: tuple[int, ...], rows: dict[int, np.ndarray]):
        """A deferred decode's second program, over the slot state as the programs dispatched
        since left it (the step's prompt chunks: other slots); returns its outputs."""
        self._state, out = self._program("sample", self.num_slots, 0)(
            self._state, self._samp, self._active_mask(decode_slots), self._device_rows(rows), logits)
        return _start_copies(out)

    def _device_rows(self, rows: dict[int, np.ndarray]) -> jax.Array:
        """A decode step's [B, W] allowed tokens: the constrained slots' rows, every bit elsewhere
        (no rows: the free rows kept on the device, no transfer)."""
        if not rows:
            return self._free_rows
        host = np.full((self.num_slots, self._mask_words), -1, np.int32)
        for slot, row in rows.items():
            host[slot] = row
        return jax.device_put(host, None if self._mesh is None else sharding.replicated(self._mesh))

    def _dispatch_prefill(self, chunk: PrefillChunk, allowed: np.ndarray | None = None):
        n = int(chunk.tokens.shape[0])
        if n < 1 or chunk.start_pos + n > self.max_context:
            raise ValueError(f"prefill chunk [{chunk.start_pos}, {chunk.start_pos + n}) outside the context")
        if chunk.score and not self.scores_prompts:
            raise ValueError("a scored prompt chunk for a runner built without prompt scoring (EngineConfig.prompt_logprobs)")
        kind = "score" if chunk.score else "prefill"
        if kind == "prefill" and chunk.is_last and self._lean and self._llama_rows[chunk.slot]:
            # the first token needs llama.cpp's samplers, which the plain programs leave out: the
            # prompt's last tokens go through the full sampler's program of the smallest chunk
            # size, those before them (then in the same step) through the plain one
            small = self.prefill_chunks[0]
            if n > small:
                self._dispatch_prefill(dataclasses.replace(chunk, tokens=chunk.tokens[:n - small], is_last=False))
                chunk = dataclasses.replace(chunk, tokens=chunk.tokens[n - small:],
                                            start_pos=chunk.start_pos + n - small)
                n = small
            kind = "prefill_full"
        size = self._chunk_size(n)
        padded = np.zeros((size + chunk.score,), np.int32)
        padded[:n] = chunk.tokens
        if chunk.score:
            padded[-1] = chunk.next_token
        attend = self._bucket(chunk.start_pos + n)
        self._positions[chunk.slot] = chunk.start_pos + n
        self._epochs[chunk.slot] += 1
        self._gain[chunk.slot], self._since_spec[chunk.slot] = DRAFT_GAIN_START, 0
        self._cache, self._state, self._samp, out = self._program(kind, size, attend)(
            self.params, self._cache, self._state,
            prefill_args(chunk.slot, padded, chunk.start_pos, n, chunk.is_last, self._samp_words,
                         self._free_row if allowed is None else allowed, self._breaker_rows[chunk.slot], chunk.reused),
        )
        return _start_copies(out)
