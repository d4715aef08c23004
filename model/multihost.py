"""Serving from several processes (hosts) after `jax.distributed.initialize`.

Every process holds its shards of the model and runs the same SPMD step programs, and each
program must be entered by all of them in the same order with the same host inputs. Process 0
runs the scheduler (and the HTTP server): its runner is wrapped in `LeaderRunner`, which sends
each `StepPlan` to the other processes before running it. Every other process runs `follow`,
which receives the plans and runs them on its own `ModelRunner` until the leader closes.

The plan travels pickled, through `jax.experimental.multihost_utils.broadcast_one_to_all` (a
length, then the bytes padded to a power of two, so that only a few broadcast shapes compile).
Seeds the plan leaves open are drawn by the leader before it sends the plan, so every process
samples with the same ones. Pickle is safe here: the bytes only come from process 0 of the
same job.

Limits: every step waits for the broadcast (a device collective) before it is dispatched, so
the leader loses the overlap of host work with the previous step (and `--dispatch-ahead` more
than 1 queues nothing more). A process that fails or dies
(process 0 failing to load its model included) leaves the others waiting in a collective:
restart the whole job. Releasing them would need a channel outside the device collectives
(the distributed runtime's key-value store), since a failing process may be at any point of
the others' collective sequence (tried: a broadcast sent when process 0's load failed was
matched by a collective of the follower's own load and hung it).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from model.step_types import StepOutput, StepPlan, mask_words

log = logging.getLogger(__name__)

_MIN_PAYLOAD = 256  # bytes: the smallest padded broadcast
_WARM_PAYLOAD = 1 << 16  # broadcast sizes up to this one, beside the allowed-token rows, are compiled in warmup


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's `payload` on every process (the others pass None). A collective: every
    process must call it, in the same order as the others."""
    is_source = jax.process_index() == 0
    if is_source and payload is None:
        raise ValueError("process 0 must send a payload")
    n = np.array([len(payload) if is_source else 0], np.int32)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(n, is_source=is_source))[0])
    size = max(_MIN_PAYLOAD, 1 << max(0, n - 1).bit_length())
    buf = np.zeros((size,), np.uint8)
    if is_source:
        buf[:n] = np.frombuffer(payload, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_source))
    return buf[:n].tobytes()


def max_plan_bytes(runner: Any) -> int:
    """A bound on a pickled plan's size: _WARM_PAYLOAD (a plan's tokens and settings are far
    smaller) beside every slot's allowed-token row (constrained decoding: ceil(V / 32) words)."""
    return _WARM_PAYLOAD + runner.num_slots * 4 * mask_words(runner.vocab_size)


def warm_broadcasts(max_payload: int = _WARM_PAYLOAD) -> None:
    """Compiles the broadcasts of every padded size up to `max_payload` (a collective sequence
    that every process runs in warmup, with the same bound), so that serving compiles nothing."""
    size = _MIN_PAYLOAD
    while size < max_payload * 2:
        broadcast_bytes(bytes(size) if jax.process_index() == 0 else None)
        size *= 2


def with_seeds(plan: StepPlan, rng: np.random.Generator) -> StepPlan:
    """The plan with a drawn seed in every slot setup that has none (what ModelRunner.dispatch
    would draw itself, drawn once here for every process)."""
    if not any(s.sampling.seed is None for s in plan.setups):
        return plan
    setups = tuple(
        s if s.sampling.seed is not None
        else dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, seed=int(rng.integers(0, 2**63))))
        for s in plan.setups
    )
    return dataclasses.replace(plan, setups=setups)


class LeaderRunner:
    """Process 0's StepModel: sends each plan to the followers, then runs it on its own runner.
    `close()` (the engine calls it when it stops) ends the followers."""

    def __init__(self, runner: Any, rng: np.random.Generator | None = None) -> None:
        self._runner = runner
        self.num_slots = runner.num_slots
        self.max_context = runner.max_context
        self.prefill_chunks = runner.prefill_chunks
        self.max_top_logprobs = runner.max_top_logprobs
        self.decode_steps = runner.decode_steps
        self.vocab_size = runner.vocab_size
        self.dispatch_ahead = getattr(runner, "dispatch_ahead", 1)
        self.scores_prompts = getattr(runner, "scores_prompts", False)  # PrefillChunk.score
        self._rng = rng if rng is not None else np.random.default_rng()
        self._closed = False

    def warmup(self) -> None:
        self._runner.warmup()  # compiling is local to each process: followers compile their own
        warm_broadcasts(max_plan_bytes(self._runner))

    def dispatch(self, plan: StepPlan):
        if self._closed:
            raise RuntimeError("the leader runner is closed")
        plan = with_seeds(plan, self._rng)
        broadcast_bytes(pickle.dumps(plan))
        return self._runner.dispatch(plan)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            broadcast_bytes(pickle.dumps(None))


def follow(runner: Any, on_step: Callable[[StepPlan, list[StepOutput]], None] | None = None,
           after_warmup: Callable[[], None] | None = None) -> int:
    """Runs the leader's plans on `runner` (compiled first) until the leader closes; returns the
    number of steps run. `on_step` sees each plan and its outputs (tests compare them with the
    leader's); `after_warmup` runs once the programs are compiled, before the first plan (the
    engine's heap freeze: a follower's GC pause stalls the leader's step through the broadcast)."""
    runner.warmup()
    warm_broadcasts(max_plan_bytes(runner))
    if after_warmup is not None:
        after_warmup()
    log.info("process %d: following process 0's step plans", jax.process_index())
    steps = 0
    while True:
        plan = pickle.loads(broadcast_bytes(None))
        if plan is None:
            log.info("process %d: the leader closed after %d steps", jax.process_index(), steps)
            return steps
        outputs = runner.dispatch(plan).results()  # waits: errors surface here, memory stays flat
        if on_step is not None:
            on_step(plan, outputs)
        steps += 1
