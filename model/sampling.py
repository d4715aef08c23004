"""Token sampling over per-slot arrays: penalties, logprobs, truncations, one seeded draw per slot.

`model.runner` packs each slot's `SamplingParams` with `pack_sampling` (host, numpy) when a
request is installed, keeps the `SamplingArrays` on the device, and calls `sample` inside its
jitted step on the step's logits. Every per-request setting is a traced [B] array, never a
static argument, so one compiled program serves any mix of requests; `num_top` (the engine's
`max_top_logprobs`) is the only static value.

Each row is computed independently of the others: a slot's token depends only on its own
logits, settings, counts, seed and token index, never on its neighbours or on B (batch
invariance; the scheduler's tests and reproducible seeds rely on it).

Constrained decoding (scheduler/grammar.py) passes each row's allowed tokens as a bitmask
(`allowed`, [B, W] int32, W = ceil(V / 32)): the tokens outside it get -inf after the penalties,
so the draw, the greedy argmax and the logprobs all see the constrained distribution.

The chain, llama.cpp's order but for the temperature: the logit bias, the repetition and
presence/frequency penalties (OpenAI's and vLLM's counts, or llama.cpp's over a window of
recent tokens), DRY and the allowed tokens (every row; the logprobs are of these logits); then,
for sampled rows, top-n-sigma, the temperature (or llama.cpp's dynamic temperature), top-k,
locally typical, top-p, min-p, XTC and the draw; or, for mirostat rows, the temperature and
mirostat (`sample_stateful`: the target surprise is each slot's state). llama.cpp applies the
temperature last; here, as in vLLM, the truncations see the tempered distribution.

Dimension letters: B slots, V vocabulary, N logit-bias entries per slot, L top logprobs, W mask
words.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.step_types import SamplingParams


_WHOLE_CONTEXT = 2**30  # the windows (dry_last_n, penalty_last_n) of a -1 setting: the whole context
DRY_MAX_MATCH = 128  # repeats are measured up to this many tokens (dry_base ** 126: the penalty has long saturated)


class TokenHistory(NamedTuple):
    """Each sampled row's tokens so far, for DRY and the windowed penalties: rows of the slot
    state's history (the row's input token, at `last`, is written in here: the state may not
    hold it yet), and the slots' DRY breaker tokens."""

    history: jax.Array  # [H, S] int32: the slots' tokens by position
    rows: jax.Array  # [R] int32: each sampled row's history row
    last: jax.Array  # [R] int32: the position of the row's input token (its logits predict the next)
    inputs: jax.Array  # [R] int32: the row's input token
    breakers: jax.Array  # [H, W] int32 bitmask (bit t % 32 of word t // 32): the slots' breaker tokens


class SamplingArrays(NamedTuple):
    """Per-slot sampling settings (a pytree of arrays; numpy from `pack_sampling`)."""

    temperature: jax.Array  # [B] f32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] f32; 1 = off
    min_p: jax.Array  # [B] f32; 0 = off
    repetition_penalty: jax.Array  # [B] f32; 1 = off
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    penalty_last_n: jax.Array  # [B] int32: llama.cpp's penalty window (the whole context: 2**30); 0 = OpenAI's
    typical_p: jax.Array  # [B] f32; 1 = off
    top_n_sigma: jax.Array  # [B] f32; <= 0 = off
    xtc_probability: jax.Array  # [B] f32; 0 = off
    xtc_threshold: jax.Array  # [B] f32; > 0.5 = off
    dynatemp_range: jax.Array  # [B] f32; 0 = off
    dynatemp_exponent: jax.Array  # [B] f32
    dry_multiplier: jax.Array  # [B] f32; 0 = off
    dry_base: jax.Array  # [B] f32
    dry_allowed_length: jax.Array  # [B] int32
    dry_last_n: jax.Array  # [B] int32: the window of positions DRY looks at (the whole context: 2**30)
    mirostat: jax.Array  # [B] int32: 0 = off, 1 or 2 = llama.cpp's mirostat version
    mirostat_tau: jax.Array  # [B] f32
    mirostat_eta: jax.Array  # [B] f32
    seed: jax.Array  # [B, 2] uint32: threefry key data (high word, low word of the 64-bit seed)
    bias_ids: jax.Array  # [B, N] int32; -1 = unused entry
    bias_values: jax.Array  # [B, N] f32
    # entries [ban_from, N) of a row are min_tokens' bans (-inf), in force while it has generated
    # fewer than `min_tokens` tokens (SamplingParams.min_tokens)
    ban_from: jax.Array  # [B] int32
    min_tokens: jax.Array  # [B] int32
    top_logprobs: jax.Array  # [B] int32: alternatives the row returns; 0 = none


def pack_sampling(
    params: Sequence[SamplingParams | None],
    max_bias: int,
    rng: np.random.Generator | None = None,
) -> SamplingArrays:
    """Packs one `SamplingParams` per slot (None: an unused slot, neutral greedy settings).

    A request without a seed gets one drawn from `rng` (default: fresh OS entropy), so two
    unseeded requests still sample differently. Pack once per request (at its `SlotSetup`):
    packing again would draw a new seed for unseeded requests.
    """
    num_slots = len(params)
    if max_bias < 0:
        raise ValueError("max_bias must be >= 0")
    temperature = np.zeros((num_slots,), np.float32)
    top_k = np.zeros((num_slots,), np.int32)
    top_p = np.ones((num_slots,), np.float32)
    min_p = np.zeros((num_slots,), np.float32)
    repetition = np.ones((num_slots,), np.float32)
    presence = np.zeros((num_slots,), np.float32)
    frequency = np.zeros((num_slots,), np.float32)
    penalty_last_n = np.zeros((num_slots,), np.int32)
    typical_p = np.ones((num_slots,), np.float32)
    top_n_sigma = np.zeros((num_slots,), np.float32)
    xtc_probability = np.zeros((num_slots,), np.float32)
    xtc_threshold = np.ones((num_slots,), np.float32)
    dynatemp_range = np.zeros((num_slots,), np.float32)
    dynatemp_exponent = np.ones((num_slots,), np.float32)
    dry_multiplier = np.zeros((num_slots,), np.float32)
    dry_base = np.ones((num_slots,), np.float32)
    dry_allowed_length = np.zeros((num_slots,), np.int32)
    dry_last_n = np.zeros((num_slots,), np.int32)
    mirostat = np.zeros((num_slots,), np.int32)
    mirostat_tau = np.zeros((num_slots,), np.float32)
    mirostat_eta = np.zeros((num_slots,), np.float32)
    seed = np.zeros((num_slots, 2), np.uint32)
    bias_ids = np.full((num_slots, max_bias), -1, np.int32)
    bias_values = np.zeros((num_slots, max_bias), np.float32)
    ban_from = np.zeros((num_slots,), np.int32)
    min_tokens = np.zeros((num_slots,), np.int32)
    top_logprobs = np.zeros((num_slots,), np.int32)
    for b, p in enumerate(params):
        if p is None:
            continue
        bans = p.min_tokens_ids if p.min_tokens else ()
        if len(p.logit_bias) + len(bans) > max_bias:
            raise ValueError(f"slot {b}: {len(p.logit_bias)} logit_bias entries and {len(bans)} min_tokens bans "
                             f"exceed the maximum {max_bias}")
        temperature[b] = p.temperature
        top_k[b] = min(p.top_k, _WHOLE_CONTEXT)  # (past any vocabulary: all of it)
        top_p[b] = p.top_p
        min_p[b] = p.min_p
        repetition[b] = p.repetition_penalty
        presence[b] = p.presence_penalty
        frequency[b] = p.frequency_penalty
        if p.penalty_last_n == 0:  # llama.cpp's: no penalties
            repetition[b], presence[b], frequency[b] = 1.0, 0.0, 0.0
        elif p.uses_penalty_window:
            penalty_last_n[b] = _WHOLE_CONTEXT if p.penalty_last_n < 0 else min(p.penalty_last_n, _WHOLE_CONTEXT)
        typical_p[b], top_n_sigma[b] = p.typical_p, p.top_n_sigma
        xtc_probability[b], xtc_threshold[b] = p.xtc_probability, p.xtc_threshold
        dynatemp_range[b], dynatemp_exponent[b] = p.dynatemp_range, p.dynatemp_exponent
        mirostat[b], mirostat_tau[b], mirostat_eta[b] = p.mirostat, p.mirostat_tau, p.mirostat_eta
        if p.uses_dry:
            dry_multiplier[b], dry_base[b] = p.dry_multiplier, p.dry_base
            dry_allowed_length[b] = min(p.dry_allowed_length, _WHOLE_CONTEXT)
            dry_last_n[b] = _WHOLE_CONTEXT if p.dry_penalty_last_n < 0 else min(p.dry_penalty_last_n, _WHOLE_CONTEXT)
        top_logprobs[b] = p.top_logprobs
        s = p.seed
        if s is None:
            rng = rng if rng is not None else np.random.default_rng()
            s = int(rng.integers(0, 2**63))
        seed[b] = (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF
        for i, (token, value) in enumerate((*p.logit_bias, *((t, -np.inf) for t in bans))):
            bias_ids[b, i] = token
            bias_values[b, i] = value
        ban_from[b], min_tokens[b] = len(p.logit_bias), p.min_tokens
    return SamplingArrays(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        penalty_last_n=penalty_last_n,
        typical_p=typical_p,
        top_n_sigma=top_n_sigma,
        xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold,
        dynatemp_range=dynatemp_range,
        dynatemp_exponent=dynatemp_exponent,
        dry_multiplier=dry_multiplier,
        dry_base=dry_base,
        dry_allowed_length=dry_allowed_length,
        dry_last_n=dry_last_n,
        mirostat=mirostat,
        mirostat_tau=mirostat_tau,
        mirostat_eta=mirostat_eta,
        seed=seed,
        bias_ids=bias_ids,
        bias_values=bias_values,
        ban_from=ban_from,
        min_tokens=min_tokens,
        top_logprobs=top_logprobs,
    )


def token_bits(ids: Sequence[int], vocab: int) -> np.ndarray:
    """The [W] int32 bitmask (bit t % 32 of word t // 32) of the tokens `ids`."""
    bits = np.zeros((-(-vocab // 32) * 32,), bool)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32).reshape(-1)


def for_rows(arrays: SamplingArrays, rows: jax.Array) -> SamplingArrays:
    """The settings with every row outside `rows` ([B] bool) made neutral: greedy, no truncation,
    no alternatives. A finished request's settings stay in its slot until the slot is reused;
    neutral, they no longer switch on a step's conditional work (the random draw, the sort for
    top-k/top-p, the top-k of the alternatives) for a row whose output is discarded."""
    return arrays._replace(
        temperature=jnp.where(rows, arrays.temperature, 0.0),
        top_k=jnp.where(rows, arrays.top_k, 0),
        top_p=jnp.where(rows, arrays.top_p, 1.0),
        typical_p=jnp.where(rows, arrays.typical_p, 1.0),
        dry_multiplier=jnp.where(rows, arrays.dry_multiplier, 0.0),
        penalty_last_n=jnp.where(rows, arrays.penalty_last_n, 0),
        mirostat=jnp.where(rows, arrays.mirostat, 0),
        top_logprobs=jnp.where(rows, arrays.top_logprobs, 0),
    )


def apply_penalties(
    logits: jax.Array,  # [B, V] f32
    arrays: SamplingArrays,
    prompt_mask: jax.Array,  # [B, V] bool
    output_counts: jax.Array,  # [B, V] int32
    step_index: jax.Array | None = None,  # [B] int32: tokens generated so far (min_tokens' bans); None: 0
) -> jax.Array:  # [B, V] f32
    """Logit bias (min_tokens' bans with it), then the repetition penalty (HF/vLLM), then
    presence/frequency (OpenAI)."""
    num_rows = logits.shape[0]
    generated_so_far = jnp.zeros((num_rows,), jnp.int32) if step_index is None else step_index
    in_force = (jnp.arange(arrays.bias_ids.shape[1])[None, :] < arrays.ban_from[:, None]) | (
        generated_so_far < arrays.min_tokens)[:, None]
    used = (arrays.bias_ids >= 0) & in_force
    # Unused entries add 0 to column 0, which leaves it unchanged.
    ids = jnp.where(used, arrays.bias_ids, 0)
    values = jnp.where(used, arrays.bias_values, 0.0).astype(logits.dtype)
    logits = logits.at[jnp.arange(num_rows)[:, None], ids].add(values, mode="drop")

    generated = output_counts > 0
    seen = prompt_mask | generated
    rep = arrays.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)

    logits = logits - arrays.presence_penalty[:, None] * generated.astype(logits.dtype)
    return logits - arrays.frequency_penalty[:, None] * output_counts.astype(logits.dtype)


def _bits(words: jax.Array, vocab: int) -> jax.Array:  # [B, W] int32 -> [B, V] bool
    """Bit t % 32 of word t // 32 for each token t."""
    bits = jnp.right_shift(words[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


def apply_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:  # [B, V] f32, [B, W] int32
    """-inf for every token whose bit is clear (bit t % 32 of word t // 32 for token t)."""
    return jnp.where(_bits(allowed, logits.shape[1]), logits, -jnp.inf)


def _rows_so_far(ctx: TokenHistory) -> jax.Array:  # [R, S] int32
    """Each row's history row with its input token at `last` (stale past it)."""
    return ctx.history[ctx.rows].at[jnp.arange(ctx.rows.shape[0]), ctx.last].set(ctx.inputs, mode="drop")


def apply_window_penalties(logits: jax.Array, arrays: SamplingArrays, ctx: TokenHistory) -> jax.Array:  # [R, V]
    """llama.cpp's penalties, for rows with a `penalty_last_n` window (others unchanged): over
    the counts c of each token in the row's last `penalty_last_n` tokens of prompt and output, a
    seen token's logit is divided by the repetition penalty (multiplied where not positive), then
    loses c * frequency_penalty + presence_penalty."""
    num_rows, vocab = logits.shape
    tokens = _rows_so_far(ctx)
    pos = jnp.arange(tokens.shape[1])[None, :]
    last = ctx.last[:, None]
    in_window = (pos <= last) & (pos > last - arrays.penalty_last_n[:, None])
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[jnp.arange(num_rows)[:, None], tokens].add(
        in_window.astype(jnp.int32), mode="drop")
    seen = counts > 0
    rep = arrays.repetition_penalty[:, None]
    out = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - arrays.frequency_penalty[:, None] * counts - arrays.presence_penalty[:, None] * seen
    return jnp.where((arrays.penalty_last_n > 0)[:, None], out, logits)


def apply_dry(logits: jax.Array, arrays: SamplingArrays, ctx: TokenHistory) -> jax.Array:  # [R, V] f32
    """llama.cpp's DRY penalty, for rows with `dry_multiplier` > 0 (others unchanged).

    Over the row's window (its last `dry_last_n` positions up to `last`): the repeat limit is
    the number of tokens after the window's last breaker token (all of them without one). For
    each earlier position j, the match length is how many tokens before and at j equal those
    before and at `last`, one for one, within the window and the limit (at most DRY_MAX_MATCH).
    The token after j, unless a breaker itself, would extend a repeat of that length; at
    lengths of at least `dry_allowed_length` it loses multiplier * base ** (length - allowed) of
    its logit (the exponent held where base ** exponent nears float32's largest value), the
    longest of its repeats counted.
    """
    num_rows, vocab = logits.shape
    size = ctx.history.shape[1]
    history = _rows_so_far(ctx)
    breakers = ctx.breakers[ctx.rows]  # [R, W]
    last = ctx.last[:, None]
    pos = jnp.arange(size)[None, :]
    low = jnp.maximum(last + 1 - arrays.dry_last_n[:, None], 0)
    in_window = (pos >= low) & (pos <= last)
    word = jnp.take_along_axis(breakers, history // 32, axis=1)
    is_breaker = (jnp.right_shift(word, history % 32) & 1) != 0  # [R, S]
    last_breaker = jnp.max(jnp.where(in_window & is_breaker, pos, -1), axis=1, keepdims=True)
    limit = jnp.where(last_breaker >= 0, last - last_breaker, last - low + 1)  # [R, 1]
    starts = in_window & (pos < last)  # j: an earlier position, its next token within the window
    # Offsets k = 0..DRY_MAX_MATCH-1 at once ([R, S, K], one fused gather; no loop: on the GPU a
    # loop inside the step's conditional cannot go into its CUDA graph, and the decode step
    # waited on the host for it, 4.2 ms a step against 2.4 on an H100): the token at j - k
    # against the one at last - k, while both stay within the window and the limit.
    k = jnp.arange(DRY_MAX_MATCH)
    padded = jnp.pad(history, ((0, 0), (DRY_MAX_MATCH, 0)), constant_values=-1)
    before = jnp.take(padded, DRY_MAX_MATCH + jnp.arange(size)[:, None] - k[None, :], axis=1)  # token at j - k
    at_end = jnp.take_along_axis(history, jnp.maximum(last - k[None, :], 0), axis=1)  # [R, K]: token at last - k
    alive = ((before == at_end[:, None, :]) & (pos[:, :, None] - k >= low[:, :, None])
             & (k < limit[:, :, None]) & starts[:, :, None])
    # the match length: how many offsets from 0 on match, one after the other
    length = jnp.where(jnp.all(alive, axis=2), DRY_MAX_MATCH, jnp.argmin(alive, axis=2)).astype(jnp.int32)
    allowed_length = arrays.dry_allowed_length[:, None]
    following = jnp.roll(history, -1, axis=1)  # the token after each position
    counted = jnp.where(starts & (length >= allowed_length), length, -1)
    longest = jnp.full((num_rows, vocab), -1, jnp.int32).at[jnp.arange(num_rows)[:, None], following].max(
        counted, mode="drop")
    base = arrays.dry_base[:, None]
    most = jnp.where(base > 1.000001, jnp.floor(88.7228391 / jnp.log(jnp.maximum(base, 1.000001))), jnp.inf)
    exponent = jnp.minimum((longest - allowed_length).astype(jnp.float32), most)
    penalty = arrays.dry_multiplier[:, None] * jnp.power(base, exponent)
    applies = (longest >= 0) & ~_bits(breakers, vocab) & (arrays.dry_multiplier[:, None] > 0)
    return jnp.where(applies, logits - penalty, logits)


def _typical_set(
    ordered: jax.Array,  # [B, V] f32, descending
    in_k: jax.Array,  # [B, V] bool: within the row's top-k
    typical_p: jax.Array,  # [B] f32
) -> jax.Array:  # [B, V] bool, in `ordered`'s order
    """Locally typical sampling's set (llama.cpp's `typical`): over the top-k's renormalised
    probabilities, the tokens whose surprise (-log p) is nearest the entropy, taken in that
    order while the mass before them is at most `typical_p`."""
    num_rows = ordered.shape[0]
    logp = jax.nn.log_softmax(jnp.where(in_k, ordered, -jnp.inf), axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1, keepdims=True)
    shifted = jnp.where(p > 0, jnp.abs(-logp - entropy), jnp.inf)
    typical_order = jnp.argsort(shifted, axis=-1, stable=True)
    typical_probs = jnp.take_along_axis(p, typical_order, axis=-1)
    before = jnp.cumsum(typical_probs, axis=-1) - typical_probs
    keep = (before <= typical_p[:, None]) | (typical_p[:, None] >= 1.0)
    return jnp.zeros(ordered.shape, jnp.bool_).at[jnp.arange(num_rows)[:, None], typical_order].set(keep)


def _truncate(
    scaled: jax.Array,  # [B, V] f32, temperature applied
    top_k: jax.Array,  # [B] int32
    top_p: jax.Array,  # [B] f32
    typical_p: jax.Array,  # [B] f32
    is_active: jax.Array,  # [B] bool: the row wants top_k, typical_p or top_p
    cond,  # None: no row asks for typical_p
) -> jax.Array:  # [B, V]
    """Masks tokens outside each row's top-k, then outside its locally typical set, then outside
    its top-p nucleus, each on the mass the one before left (one full sort; a second sort, by
    surprise, and an argsort only in steps where some row asks for typical_p).

    Rows that do not ask for it come back bit-identical, so a row's result does not depend on
    whether a neighbour made this branch run.
    """
    num_rows, vocab = scaled.shape
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    in_k = jnp.arange(vocab)[None, :] < k
    uses_typical = is_active & (typical_p < 1.0)

    def nucleus(ordered, kept):  # of the kept tokens (in descending order), those top-p keeps
        probs = jax.nn.softmax(jnp.where(kept, ordered, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # top_p == 1 keeps everything: a cumulative sum rounding up to 1 must not cut the tail.
        return kept & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))

    def below_last_kept(x, ordered, keep):  # keep a prefix of the order: mask below its last value
        num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # [B]
        threshold = jnp.take_along_axis(ordered, (num_keep - 1)[:, None], axis=-1)  # [B, 1]
        return jnp.where(x < threshold, -jnp.inf, x)

    def plain(x):
        ordered = -jnp.sort(-x, axis=-1)
        return below_last_kept(x, ordered, nucleus(ordered, in_k))

    def typical(x):  # the typical set is no prefix of the order: its mask goes back through the argsort
        order = jnp.argsort(-x, axis=-1, stable=True)
        ordered = jnp.take_along_axis(x, order, axis=-1)
        keep = nucleus(ordered, in_k & _typical_set(ordered, in_k, typical_p))
        removed = jnp.zeros(x.shape, jnp.bool_).at[jnp.arange(num_rows)[:, None], order].set(~keep)
        return jnp.where(uses_typical[:, None], jnp.where(removed, -jnp.inf, x), below_last_kept(x, ordered, keep))

    masked = plain(scaled) if cond is None else cond(jnp.any(uses_typical), typical, plain, scaled)
    return jnp.where(is_active[:, None], masked, scaled)


def _top_n_sigma(logits: jax.Array, n: jax.Array) -> jax.Array:  # [B, V] f32, [B] f32
    """llama.cpp's top-n-sigma: -inf below the largest logit less n standard deviations of the
    row's finite logits (the same mask at any temperature); rows with n <= 0 unchanged."""
    finite = jnp.isfinite(logits)
    count = jnp.maximum(jnp.sum(finite, axis=-1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(finite, logits, 0.0), axis=-1, keepdims=True) / count
    std = jnp.sqrt(jnp.sum(jnp.where(finite, jnp.square(logits - mean), 0.0), axis=-1, keepdims=True) / count)
    floor = jnp.max(logits, axis=-1, keepdims=True) - n[:, None] * std
    return jnp.where((n[:, None] > 0) & (logits < floor), -jnp.inf, logits)


def _dynamic_temperature(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:  # [B, V] -> [B]
    """Each row's temperature; with `dynatemp_range` r > 0 (llama.cpp's dynamic temperature),
    low + (high - low) * (H / log n) ** exponent, low = max(T - r, 0) and high = T + r, by the
    normalised entropy H / log n of the row's distribution over its n finite logits."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    count = jnp.sum(jnp.isfinite(logits), axis=-1)
    normalised = jnp.where(count > 1, entropy / jnp.log(jnp.maximum(count, 2).astype(jnp.float32)), 0.0)
    low = jnp.maximum(arrays.temperature - arrays.dynatemp_range, 0.0)
    high = arrays.temperature + arrays.dynatemp_range
    dynamic = low + (high - low) * jnp.power(jnp.clip(normalised, 0.0, 1.0), arrays.dynatemp_exponent)
    return jnp.where(arrays.dynatemp_range > 0, jnp.maximum(dynamic, 1e-6), arrays.temperature)


def _exclude_top_choices(scaled: jax.Array, arrays: SamplingArrays, chance: jax.Array) -> jax.Array:
    """llama.cpp's XTC: where the row's draw `chance` ([B], uniform in [0, 1)) is below
    `xtc_probability` and two or more tokens have probability >= `xtc_threshold` (at most 0.5),
    all of those but the least likely (the lowest id of a tie) become -inf."""
    threshold = arrays.xtc_threshold[:, None]
    # (the tokens earlier samplers removed have probability 0: never above, even a threshold of 0)
    above = (jax.nn.softmax(scaled, axis=-1) >= threshold) & jnp.isfinite(scaled)
    kept = jnp.argmin(jnp.where(above, scaled, jnp.inf), axis=-1)  # the least likely (one of a tie)
    on = (chance < arrays.xtc_probability) & (arrays.xtc_threshold <= 0.5) & (jnp.sum(above, axis=-1) >= 2)
    removed = above & (jnp.arange(scaled.shape[1])[None, :] != kept[:, None])
    return jnp.where(on[:, None] & removed, -jnp.inf, scaled)


_MIROSTAT_M = 100  # mirostat 1: the most likely tokens its Zipf exponent is estimated from (llama.cpp's m)


def _mirostat_keep(tempered: jax.Array, arrays: SamplingArrays, mu: jax.Array, cond) -> jax.Array:  # [B, V] bool
    """llama.cpp's mirostat truncation of each row's tempered logits, by the row's target
    surprise `mu` ([B], bits). Version 2 keeps the tokens of surprise -log2 p at most mu (the
    most likely always). Version 1 estimates the distribution's Zipf exponent s from its 100
    most likely tokens and keeps the top k = (e 2^mu / (1 - V^-e))^(1/s), e = s - 1. The
    version 1 sort runs only in steps where some row asks for it."""
    num_rows, vocab = tempered.shape
    logp = jax.nn.log_softmax(tempered, axis=-1)
    keep_v2 = (-logp / jnp.log(2.0) <= mu[:, None]) | (tempered >= jnp.max(tempered, axis=-1, keepdims=True))

    def version_1(x):
        ordered = -jnp.sort(-x, axis=-1)
        i = jnp.arange(vocab - 1, dtype=jnp.float32)[None, :]
        t = jnp.log((i + 2) / (i + 1))
        b = ordered[:, :-1] - ordered[:, 1:]  # log(p_i / p_(i+1))
        counted = (i < _MIROSTAT_M - 1) & jnp.isfinite(b)
        s_hat = jnp.sum(jnp.where(counted, t * b, 0.0), axis=-1) / jnp.sum(jnp.where(counted, t * t, 0.0), axis=-1)
        e = s_hat - 1
        ratio = jnp.where(jnp.abs(e) < 1e-6, 1 / jnp.log(float(vocab)), e / (1 - jnp.power(float(vocab), -e)))
        k = jnp.power(ratio * jnp.power(2.0, mu), 1 / s_hat)
        k = jnp.clip(jnp.nan_to_num(k, nan=1.0, posinf=float(vocab)), 1, vocab).astype(jnp.int32)
        return x >= jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)

    keep_v1 = cond(jnp.any(arrays.mirostat == 1), version_1, lambda x: jnp.ones(x.shape, jnp.bool_), tempered)
    return jnp.where((arrays.mirostat == 1)[:, None], keep_v1, keep_v2)


def sample(
    logits: jax.Array,  # [B, V]
    arrays: SamplingArrays,
    prompt_mask: jax.Array,  # [B, V] bool: token occurs in the prompt
    output_counts: jax.Array,  # [B, V] int32: times each token was generated
    step_index: jax.Array,  # [B] int32: index of the token being sampled within its request
    num_top: int,  # static: number of top alternatives returned
    skip_unused: bool = True,  # static: conditionals skip what no row needs (see below)
    allowed: jax.Array | None = None,  # [B, W] int32: each row's allowed tokens (None: all)
    history: TokenHistory | None = None,  # the rows' tokens so far (None: see `sample_stateful`)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`sample_stateful` for rows without mirostat (their target surprise starts at 2 tau each
    call): (tokens, logprob, top_ids, top_logprobs)."""
    mu = 2 * arrays.mirostat_tau
    return sample_stateful(logits, arrays, prompt_mask, output_counts, step_index, num_top, mu, skip_unused, allowed,
                           history)[:4]


def sample_stateful(
    logits: jax.Array,  # [B, V]
    arrays: SamplingArrays,
    prompt_mask: jax.Array,  # [B, V] bool: token occurs in the prompt
    output_counts: jax.Array,  # [B, V] int32: times each token was generated
    step_index: jax.Array,  # [B] int32: index of the token being sampled within its request
    num_top: int,  # static: number of top alternatives returned
    mu: jax.Array,  # [B] f32: each row's mirostat target surprise (SlotState.mu)
    skip_unused: bool = True,  # static: conditionals skip what no row needs (see below)
    allowed: jax.Array | None = None,  # [B, W] int32: each row's allowed tokens (None: all)
    history: TokenHistory | None = None,  # the rows' tokens so far, for DRY and the penalty windows
    llama_samplers: bool = True,  # static: False leaves out those `SamplingParams.uses_llama_samplers` names
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (tokens [B] int32, logprob [B] f32, top_ids [B, L] int32, top_logprobs [B, L] f32,
    mu [B] f32: the target surprise after this token, changed in sampled mirostat rows only).
    Without `history`, DRY and a penalty window are skipped (a window row gets no penalties):
    the runner always passes it.
    Only rows whose `arrays.top_logprobs` is > 0 get alternatives (the others get the padding,
    id 0 and -inf), and the top-k runs only in steps where some row asked (always with
    `skip_unused=False`).

    Logprobs are the log-softmax of the penalised logits, before temperature and truncation.
    Greedy rows (temperature 0) take exactly the argmax of the penalised logits. Sampled rows
    draw with the key fold_in(key(seed[b]), step_index[b]).

    `skip_unused=False` computes the draw, the truncation sort and the top-k always, with the
    same results: no conditionals. On the GPU, XLA runs a conditional inside a CUDA graph on the
    device, but one it cannot capture (the prefill program's, after its layer loop) on the host,
    which then waits for the device to reach it: the call blocks for the whole step. For the
    prefill step's one row, the skipped work is small beside that.

    `llama_samplers=False` leaves out the penalty windows, DRY, top-n-sigma, the dynamic
    temperature, typical_p, XTC and mirostat (`SamplingParams.uses_llama_samplers`; the caller
    makes sure no row asks for them), with the same results for the other rows. Even skipped,
    their conditionals cost every GPU decode step (the CUDA graph holds every branch): the
    engine decoded a 7B Q4_0 model at 374.7 / 1,466 / 2,841 tok/s (1 / 4 / 8 users, H100) with
    them in its fused program against 388 / 1,511-1,520 / 2,887-2,899 without, so the runner's
    lean decode program goes without them.
    """

    def cond(pred, true_fn, false_fn, operand):
        if skip_unused:
            return jax.lax.cond(pred, true_fn, false_fn, operand)
        # The true branch alone gives the same outputs: the draw keeps greedy rows' argmax, the
        # truncation leaves the rows that did not ask unchanged, and the top-k's rows that did
        # not ask are masked to the padding after.
        return true_fn(operand)

    windowed = arrays.penalty_last_n > 0  # llama.cpp's penalties, in place of the others (below)
    logits = apply_penalties(logits.astype(jnp.float32), arrays._replace(
        repetition_penalty=jnp.where(windowed, 1.0, arrays.repetition_penalty),
        presence_penalty=jnp.where(windowed, 0.0, arrays.presence_penalty),
        frequency_penalty=jnp.where(windowed, 0.0, arrays.frequency_penalty)), prompt_mask, output_counts, step_index)
    # (the window's counts and DRY's match lengths run only in steps where some row asks)
    if history is not None and llama_samplers:
        logits = cond(jnp.any(windowed), lambda x: apply_window_penalties(x, arrays, history), lambda x: x, logits)
        logits = cond(jnp.any(arrays.dry_multiplier > 0), lambda x: apply_dry(x, arrays, history), lambda x: x, logits)
    if allowed is not None:
        logits = apply_allowed(logits, allowed)
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = arrays.temperature <= 0

    def draw(_: None) -> tuple[jax.Array, jax.Array]:
        # llama.cpp's samplers run only in steps where some row asks for them (rows that do not
        # come back unchanged), so a plain sampled decode does not pay for them
        sigma = arrays.top_n_sigma
        truncated, temperature = logits, arrays.temperature
        if llama_samplers:
            truncated = cond(jnp.any(~is_greedy & (sigma > 0)), lambda x: _top_n_sigma(x, sigma), lambda x: x, logits)
            temperature = cond(jnp.any(~is_greedy & (arrays.dynatemp_range > 0)),
                               lambda x: _dynamic_temperature(x, arrays), lambda _: temperature, truncated)
        temperature = jnp.where(is_greedy, 1.0, temperature)
        scaled = truncated / temperature[:, None]
        typical_p = arrays.typical_p if llama_samplers else jnp.ones_like(arrays.typical_p)
        wants_sort = ~is_greedy & ((arrays.top_k > 0) | (arrays.top_p < 1.0) | (typical_p < 1.0))
        # The full-vocabulary sort (V up to 262k, every step) runs only when a row needs it.
        scaled = cond(
            jnp.any(wants_sort),
            lambda x: _truncate(x, arrays.top_k, arrays.top_p, typical_p, wants_sort, cond if llama_samplers else None),
            lambda x: x,
            scaled,
        )
        # min_p in logit space: p < min_p * p_max  <=>  logit < max_logit + log(min_p).
        floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(arrays.min_p)[:, None]
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
        keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"),
                                                               index))(arrays.seed, step_index)
        uses_xtc = ~is_greedy & (arrays.xtc_probability > 0) & (arrays.xtc_threshold <= 0.5)
        # mirostat rows: the temperature, then mirostat in place of the truncations above (llama.cpp's chain)
        uses_mirostat = ~is_greedy & (arrays.mirostat > 0)

        def mirostat(x):
            tempered = logits / jnp.where(is_greedy, 1.0, arrays.temperature)[:, None]
            kept = jnp.where(_mirostat_keep(tempered, arrays, mu, cond), tempered, -jnp.inf)
            return jnp.where(uses_mirostat[:, None], kept, x)

        def moved(operand):  # mu moves by eta times the drawn token's surprise (under the kept tokens) less tau
            x, token = operand
            drawn = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), token[:, None], axis=-1)[:, 0]
            error = -drawn / jnp.log(2.0) - arrays.mirostat_tau
            return jnp.where(uses_mirostat & jnp.isfinite(error), mu - arrays.mirostat_eta * error, mu)

        if llama_samplers:
            scaled = cond(jnp.any(uses_xtc), lambda x: _exclude_top_choices(x, arrays, jax.vmap(
                lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)), lambda x: x, scaled)
            scaled = cond(jnp.any(uses_mirostat), mirostat, lambda x: x, scaled)
        sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        new_mu = cond(jnp.any(uses_mirostat), moved, lambda _: mu, (scaled, sampled)) if llama_samplers else mu
        return jnp.where(is_greedy, greedy_tokens, sampled), new_mu

    # An all-greedy batch skips the random draw over the vocabulary altogether.
    tokens, mu = cond(~jnp.all(is_greedy), draw, lambda _: (greedy_tokens, mu), None)
    token_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    num_rows, vocab = logits.shape
    top_logprobs = jnp.full((num_rows, num_top), -jnp.inf, jnp.float32)
    top_ids = jnp.zeros((num_rows, num_top), jnp.int32)
    if num_top > 0:
        # A vocabulary smaller than num_top (toy models) pads with (id 0, -inf). The top-k (sorts
        # over the vocabulary: ~0.09 ms of a 7B decode step on the H200) runs only in steps where
        # some row asked for alternatives; a row that did not ask always gets the padding (so a
        # row's outputs never depend on its neighbours).
        k = min(num_top, vocab)
        wants = arrays.top_logprobs > 0
        values, ids = cond(
            jnp.any(wants),
            lambda lp: tuple(jax.lax.top_k(lp, k)),
            lambda lp: (jnp.full((num_rows, k), -jnp.inf, lp.dtype), jnp.zeros((num_rows, k), jnp.int32)),
            logprobs,
        )
        top_logprobs = top_logprobs.at[:, :k].set(jnp.where(wants[:, None], values, -jnp.inf))
        top_ids = top_ids.at[:, :k].set(jnp.where(wants[:, None], ids.astype(jnp.int32), 0))
    return tokens, token_logprob, top_ids, top_logprobs, mu


def update_counts(
    output_counts: jax.Array,  # [B, V] int32
    tokens: jax.Array,  # [B] int32
    valid: jax.Array,  # [B] bool: the row sampled a real token this step
) -> jax.Array:  # [B, V] int32
    """Adds each valid row's sampled token to its generated-token counts."""
    rows = jnp.arange(tokens.shape[0])
    return output_counts.at[rows, tokens].add(valid.astype(output_counts.dtype), mode="drop")
