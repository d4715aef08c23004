"""Fakes for the scheduler tests: a StepModel with hand-computable tokens and a byte tokenizer.

`FakeModel`: the token sampled after input t is (t + 1) % V, for prefills (t = the prompt's
last token) and decodes alike, so a prompt ending in 'a' generates "bcd...". With
`context_tokens` it is instead a hash of every token its slot's cache holds at positions
[0, position) (what prefills, decodes and prefix copies wrote there, or None where nothing did),
so a request that reuses a prompt prefix gets a cold request's tokens only if the cache really
held that prefix. It checks the runner contract (setups before chunks, chunks in order from the reused
prefix, decodes only after the last chunk), records every plan, and can delay results (a device
still running) or fail on a chosen step.

A scored prompt chunk (`PrefillChunk.score`, prompt logprobs) gives each prompt token it
predicts, at position p, the logprob `fake_score(token, p)`, rank 1 + token % 5, and as
alternatives token + i (logprob minus i); the scores travel in the step's first output (its
first part).

With a plan's `allowed` rows (constrained decoding) it takes instead the first allowed token at
or after (t + 1) % V, counting around the vocabulary; with `defers_allowed`, a plan's deferred
slots sample when their rows are supplied, and it checks that nothing is dispatched before.

`ByteTokenizer`: token id = byte (0..255); 256 is EOS, 257 another special token.
"""

from __future__ import annotations

import codecs
import dataclasses
import sys
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from model.config import EngineConfig
from model.step_types import PromptScores, StepOutput, StepPlan
from scheduler.engine import Engine

EOS = 256
OTHER_SPECIAL = 257
VOCAB = 258


class ByteTokenizer:
    vocab_size = VOCAB
    eog_ids = frozenset({EOS})
    bos_id = None
    eos_id = EOS

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < VOCAB:
            raise ValueError(f"token id {token_id} out of range")
        return bytes([token_id]) if token_id < 256 else b""

    def piece_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        return self.token_bytes(token_id)

    def strips_leading_space(self, ids) -> bool:
        return False

    def tokens_containing(self, texts) -> tuple[int, ...]:  # DRY's sequence breakers
        return tuple(t for t in range(256) if any(text.encode() in bytes([t]) for text in texts if text))

    def decode(self, ids, skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class ByteDetokenizer:
    """IncrementalDetokenizer's shape: holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: ByteTokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def fake_score(token: int, position: int) -> float:
    """FakeModel's logprob of a prompt token at a position (scored chunks)."""
    return -(token % 10) / 10 - position / 1000


def fake_hidden(token: int, position: int) -> np.ndarray:
    """FakeModel's normed last hidden state [4] of a prompt token at a position (pooled by
    scored chunks: embeddings)."""
    return np.asarray([token, position, (token * position) % 7, 1], np.float32)


class _FakePending:
    def __init__(self, outputs: list[StepOutput], ready_at: float, gate: threading.Event | None) -> None:
        self._outputs, self._ready_at, self._gate = outputs, ready_at, gate

    def results(self) -> list[StepOutput]:
        if self._gate is not None:
            self._gate.wait()
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self._outputs

    def result(self) -> StepOutput:
        return self.results()[0]


class _FakePartsPending(_FakePending):
    """Hands a step over in parts, as the runner does (`parts`): the decode part at once, then
    each prompt's first token, which waits for `prefill_gate` (a prompt chunk still running).
    The whole step (`results`) waits for it too, as a device's whole step would."""

    def __init__(self, outputs: list[StepOutput], ready_at: float, gate: threading.Event | None, plan: StepPlan,
                 prefill_gate: threading.Event | None) -> None:
        super().__init__(outputs, ready_at, gate)
        self._plan, self._prefill_gate = plan, prefill_gate

    def _wait_for_prefill(self) -> None:
        if self._prefill_gate is not None and any(c.is_last for c in self._plan.prefills):
            self._prefill_gate.wait()

    def results(self) -> list[StepOutput]:
        outs = super().results()
        self._wait_for_prefill()
        return outs

    def parts(self):
        outs = super().results()
        yield outs, self._plan.decode_slots
        outs = [dataclasses.replace(o, scores=[]) for o in outs]  # (the first part carried them)
        for chunk in self._plan.prefills:
            if chunk.is_last:
                self._wait_for_prefill()
                yield outs, (chunk.slot,)


class _FakeDeferredPending(_FakePending):
    """A step whose deferred slots sample at `supply` (StepPlan.deferred)."""

    def __init__(self, outputs: list[StepOutput], ready_at: float, gate: threading.Event | None, model: "FakeModel",
                 inputs: dict[int, int], plan: StepPlan) -> None:
        super().__init__(outputs, ready_at, gate)
        self._model, self._inputs, self._plan = model, inputs, plan
        self.deferred = tuple(inputs)

    def supply(self, rows: dict) -> None:
        assert self.deferred and set(rows) == set(self.deferred), f"rows {sorted(rows)} for {self.deferred}"
        for slot, last in self._inputs.items():
            self._model._sample(self._outputs[0], slot, last, rows[slot])
        self.deferred = ()

    def results(self) -> list[StepOutput]:
        assert not self.deferred, "a deferred step read before its rows were supplied"
        return super().results()



class _FakeDeferredPartsPending(_FakeDeferredPending):
    """The same, handed over in parts (the model's `parts`)."""

    def parts(self):
        assert not self.deferred, "a deferred step read before its rows were supplied"
        outs = super().results()
        yield outs, self._plan.decode_slots
        for chunk in self._plan.prefills:
            if chunk.is_last:
                yield outs, (chunk.slot,)


class FakeModel:
    def __init__(
        self,
        num_slots: int = 8,
        max_context: int = 256,
        prefill_chunks: tuple[int, ...] = (4, 8),
        max_top_logprobs: int = 3,
        *,
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        gate: threading.Event | None = None,
        decode_steps: tuple[int, ...] = (1,),
        parts: bool = False,
        prefill_gate: threading.Event | None = None,
        dispatch_ahead: int | None = None,
        context_tokens: bool = False,
        defers_allowed: bool = False,
        scores_prompts: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.decode_steps = decode_steps
        # programs the engine queues beyond the one it reads (None: the `dispatch_ahead` fixture's)
        self.dispatch_ahead = _dispatch_ahead if dispatch_ahead is None else dispatch_ahead
        self.max_context = max_context
        self.prefill_chunks = prefill_chunks
        self.max_top_logprobs = max_top_logprobs
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.gate = gate  # when set: results wait for it (a device that has not finished)
        self.parts = parts  # hand steps over in parts (the runner's `parts`)
        self.prefill_gate = prefill_gate  # with parts: a prompt's first token waits for it
        self.plans: list[StepPlan] = []
        self.is_warm = False
        self._last: list[int | None] = [None] * num_slots  # device-held next input token
        self._pos: list[int | None] = [None] * num_slots  # next cache position; None: no request
        self.context_tokens = context_tokens
        self.cache: list[list[int | None]] = [[None] * max_context for _ in range(num_slots)]  # token per position
        self._busy_until = 0.0  # the fake device runs one program after another
        self.defers_allowed = defers_allowed  # StepPlan.deferred
        self.scores_prompts = scores_prompts  # PrefillChunk.score
        self._unsupplied: _FakeDeferredPending | None = None

    def warmup(self) -> None:
        self.is_warm = True

    def dispatch(self, plan: StepPlan) -> _FakePending:
        if self.fail_at_step is not None and len(self.plans) == self.fail_at_step:
            raise RuntimeError("device on fire")
        assert self.is_warm, "dispatch before warmup"
        assert self._unsupplied is None or not self._unsupplied.deferred, "dispatch before a deferred step's rows"
        assert not plan.deferred or self.defers_allowed, "a deferred plan for a model that does not defer"
        self.plans.append(plan)
        assert plan.num_decode_steps in self.decode_steps, f"{plan.num_decode_steps} decode steps not compiled"
        outs = [StepOutput.empty(self.num_slots, self.max_top_logprobs) for _ in range(plan.num_decode_steps)]
        out = outs[0]
        allowed = dict(plan.allowed)
        for slot, row in allowed.items():
            assert row.shape == (-(-VOCAB // 32),) and row.dtype == np.int32, f"slot {slot}'s allowed row {row.shape}"
        for setup in plan.setups:
            self._pos[setup.slot], self._last[setup.slot] = -1, None  # -1: before the first chunk
        prefill_slots = {c.slot for c in plan.prefills}
        deferred_inputs: dict[int, int] = {}
        for step_out in outs:
            for slot in plan.decode_slots:
                assert slot not in prefill_slots, f"slot {slot} decodes and prefills in one step"
                assert self._last[slot] not in (None, -1), f"slot {slot} decodes before its prompt or last token is done"
                assert self._pos[slot] < self.max_context, f"slot {slot} decodes past the context"
                self.cache[slot][self._pos[slot]] = self._last[slot]
                self._pos[slot] += 1
                if slot in plan.deferred:
                    deferred_inputs[slot] = self._last[slot]
                    self._last[slot] = -1  # sampled at supply: nothing may decode from it before
                else:
                    self._sample(step_out, slot, self._last[slot], allowed.get(slot))
        for copy in plan.copies:  # after the decode, before the prompt chunks
            n = copy.num_tokens
            assert copy.src != copy.dst and self._pos[copy.dst] == -1, "a copy into a slot not just set up"
            assert None not in self.cache[copy.src][:n], "a copy of positions nothing wrote (yet)"
            self.cache[copy.dst][:n] = self.cache[copy.src][:n]
        for chunk in plan.prefills:
            n = len(chunk.tokens)
            assert self._pos[chunk.slot] is not None, f"slot {chunk.slot} prefilled without a setup"
            assert self._last[chunk.slot] is None, f"slot {chunk.slot} prefilled after its last chunk"
            if self._pos[chunk.slot] == -1:  # the request's first chunk
                assert chunk.is_first and chunk.start_pos == chunk.reused, "the first chunk starts after the reused prefix"
                assert None not in self.cache[chunk.slot][:chunk.reused], "reused positions nothing wrote"
                self._pos[chunk.slot] = chunk.start_pos
            assert chunk.start_pos == self._pos[chunk.slot], "chunks out of order"
            assert 1 <= n <= self.prefill_chunks[-1], f"chunk of {n} tokens"
            self.cache[chunk.slot][chunk.start_pos:chunk.start_pos + n] = [int(t) for t in chunk.tokens]
            if chunk.score:
                assert self.scores_prompts, "a scored chunk for a model that does not score prompts"
                self._score(out, chunk)
            self._pos[chunk.slot] += n
            if chunk.is_last:
                self._sample(out, chunk.slot, int(chunk.tokens[-1]), allowed.get(chunk.slot))
        self._busy_until = max(self._busy_until, time.monotonic()) + self.step_delay
        if plan.deferred:
            kind = _FakeDeferredPartsPending if self.parts else _FakeDeferredPending
            self._unsupplied = kind(outs, self._busy_until, self.gate, self, deferred_inputs, plan)
            return self._unsupplied
        if self.parts:
            return _FakePartsPending(outs, self._busy_until, self.gate, plan, self.prefill_gate)
        return _FakePending(outs, self._busy_until, self.gate)

    def _score(self, out: StepOutput, chunk) -> None:
        predicted = [int(t) for t in chunk.tokens[1:]] + ([] if chunk.is_last else [chunk.next_token])
        first = chunk.start_pos + 1
        lps = np.asarray([fake_score(t, first + j) for j, t in enumerate(predicted)], np.float32).reshape(-1)
        k = self.max_top_logprobs
        top_ids = np.asarray([[(t + i) % VOCAB for i in range(k)] for t in predicted], np.int32).reshape(-1, k)
        hidden = [fake_hidden(int(t), chunk.start_pos + j) for j, t in enumerate(chunk.tokens)]
        out.scores.append(PromptScores(chunk.slot, first, lps, np.asarray([1 + t % 5 for t in predicted], np.int32),
                                       top_ids, (lps[:, None] - np.arange(k)).astype(np.float32),
                                       np.sum(hidden, axis=0), hidden[-1], len(hidden)))

    def _sample(self, out: StepOutput, slot: int, last: int, allowed: np.ndarray | None = None) -> None:
        if self.context_tokens:  # a byte (never EOS) that depends on every position before
            token = hash(tuple(self.cache[slot][:self._pos[slot]])) % 256
        else:
            token = (last + 1) % VOCAB
        if allowed is not None:
            bits = [(int(allowed.view(np.uint32)[t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
            assert any(bits), f"slot {slot}: no token allowed"
            token = next(t % VOCAB for t in range(token, token + VOCAB) if bits[t % VOCAB])
        self._last[slot] = token
        out.tokens[slot], out.valid[slot] = token, True
        out.logprobs[slot] = -token / 1000
        out.top_ids[slot] = [(token + i) % VOCAB for i in range(self.max_top_logprobs)]
        out.top_logprobs[slot] = [-token / 1000 - i for i in range(self.max_top_logprobs)]

    def decode_count(self, slot: int) -> int:
        return sum(slot in p.decode_slots for p in self.plans)

    # Slot snapshots (model/slot_snapshot.py's API): a position's "key" and "value" are the token
    # the fake cache holds there, as one f32 (a layer, a kv head of width 1).
    def _no_deferred_rows_awaited(self) -> None:  # (a deferred step's sampling, still to dispatch, writes slot state)
        assert self._unsupplied is None or not self._unsupplied.deferred, "a slot action before a deferred step's rows"

    def slot_layout(self) -> dict[str, Any]:
        return {"arch": "fake", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "vocab_size": VOCAB,
                "kv_dtype": "float32", "kv_itemsize": 4}

    def read_slot(self, slot: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        self._no_deferred_rows_awaited()
        assert 0 < num_tokens < self.max_context and None not in self.cache[slot][:num_tokens], "a read of nothing"
        rows = np.asarray(self.cache[slot][:num_tokens], np.float32).reshape(1, num_tokens, 1, 1)
        return rows, rows + 0.5  # (the values differ from the keys: a swap would show)

    def write_slot(self, slot: int, staged: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self._no_deferred_rows_awaited()
        tokens, k, v = staged  # (no stage_slot: the file's arrays as they come)
        k, v = (a.view(np.float32) if a.dtype == np.uint32 else a for a in (k, v))
        assert k.shape == v.shape == (1, len(tokens), 1, 1) and np.array_equal(v, k + 0.5), "keys and values apart"
        self.cache[slot][:len(tokens)] = [int(t) for t in k.reshape(-1)]


_dispatch_ahead = 1


@pytest.fixture(autouse=True, params=[1, 2], ids=["ahead1", "ahead2"])
def dispatch_ahead(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every scheduler test runs with the engine queuing one program beyond the one it reads (the
    default) and two: FakeModel's `dispatch_ahead` unless a test sets it."""
    monkeypatch.setattr(sys.modules[__name__], "_dispatch_ahead", request.param)
    return request.param


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., tuple[Engine, FakeModel]]]:
    """make_engine(model=None, factory=None, start=True, detokenizer_factory=ByteDetokenizer,
    **EngineConfig fields) -> (engine, model); detokenizer_factory=None: the engine's default."""
    engines: list[Engine] = []

    def make(
        model: FakeModel | None = None,
        *,
        factory: Callable[[], Any] | None = None,
        start: bool = True,
        detokenizer_factory: Callable[[Any], Any] | None = ByteDetokenizer,
        **config: Any,
    ) -> tuple[Engine, FakeModel]:
        model = model or FakeModel()
        config.setdefault("num_slots", model.num_slots)
        config.setdefault("max_context", model.max_context)
        config.setdefault("prefill_chunks", model.prefill_chunks)
        config.setdefault("prefill_budget", model.prefill_chunks[-1] * 2)
        config.setdefault("max_top_logprobs", model.max_top_logprobs)
        config.setdefault("gc_freeze", False)  # a full collection per engine is time the tests need not spend
        engine = Engine(
            factory or (lambda: model),
            ByteTokenizer(),
            EngineConfig(**config),
            model_name="fake",
            info={"kernels": {"attention": "fake"}},
            detokenizer_factory=detokenizer_factory,
        )
        engines.append(engine)
        if start:
            engine.start()
            engine.wait_ready(10)
        return engine, model

    yield make
    for engine in engines:
        engine.shutdown(timeout=10)


@pytest.fixture
def fake_model_cls() -> type[FakeModel]:
    return FakeModel


@pytest.fixture
def detokenizer_cls() -> type[ByteDetokenizer]:
    return ByteDetokenizer
