"""A dispatched step's outputs on their way to the host (`model.runner`'s `PendingStep`s): the
plain step's (`_Pending`, whole or in parts), a deferred constrained step's (`_DeferredPending`,
sampled once its allowed tokens are supplied) and a speculative step's (`_SpecPending`, one
output per token offset, which also gives the runner back the positions not emitted and keeps
its per-slot draft gains).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from model.step_types import PrefillChunk, PromptScores, SamplingParams, StepOutput, StepPlan

if TYPE_CHECKING:
    from model.runner import ModelRunner


def _unpack_outputs(a: np.ndarray) -> tuple[np.ndarray, ...]:
    """(tok, flag, lp, top_ids, top_lps) of a host copy of `_pack_outputs`' array."""
    k = (a.shape[-1] - 3) // 2
    as_f32 = lambda x: np.array(x, np.int32).view(np.float32)  # noqa: E731  (a copy: contiguous, 0-d kept)
    return a[..., 0], a[..., 1] != 0, as_f32(a[..., 2]), a[..., 3:3 + k], as_f32(a[..., 3 + k:])



class _Pending:
    def __init__(self, num_slots: int, num_top: int, decode_out: Any, prefill_outs: list[Any], num_steps: int = 1,
                 decode_slots: tuple[int, ...] = (), prefills: tuple[PrefillChunk, ...] = ()) -> None:
        self._num_slots, self._num_top = num_slots, num_top
        self._decode_out, self._prefill_outs = decode_out, prefill_outs
        self._num_steps = num_steps  # > 1: decode_out is stacked [num_steps, ...] (or a list of num_steps)
        self._decode_slots, self._prefills = decode_slots, prefills  # the plan's, for parts()
        self._results: list[StepOutput] | None = None

    def _empty(self) -> StepOutput:
        return StepOutput.empty(self._num_slots, self._num_top)

    @staticmethod
    def _fill_decode(out: StepOutput, decode_out: np.ndarray) -> None:
        """One decode step's `_pack_outputs` row per slot into `out` (active slots only)."""
        tok, active, lp, top_ids, top_lps = _unpack_outputs(decode_out)
        out.tokens[active] = tok[active]
        out.valid[active] = True
        out.logprobs[active] = lp[active]
        out.top_ids[active] = top_ids[active]
        out.top_logprobs[active] = top_lps[active]

    def _fill_prefill(self, out: StepOutput, prefill_out: np.ndarray, chunk: PrefillChunk) -> None:
        """A chunk's sampled first token into `out` (its slot, then `_pack_outputs`' row;
        nothing where not is_last), and a scored chunk's rows (`_prefill_step`) into its scores."""
        width = 3 + 2 * self._num_top
        slot = int(prefill_out[0])
        tok, is_last, lp, top_ids, top_lps = _unpack_outputs(prefill_out[1:1 + width])
        if is_last:
            out.tokens[slot], out.valid[slot], out.logprobs[slot] = tok, True, lp
            out.top_ids[slot], out.top_logprobs[slot] = top_ids, top_lps
        if chunk.score:  # the last chunk's last row predicts the sampled token: not a prompt token's
            at = 1 + width
            pooled = np.array(prefill_out[at + 1:at + 1 + int(prefill_out[at])], np.int32).view(np.float32)
            rows = prefill_out[at + 1 + len(pooled):].reshape(-1, width)[:len(chunk.tokens) - chunk.is_last]
            _, _, lps, ids, top = _unpack_outputs(rows)
            total, last = np.split(pooled, 2)
            out.scores.append(PromptScores(slot, chunk.start_pos + 1, lps, rows[:, 1].copy(), ids, top, total, last,
                                           len(chunk.tokens)))

    def results(self) -> list[StepOutput]:
        if self._results is not None:
            return self._results
        decode_out, prefill_outs = jax.device_get((self._decode_out, self._prefill_outs))  # one sync
        if self._num_steps > 1:
            outs = []
            for i in range(self._num_steps):
                out = self._empty()
                self._fill_decode(out, decode_out[i])
                outs.append(out)
            self._results = outs
            return outs
        out = self._empty()
        if decode_out is not None:
            self._fill_decode(out, decode_out)
        for chunk, prefill_out in zip(self._prefills, prefill_outs):
            self._fill_prefill(out, prefill_out, chunk)
        self._results = [out]
        return self._results

    def result(self) -> StepOutput:
        return self.results()[0]

    def parts(self):
        """([StepOutput, ...], slots) as the device finishes them: the decode part (one output
        per decode step of the program), then each chunk that ends its prompt, in the order they
        were dispatched. Each part waits only for its own program, so a step's decode tokens
        reach the host while its prompt chunks still run, and a first token while the chunks
        after it run. Outputs are meaningful for their part's slots only."""
        if self._results is not None or self._num_steps > 1 or not self._prefill_outs:
            yield self.results(), self._decode_slots + tuple(c.slot for c in self._prefills if c.is_last)
            return
        if self._decode_out is not None:
            out = self._empty()
            self._fill_decode(out, jax.device_get(self._decode_out))
            yield [out], self._decode_slots
        yield from self._prefill_parts()

    def _prefill_parts(self):
        """`parts()`' tail: each chunk that ends its prompt, its first token, and each scored
        chunk, its scores (a chunk that does not end its prompt: for no slot's token)."""
        for chunk, prefill_out in zip(self._prefills, self._prefill_outs):
            if not chunk.is_last and not chunk.score:
                continue  # samples nothing: no wait
            out = self._empty()
            self._fill_prefill(out, jax.device_get(prefill_out), chunk)
            yield [out], (chunk.slot,) if chunk.is_last else ()


class _DeferredPending(_Pending):
    """A dispatched step whose decode waits for allowed tokens (StepPlan.deferred): the forward
    pass and the prompt chunks run; `supply(rows)` dispatches the sampling. Read it only after:
    the runner dispatches nothing else that touches the slot state in between (the engine's
    order: dispatch, read the step before, supply)."""

    def __init__(self, runner: "ModelRunner", logits: Any, allowed: dict[int, np.ndarray], plan: StepPlan,
                 prefill_outs: list[Any]) -> None:
        super().__init__(runner.num_slots, runner.max_top_logprobs, None, prefill_outs, 1, plan.decode_slots,
                         plan.prefills)
        self._runner, self._logits, self._allowed = runner, logits, allowed
        self.deferred: tuple[int, ...] = plan.deferred  # the slots whose rows `supply` takes; () once supplied

    def supply(self, rows: dict[int, np.ndarray]) -> None:
        """The deferred slots' allowed tokens ([W] int32 each): dispatches the sampling."""
        if not self.deferred:
            raise RuntimeError("this step's allowed tokens were already supplied")
        if set(rows) != set(self.deferred):
            raise ValueError(f"allowed tokens for slots {sorted(rows)}, deferred {sorted(self.deferred)}")
        merged = dict(self._allowed)
        merged.update(self._runner._allowed_rows(rows.items()))
        self._decode_out = self._runner._sample_deferred(self._logits, self._decode_slots, merged)
        self._logits, self.deferred = None, ()

    def results(self) -> list[StepOutput]:
        if self.deferred:
            raise RuntimeError("a deferred step read before its allowed tokens were supplied")
        return super().results()

    def parts(self):
        if self.deferred:
            raise RuntimeError("a deferred step read before its allowed tokens were supplied")
        return super().parts()


# The speculative decode's per-slot moving average of accepted drafts per step
# (EngineConfig.draft_min_gain): its value at a new prompt (speculate at first), the weight of
# each step, and the decode steps after which a slot below the bar speculates once again (at the
# first dispatch that reaches them: with --decode-steps 3, every fourth dispatch).
DRAFT_GAIN_START = 1.0
DRAFT_GAIN_WEIGHT = 0.3
DRAFT_PROBE_STEPS = 8


def _draft_cap(sp: SamplingParams | None, draft_max: int) -> int:
    """The most drafts a request checks per step: the engine's draft_max, or the request's own
    below it; none with DRY, a penalty window or mirostat (a draft row's tokens so far would be
    its slot's and the drafts before it, which the step does not assemble; its target surprise,
    the one after them)."""
    if sp is None or sp.uses_dry or sp.uses_penalty_window or sp.mirostat:
        return 0
    return draft_max if sp.draft_max is None else min(draft_max, sp.draft_max)


class _SpecPending(_Pending):
    """A dispatched step whose decode was speculative: its decode part comes as one output per
    (decode step, offset) that some slot emitted a token at, each meaningful for those slots;
    then the prompts' first tokens as in `_Pending`. Reading it also gives the runner back the
    host positions it counted for tokens not emitted, and counts the drafts run and accepted."""

    def __init__(self, runner: "ModelRunner", layout: np.ndarray, decode_out: Any, num_steps: int,
                 epochs: np.ndarray, prefill_outs: list[Any], decode_slots: tuple[int, ...],
                 prefills: tuple[PrefillChunk, ...]) -> None:
        super().__init__(runner.num_slots, runner.max_top_logprobs, decode_out, prefill_outs, num_steps,
                         decode_slots, prefills)
        self._runner, self._layout, self._epochs = runner, layout, epochs
        self._decode_parts: list[tuple[StepOutput, tuple[int, ...]]] | None = None

    def _empty(self) -> StepOutput:
        return StepOutput.empty(self._num_slots, self._num_top, drafts=True)

    def _decoded(self) -> list[tuple[StepOutput, tuple[int, ...]]]:
        if self._decode_parts is not None:
            return self._decode_parts
        out = np.asarray(jax.device_get(self._decode_out))
        if self._num_steps == 1:
            out = out[None]
        slot, off, used = self._layout[0], self._layout[1], self._layout[2] != 0
        tok, _, lp, top_ids, top_lps = _unpack_outputs(out)  # [steps, R, ...]
        flag = out[..., 1]
        emitted, drafted = (flag & 1) != 0, (flag & 2) != 0
        runner = self._runner
        parts = []
        for i in range(self._num_steps):
            checked = np.bincount(slot[drafted[i]], minlength=runner.num_slots)  # drafts per slot at step i
            for j in range(int(off.max()) + 1):
                rows = np.flatnonzero(emitted[i] & (off == j))
                if not rows.size:
                    continue
                o, slots = self._empty(), slot[rows]
                o.tokens[slots], o.valid[slots], o.logprobs[slots] = tok[i, rows], True, lp[i, rows]
                o.top_ids[slots], o.top_logprobs[slots] = top_ids[i, rows], top_lps[i, rows]
                o.drafted[slots] = j >= 1
                if j == 0:
                    o.drafts[slots] = checked[slots]
                parts.append((o, tuple(int(s) for s in slots)))
        runner.drafts_run += int(drafted.sum())
        runner.drafts_accepted += int((emitted & (off >= 1)).sum())
        counted = self._num_steps * np.bincount(slot[used], minlength=runner.num_slots)
        made = np.bincount(np.broadcast_to(slot, emitted.shape)[emitted], minlength=runner.num_slots)
        same = runner._epochs == self._epochs  # no new prompt in the slot since
        runner._positions[same] -= (counted - made)[same]
        # each drafting slot's accepted drafts per step, into its moving average
        drafting = np.zeros((runner.num_slots,), bool)
        drafting[slot[used & (off >= 1)]] = True
        drafting &= same
        for i in range(self._num_steps):
            kept = np.bincount(slot[emitted[i] & (off >= 1)], minlength=runner.num_slots)
            runner._gain[drafting] += DRAFT_GAIN_WEIGHT * (kept[drafting] - runner._gain[drafting])
        self._decode_parts = parts
        return parts

    def results(self) -> list[StepOutput]:
        if self._results is None:
            outs = [o for o, _ in self._decoded()] or [self._empty()]
            for chunk, prefill_out in zip(self._prefills, jax.device_get(self._prefill_outs)):
                self._fill_prefill(outs[0], prefill_out, chunk)
            self._results = outs
        return self._results

    def parts(self):
        for o, slots in self._decoded():
            yield [o], slots
        yield from self._prefill_parts()
