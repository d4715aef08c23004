"""Speculative decoding by prompt lookup: the device-side parts, pure functions.

A decode step of the fixed-shape engine runs all B rows whatever number of slots is busy, and on a
GPU a row costs next to nothing beside the weights every step reads (H200, Llama-2-7B Q4_0: 2.19 ms
a step with one busy row, 2.28 with eight). The rows of idle slots can therefore check guesses of
a busy slot's next tokens. The guesses (drafts) come from the request's own tokens, as llama.cpp's
and vLLM's n-gram ("prompt lookup") speculation takes them: where the last tokens occurred before,
the tokens that followed them then are drafted (`ngram_drafts`).

A step's rows are laid out on the host (`layout_rows`: each busy slot one row, the spare rows
to the slots that may speculate, at consecutive positions) and the step (`model.runner`) runs
them as one decode with each row naming its slot (`model.forward.decode(..., slots=)`): a slot's
row at position p + j holds draft j, and its keys are in the cache before any row attends. A
draft is accepted while it equals the token the row before it chose (`accept`); the slot then
emits that row's choice too. Each row computes bit for bit the logits a plain decode of its slot
at its position computes (the kernels' row invariance, tested), and chooses as that decode would:
greedy, or sampled with the slot's key at the row's own token index, penalties counting the drafts
before it (`precedes`). So every emitted token is exactly the one a plain decode would have
produced, for sampled requests too (a draft is kept when the draw picks it: fewer are than by
rejection sampling, but seeded streams stay reproducible), and a rejected draft's keys lie past
the slot's position, overwritten before they are read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LAYOUT_ROWS = 3  # layout_rows' rows: slot, offset, in use


def layout_rows(num_rows: int, busy: tuple[int, ...], caps: tuple[int, ...]) -> np.ndarray | None:
    """[3, num_rows] int32: per row its slot, its offset (0: the slot's next token; j >= 1: its
    draft j) and whether it is in use. Every busy slot takes one row; the rows left over go to
    the busy slots in turn, busy[i] at most caps[i] (0: it does not speculate). Rows are ordered
    by slot, then offset. None when no slot gets a draft row (a plain decode serves)."""
    if len(busy) > num_rows or len(caps) != len(busy):
        raise ValueError(f"{len(busy)} busy slots (caps {caps}) for {num_rows} rows")
    drafts = dict.fromkeys(busy, 0)
    cap = dict(zip(busy, caps))
    spare = num_rows - len(busy)
    order = [s for s in busy if cap[s] > 0]
    while spare and order:
        for s in list(order):
            if not spare:
                break
            drafts[s] += 1
            spare -= 1
            if drafts[s] >= cap[s]:
                order.remove(s)
    if not any(drafts.values()):
        return None
    out = np.zeros((LAYOUT_ROWS, num_rows), np.int32)
    r = 0
    for s in sorted(drafts):
        for j in range(drafts[s] + 1):
            out[:, r] = (s, j, 1)
            r += 1
    return out


def ngram_drafts(
    history: jax.Array,  # [B, S] int32: the token at each cache position (prompt and generated)
    tokens: jax.Array,  # [B] int32: each slot's next input token, at position `positions`
    positions: jax.Array,  # [B] int32: tokens already in the cache
    num_drafts: int,  # static
    ngram_max: int,  # static
    ngram_min: int,  # static
) -> tuple[jax.Array, jax.Array]:  # drafts [B, num_drafts] int32, how many of them hold a draft [B]
    """Per slot, the tokens that followed an earlier occurrence of its last n tokens (the next
    input token last), for the largest n in [ngram_min, ngram_max] that occurs; none (count 0)
    where no n does. A draft never runs past the next input token (only known tokens), so of
    the occurrences the one with the most tokens after it (up to num_drafts) is taken, the
    latest of those."""
    b, s = history.shape
    idx = jnp.arange(s)
    p = positions[:, None]
    seq = jnp.where(idx[None, :] == p, tokens[:, None], history)  # [B, S]: position p holds the next token
    run = jnp.ones((b, s), bool)
    length = jnp.zeros((b, s), jnp.int32)
    for t in range(ngram_max):
        at = idx - t  # candidate i's token t back, against the last n's
        last = jnp.take_along_axis(seq, jnp.clip(p - t, 0, s - 1), axis=1)  # [B, 1]
        there = jnp.take_along_axis(seq, jnp.broadcast_to(jnp.clip(at, 0, s - 1)[None, :], (b, s)), axis=1)
        run = run & (at >= 0)[None, :] & (p - t >= 0) & (there == last)
        length = length + run.astype(jnp.int32)
    usable = (idx[None, :] < p) & (length >= ngram_min)  # an earlier occurrence with a next token
    longest = jnp.max(jnp.where(usable, length, 0), axis=1, keepdims=True)
    # Of the longest matches, the one that gives the most drafts, then the latest: in a run of
    # one token or a short loop the latest occurrence lies a step or two back, with as few known
    # tokens after it, where an earlier one gives a full set of the same guesses.
    ahead = jnp.minimum(p - idx[None, :], num_drafts)
    score = jnp.where(usable & (length == longest), ahead * s + idx[None, :], -1)
    best = jnp.argmax(score, axis=1)
    found = jnp.max(score, axis=1) >= 0
    count = jnp.where(found, jnp.minimum(positions - best, num_drafts), 0).astype(jnp.int32)
    at = jnp.clip(best[:, None] + 1 + jnp.arange(num_drafts)[None, :], 0, s - 1)
    return jnp.take_along_axis(seq, at, axis=1).astype(jnp.int32), count


def accept(
    layout: jax.Array,  # [3, R] int32 (`layout_rows`)
    valid: jax.Array,  # [R] bool: the row ran (in use, its draft exists, inside the cache)
    inputs: jax.Array,  # [R] int32: the row's input token (the next token, or its draft)
    chosen: jax.Array,  # [R] int32: the token the row's logits chose
) -> jax.Array:  # [R] bool: the row's choice is emitted
    """A slot emits its offset-0 row's choice, and each later row's while every draft up to it
    equals the choice of the row before it (rows of a slot are consecutive, by offset)."""
    off = layout[1]
    prev = jnp.concatenate([chosen[:1], chosen[:-1]])
    ok = valid & (off >= 1) & (inputs == prev)  # draft j matched the choice at offset j - 1
    return valid & jnp.all(~precedes(layout) | ok[:, None], axis=0)


def precedes(layout: jax.Array) -> jax.Array:  # [R, R] bool
    """[q, r]: row q holds a draft of row r's slot at an offset up to r's (the tokens a plain
    decode would have generated before row r's choice, where the drafts are accepted)."""
    slot, off = layout[0], layout[1]
    return (slot[:, None] == slot[None, :]) & (off[:, None] >= 1) & (off[:, None] <= off[None, :])
