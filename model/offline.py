"""Offline use of the model without the engine thread: batch generation through a
`ModelRunner` (prompts prefilled in fixed chunks, then decoded together), and teacher-forced
scoring of a given continuation (the logits that choose each of its tokens), which the
llama.cpp agreement test and bench/agreement.py use."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model import forward

from model.step_types import PrefillChunk, PrefixCopy, SamplingParams, SlotSetup, StepPlan

GREEDY = SamplingParams(temperature=0.0)


def generate(runner, prompts: list[list[int]], num_tokens: int, slots: list[int] | None = None,
             sampling: SamplingParams | Sequence[SamplingParams] = GREEDY, stop_ids: frozenset[int] = frozenset(),
             reused: list[int] | None = None, copies: tuple[PrefixCopy, ...] = ()) -> list[list[int]]:
    """Generates up to `num_tokens` tokens for each prompt, each in its own slot, all at once.
    `reused[i]`: prompt i's first tokens already in its slot's cache (`PrefillChunk.reused`, a
    multiple of the largest chunk), which are not prefilled again; `copies` put them there first.
    `sampling`: every prompt's, or one per prompt."""
    slots = slots if slots is not None else list(range(len(prompts)))
    reused = reused if reused is not None else [0] * len(prompts)
    chunk = runner.prefill_chunks[-1]
    out: list[list[int]] = [[] for _ in prompts]
    each = [sampling] * len(slots) if isinstance(sampling, SamplingParams) else list(sampling)
    setups = tuple(SlotSetup(s, sp) for s, sp in zip(slots, each, strict=True))
    prefills = []
    for s, ids, kept in zip(slots, prompts, reused):
        if kept % chunk or not 0 <= kept < len(ids):
            raise ValueError(f"{kept} reused tokens: not a multiple of {chunk} below the prompt's {len(ids)}")
        for start in range(kept, len(ids), chunk):
            piece = np.asarray(ids[start:start + chunk], np.int32)
            prefills.append(PrefillChunk(s, piece, start, start + chunk >= len(ids), kept))
    res = runner.dispatch(StepPlan(setups=setups, copies=copies, prefills=tuple(prefills))).result()
    live = []
    for i, s in enumerate(slots):
        out[i].append(int(res.tokens[s]))
        if out[i][-1] not in stop_ids and num_tokens > 1:
            live.append(i)
    while live:
        # a speculative step (model/speculative.py) gives a slot several tokens: one output each
        outs = runner.dispatch(StepPlan(decode_slots=tuple(slots[i] for i in live))).results()
        if any(not outs[0].valid[slots[i]] for i in live):
            raise RuntimeError(f"slots {[slots[i] for i in live if not outs[0].valid[slots[i]]]} produced no token")
        nxt = []
        for i in live:
            for res in outs:
                if res.valid[slots[i]] and out[i][-1] not in stop_ids and len(out[i]) < num_tokens:
                    out[i].append(int(res.tokens[slots[i]]))
            if out[i][-1] not in stop_ids and len(out[i]) < num_tokens:
                nxt.append(i)
        live = nxt
    return out


def first_divergence(ours: list[int], ref: list[int]) -> int:
    """How many tokens of `ours` equal `ref`'s before the first that differs."""
    n = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        n += 1
    return n


def teacher_forced_logits(cfg, kernels, params, cases: list[tuple[list[int], list[int]]],
                          max_context: int, chunks: tuple[int, ...] = (64, 512),
                          kv_dtype=jnp.float32) -> list[np.ndarray]:
    """For each (prompt, continuation), the logits [len(continuation), V] that choose each
    continuation token, feeding the given tokens (not our own picks) after the prompt.

    A prompt is prefilled in pieces of the largest of `chunks`, the last piece in the smallest
    chunk that holds it, each attending only the power-of-two prefix of the cache that holds
    the padded chunk's positions: a short prompt costs a short chunk, not a padded 512-token
    one over the whole cache (each (chunk, prefix) pair is one compile)."""

    chunks = tuple(sorted(chunks))
    num_slots = len(cases)
    cache = forward.KVCache.create(cfg, num_slots, max_context, jnp.dtype(kv_dtype))
    prefill, decode = _forced_programs(cfg, kernels)
    out: list[list[np.ndarray]] = [[] for _ in cases]
    for s, (prompt, _) in enumerate(cases):
        start = 0
        while start < len(prompt):
            chunk = next((c for c in chunks if c >= len(prompt) - start), chunks[-1])
            piece = prompt[start:start + chunk]
            toks = np.zeros((chunk,), np.int32)
            toks[:len(piece)] = piece
            logits, cache = prefill(params, cache, jnp.int32(s), jnp.asarray(toks), jnp.int32(start),
                                    jnp.int32(len(piece)), _prefix(start + chunk, max_context))
            start += len(piece)
        out[s].append(np.asarray(logits))
    steps = max(len(cont) for _, cont in cases)
    # Attention reads only a power-of-two prefix of the cache that holds every position.
    attend = _prefix(max(512, max(len(p) + len(c) for p, c in cases)), max_context)
    for j in range(1, steps):
        toks = np.zeros((num_slots,), np.int32)
        pos = np.full((num_slots,), -1, np.int32)
        for s, (prompt, cont) in enumerate(cases):
            if j < len(cont):
                toks[s], pos[s] = cont[j - 1], len(prompt) + j - 1
        logits, cache = decode(params, cache, jnp.asarray(toks), jnp.asarray(pos), attend)
        logits = np.asarray(logits)
        for s, (_, cont) in enumerate(cases):
            if j < len(cont):
                out[s].append(logits[s])
    return [np.stack(rows) for rows in out]


@functools.lru_cache(maxsize=8)
def _forced_programs(cfg, kernels) -> tuple[Callable, Callable]:
    """`teacher_forced_logits`' jitted prefill and decode, one pair per (config, kernels): a
    later call with the same model and shapes runs what an earlier one compiled."""
    prefill = jax.jit(functools.partial(forward.prefill, cfg, kernels), donate_argnums=(1,), static_argnums=(6,))
    decode = jax.jit(functools.partial(forward.decode, cfg, kernels), donate_argnums=(1,), static_argnums=(4,))
    return prefill, decode


def _prefix(n: int, max_context: int) -> int:
    """The smallest power of two >= n, at most max_context."""
    return min(1 << max(0, n - 1).bit_length(), max_context)


def compare_top_logits(cases: list[dict], logits: list[np.ndarray], decisive_margin: float) -> dict:
    """Our teacher-forced logits (`teacher_forced_logits`) against a reference's recorded top
    logits per step (`case["top_logits"]`: [(id, logit), ...], best first, as
    tests/fixtures/record_generation.py writes them). Counts steps, steps whose argmax is the
    reference's top-1, decisive steps (its top-1 ahead of its top-2 by more than
    `decisive_margin`) and those of them that agree, and gives every step's largest |logit
    difference| over the reference's ids (`diffs`)."""
    steps = top1 = decisive = agree = 0
    diffs = []
    for case, lg in zip(cases, logits):
        if not np.isfinite(lg).all():
            raise ValueError(f"non-finite logits for the case of prompt length {len(case['prompt_ids'])}")
        for j, ref in enumerate(case["top_logits"]):
            ids, values = [i for i, _ in ref], np.array([v for _, v in ref])
            hit = int(np.argmax(lg[j])) == ids[0]
            steps += 1
            top1 += hit
            if values[0] - values[1] > decisive_margin:
                decisive += 1
                agree += hit
            diffs.append(float(np.max(np.abs(lg[j][ids] - values))))
    return {"steps": steps, "top1": top1, "decisive": decisive, "decisive_agree": agree, "diffs": np.array(diffs)}
