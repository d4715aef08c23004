"""The engine: one thread that owns the model runner, the slot table and all request state.

Data flow. `server/` tokenizes a prompt, calls `Engine.submit(GenerationRequest)` on its
asyncio event-loop thread and iterates the returned `RequestStream` (by default through
`scheduler/engine_process.py`, whose child process runs this engine and calls `submit` from its
command loop with a stand-in for the loop that sends each step's events over a pipe). `submit` validates the
request, takes a place in the engine's capacity and puts a command on the engine's inbox (a
`queue.Queue`; cancel and shutdown travel the same way). The engine thread blocks on that
inbox while it has nothing to run; otherwise each loop iteration:

  1. drains the inbox without blocking (requests join and leave between steps),
  2. ends requests whose deadline passed,
  3. plans step n (`StepPlan`, scheduler/planning.py): the next token of every decoding slot,
     then prompt chunks of prefilling and newly admitted requests within `prefill_budget`,
  4. dispatches it to the `StepModel` (asynchronous: returns a `PendingStep` at once),
  5. processes step n-k's `StepOutput` while the device runs the k steps after it (k =
     the model's `dispatch_ahead`, 1 by default): accepts tokens,
     detokenizes, checks stop conditions and pushes `StreamEvent`s to each stream's asyncio
     queue through `loop.call_soon_threadsafe` (JetStream's async_multifuture pattern), one call
     per event loop per step rather than per token. A step the model hands over in parts
     (`parts`: the decode part, then each prompt's first token, as the device finishes them)
     is processed part by part, so its decode tokens do not wait for its prompt chunks,
  6. publishes `EngineStats` snapshots after the dispatch and after the processing (immutable
     objects swapped in whole: `stats()` reads them from any thread without a lock).

Events: one per accepted token; `text` may be "" while text is held back (incomplete UTF-8 or
a possible stop string) even though `token_ids` is set. The final event carries the finish
reason and usage; after a stop string its `token_ids` still include the tokens that formed it,
but the text stops before it. A stop token's (or EOS's) text is never sent.

Batch invariance: a prompt is cut at fixed absolute boundaries (multiples of the largest
compiled chunk), so its chunks, and therefore its tokens, never depend on its neighbours.
With the speculative decode (`EngineConfig.draft_max`) one step may give a request several
tokens (the model's parts, one per token offset); its tokens are a plain decode's.

Prompt cache (`EngineConfig.prompt_cache`, on by default): a slot's keys and values outlive its
request. The engine remembers, per slot, the tokens of the whole chunks (the largest compiled
size, from position 0) prefilled there; a new request takes the free slot whose remembered
chunks match the longest prefix of its prompt (else an empty slot, else the one idle longest)
and prefills only from the first chunk that differs, keeping at least one prompt token to
prefill. Where another slot, busy or not, holds a longer match, the new request's slot gets a
copy of those positions first (`PrefixCopy`, in the step's plan before its prefills): users
who share a system prompt prefill it once. Only chunks dispatched in earlier steps are copied
(a copy runs before the step's prompt chunks), and only what requests of the same `cache_salt`
prefilled (a tenant that must not learn from timings or `cached_tokens` what others' prompts
start with sends its own salt). Only whole prefilled chunks are kept, never a partial chunk or
decoded tokens, and the boundaries are the fixed ones above, so the positions reused hold
exactly what a cold prefill would write there: a request's tokens are the same with or without
the cache (a chat turn reuses what earlier turns prefilled of its history, not the previous
turn's own answer).

Timing for /metrics: `Engine.add_observer(fn)` registers `fn(RequestTiming)`, called on the
engine thread once per finished request with its queue time, time to first token, inter-token
gaps and end-to-end time (`scheduler.requests.RequestTiming`). Observers must be quick and
thread-safe (prometheus_client metrics are); an observer that raises is logged and ignored.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from model.config import EngineConfig
from model.step_types import PendingStep, StepModel, StepOutput
from model.tokenizer import IncrementalDetokenizer
from scheduler import grammar, slot_files
from scheduler.gc_pauses import freeze_heap
from scheduler.planning import StepPlanner, PlannedRows
from scheduler.prompt_cache import PromptCache
from scheduler.request_stream import RequestStream, _Cancel, _hand_over
from scheduler.requests import (
    Detokenizer, Observer, RequestState, RequestTiming, notify, validate_request, with_dry_breakers, with_min_tokens_bans)
from scheduler.types import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_TIMEOUT,
    Constraint,
    EngineStats,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestValidationError,
    SlotBusyError,
    StreamEvent,
)

log = logging.getLogger(__name__)

__all__ = ["Engine", "RequestStream", "RequestTiming"]


@dataclasses.dataclass(frozen=True)
class _Submit:
    state: RequestState


@dataclasses.dataclass(frozen=True)
class _Shutdown:
    pass


@dataclasses.dataclass(frozen=True)
class _SlotCommand:  # a slot action's part on the engine thread (Engine.slot_action)
    action: str
    slot: int
    data: Any
    done: concurrent.futures.Future


def unavailable_reason(stats: EngineStats) -> str:
    """Why an engine in this state takes no request (EngineUnavailableError's message)."""
    if stats.state == "failed":
        return f"the engine failed: {stats.error}"
    if stats.state == "loading":
        return "the model is loading"
    return "the engine is shutting down"


def _default_detokenizer(tokenizer: Any) -> Detokenizer:
    return IncrementalDetokenizer(tokenizer, skip_special=True)


class Engine(StepPlanner):
    """Runs generation requests on one `StepModel` from one engine thread (module docstring)."""

    def __init__(
        self,
        model_factory: Callable[[], StepModel],
        tokenizer: Any,
        config: EngineConfig,
        *,
        model_name: str = "",
        info: dict | None = None,
        detokenizer_factory: Callable[[Any], Detokenizer] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # DRY's breaker tokens by breaker texts (the default ones are the same for most requests)
        self._breaker_ids = functools.lru_cache(maxsize=32)(lambda texts: tokenizer.tokens_containing(texts))
        self.config = config
        self._factory = model_factory
        self._model_name = model_name
        self._extra_info = dict(info or {})
        self._make_detokenizer = detokenizer_factory or _default_detokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._settled = threading.Event()  # set when loading ends: ready, failed or stopped
        self._slot_lock = threading.Lock()  # one slot action at a time (slot_action)
        self._slot_commands: list[_SlotCommand] = []  # engine thread: drained, run before the next plan
        # Places for running + waiting requests: taken in submit, given back when a request ends.
        self._capacity = threading.BoundedSemaphore(config.num_slots + config.max_queue)
        self._seqs = itertools.count()
        self._rejected = 0  # written only by the submitting (event-loop) thread
        self._observers: tuple[Observer, ...] = ()  # replaced whole, never mutated
        # Engine-thread state (also read here, before the thread starts).
        self._model: StepModel | None = None
        self._slots: list[RequestState | None] = [None] * config.num_slots  # resized to the model's
        self._waiting: collections.deque[RequestState] = collections.deque()
        self._requests: dict[int, RequestState] = {}
        self._prompts = PromptCache(config.num_slots, config.prefill_chunks[-1], config.prompt_cache)
        self._chunk_sizes: tuple[int, ...] = config.prefill_chunks
        self._max_context = config.max_context
        self._max_top_logprobs = config.max_top_logprobs
        self._scores_prompts = False  # the model's (GenerationRequest.prompt_logprobs)
        self._decode_steps: tuple[int, ...] = (1,)
        self._dispatch_ahead = 1
        # While a step's outputs are processed, its events wait here, by event loop, and go in one
        # call_soon_threadsafe per loop (one wake-up of the loop per step, not one per token).
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamEvent]]] | None = None
        self._stepped: set[int] = set()  # requests the step being processed gave a token (by seq)
        self._is_stopping = False
        self._prompt_tokens_total = 0
        self._prompt_tokens_cached_total = 0
        self._generation_tokens_total = 0
        self._draft_tokens_total = self._draft_tokens_accepted_total = 0
        # constrained decoding's view of the vocabulary, built after the warm-up (None: unavailable)
        self._vocabulary: grammar.Vocabulary | None = None
        self._no_grammar_reason = "the model is loading"
        # Read from any thread: immutable objects, replaced whole by the engine thread.
        self._stats = self._snapshot("loading")
        self._info = self._build_info(None)

    # ---- public API (any thread unless noted) ----

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits for loading to end; True when the engine is ready to serve."""
        self._settled.wait(timeout)
        return self._stats.state == "ready"

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats, requests_rejected_total=self._rejected)

    def info(self) -> dict:
        return dict(self._info)

    def add_observer(self, observer: Observer) -> None:
        """Registers `observer(RequestTiming)`, called on the engine thread as requests end."""
        self._observers = self._observers + (observer,)

    def submit(self, request: GenerationRequest, *, loop: Any = None, tag: Any = None) -> RequestStream:
        """Event-loop thread: validates and queues a request, or raises at once.

        `loop`: where the stream's events go (default: the running asyncio loop); any object with
        asyncio's `call_soon_threadsafe(callback, items)`, which the engine thread calls with each
        step's `[(stream, event), ...]` (scheduler/engine_process.py sends them to another process).
        `tag` is kept as the stream's `tag`."""
        loop = loop if loop is not None else asyncio.get_running_loop()
        self._check_available()
        request = with_dry_breakers(with_min_tokens_bans(request, self.tokenizer.eog_ids), self._breaker_ids)
        self._validate(request)
        if not self._capacity.acquire(blocking=False):
            self._rejected += 1
            raise QueueFullError()
        seq = next(self._seqs)
        stream = RequestStream(request.request_id, seq, loop, self._inbox, tag)
        try:
            detok = self._make_detokenizer(self.tokenizer)
        except Exception:
            self._capacity.release()
            raise
        matcher = None
        if request.constraint is not None:
            try:
                matcher = self._matcher(request)
            except Exception:
                self._capacity.release()
                raise
        now = time.monotonic()
        stop_ids = frozenset(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= frozenset(self.tokenizer.eog_ids)
        state = RequestState(
            request,
            stream,
            seq,
            detokenizer=detok,
            stop_ids=stop_ids,
            max_context=self._max_context,
            deadline=now + (request.timeout_s or self.config.timeout_s),
            submitted_at=now,
            matcher=matcher,
        )
        self._inbox.put(_Submit(state))
        if self._stats.state != "ready":
            # The engine stopped between the check and the put and may never read the inbox
            # again; end the stream here, through its loop as every event goes (a second final
            # event from the engine is dropped).
            stream._push(StreamEvent(finish_reason=FINISH_ERROR, error=self._unavailable_reason()))
        return stream

    def shutdown(self, timeout: float | None = None) -> None:
        """Ends every stream (finish "error"), stops the engine thread and waits for it."""
        if self._thread is None:
            self._publish("stopped")
            self._settled.set()
            return
        self._inbox.put(_Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %s s", timeout)

    def slot_action(self, action: str, slot: int, path: str | None = None) -> dict:
        """llama-server's slot actions on an idle slot's cached prompt (scheduler/slot_files.py):
        "save" it to the file at `path`, "restore" it from there, or "erase" it; returns
        llama-server's answer. Blocks: call it from a worker thread, not the event loop's. One
        action at a time (a save holds a copy of the slot's keys and values until its file is
        written)."""
        slot_files.check_action(action)
        self._check_available()
        if not 0 <= slot < len(self._slots):
            raise RequestValidationError(f"slot {slot} does not exist: this server has slots 0 to {len(self._slots) - 1}",
                                         field="id_slot")
        if not self.config.prompt_cache:
            raise RequestValidationError("the prompt cache is off (--no-prompt-cache): a slot keeps nothing to reuse")
        model = self._model
        if action != "erase" and getattr(model, "read_slot", None) is None:
            raise NotImplementedError("this engine's model runner cannot save or restore slots")
        with self._slot_lock:
            if action == "save" and hasattr(model, "prepare_slot_read"):  # its first compile, not on the engine thread
                model.prepare_slot_read(self._stats.cached[slot] if slot < len(self._stats.cached) else 0)
            layout = {} if action == "erase" else {
                **model.slot_layout(), "model": self._model_name, "prefill_chunk": self._chunk_sizes[-1]}
            return slot_files.perform(action, slot, path, layout, self._max_context, self._ask_slot,
                                      getattr(model, "stage_slot", None))

    def _ask_slot(self, action: str, slot: int, data: Any) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_SlotCommand(action, slot, data, done))
        while True:  # (an engine that stops before reading the command never answers it)
            try:
                return done.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self._stats.state != "ready" and not done.done():
                    raise EngineUnavailableError(self._unavailable_reason()) from None

    # ---- submit helpers (event-loop thread) ----

    def _check_available(self) -> None:
        if self._stats.state != "ready":
            raise EngineUnavailableError(self._unavailable_reason())

    def compile_constraint(self, constraint: Constraint) -> None:
        """Any thread: compiles a grammar into the vocabulary's kept grammars (raising what
        `submit` would), so that a submit of it after only copies the compiled matcher."""
        grammar.matcher_for(self._vocabulary, self._no_grammar_reason, constraint)

    def _matcher(self, request: GenerationRequest) -> grammar.Matcher:
        """The request's grammar compiled against the vocabulary (RequestValidationError where
        it cannot be, or constrained decoding is unavailable)."""
        return grammar.matcher_for(self._vocabulary, self._no_grammar_reason, request.constraint)

    def _unavailable_reason(self) -> str:
        return unavailable_reason(self._stats)

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(
            request, vocab_size=int(self.tokenizer.vocab_size), max_context=self._max_context,
            max_top_logprobs=self._max_top_logprobs, max_logit_bias=self.config.max_logit_bias,
            scores_prompts=self._scores_prompts,
        )

    # ---- the engine thread ----

    @staticmethod
    def _close_model(model: StepModel | None) -> None:
        """A model with `close()` (model.multihost.LeaderRunner: it ends the other processes'
        step loops) is closed once the engine stops stepping it."""
        close = getattr(model, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # noqa: BLE001 - stopping anyway; the log says why the others may hang
            log.exception("closing the model failed")

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            if self.config.gc_freeze:
                gc.unfreeze()  # what this engine froze (and any other's in the process) is collectable again

    def _serve(self) -> None:
        model = None
        try:
            model = self._factory()
            self._adopt(model)
            model.warmup()
            self._build_vocabulary(model)
            if self.config.gc_freeze:
                freeze_heap()
        except BaseException as exc:  # noqa: BLE001 - whatever it is, streams and /health must know
            log.exception("the model failed to load")
            self._fail(exc)
            self._settled.set()
            self._close_model(model)  # after the failure is published: closing may wait on other processes
            self._serve_failed()
            return
        self._model = model
        self._publish("ready")
        self._settled.set()
        log.info(
            "engine ready: %d slots, context %d, prefill chunks %s, budget %d",
            len(self._slots), self._max_context, self._chunk_sizes, self.config.prefill_budget,
        )
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - whatever it is, streams and /health must know
            log.exception("the engine thread failed")
            self._fail(exc)
            self._close_model(model)
            self._serve_failed()
            return
        self._end_all(FINISH_ERROR, "the engine is shutting down")
        self._close_model(model)
        self._publish("stopped")
        log.info("engine stopped")

    def _build_vocabulary(self, model: StepModel) -> None:
        """Constrained decoding's vocabulary (scheduler/grammar.py), once."""
        started = time.perf_counter()
        self._vocabulary, why = grammar.build_vocabulary(self.tokenizer, getattr(model, "vocab_size", None))
        self._info = dict(self._info, constrained_decoding=self._vocabulary is not None)
        if self._vocabulary is None:
            self._no_grammar_reason = why
            log.warning("constrained decoding unavailable: %s", why)
            return
        log.info("constrained decoding: vocabulary of %d tokens ready in %.2f s", self._vocabulary.vocab_size,
                 time.perf_counter() - started)

    def _adopt(self, model: StepModel) -> None:
        """Takes the runner's compiled shapes as the truth for scheduling and validation."""
        chunks = tuple(model.prefill_chunks)
        if not chunks or list(chunks) != sorted(set(chunks)) or chunks[0] < 1:
            raise ValueError(f"the model's prefill chunk sizes {chunks} are not distinct ascending sizes")
        if self.config.prefill_budget < chunks[-1]:
            raise ValueError(f"prefill budget {self.config.prefill_budget} is below the largest chunk {chunks[-1]}")
        self._slots = [None] * int(model.num_slots)
        self._prompts = PromptCache(len(self._slots), chunks[-1], self.config.prompt_cache)
        self._chunk_sizes = chunks
        self._max_context = int(model.max_context)
        self._max_top_logprobs = int(model.max_top_logprobs)
        self._decode_steps = tuple(getattr(model, "decode_steps", (1,)))
        self._dispatch_ahead = int(getattr(model, "dispatch_ahead", 1))
        self._defers = bool(getattr(model, "defers_allowed", False))  # StepPlan.deferred
        self._scores_prompts = bool(getattr(model, "scores_prompts", False))  # PrefillChunk.score
        if self._dispatch_ahead < 1:
            raise ValueError(f"the model's dispatch_ahead {self._dispatch_ahead} is below 1")
        self._info = self._build_info(model)

    def _build_info(self, model: StepModel | None) -> dict:
        info: dict[str, Any] = {
            "model": self._model_name,
            "num_slots": len(self._slots),
            "max_context": self._max_context,
            "prefill_chunks": list(self._chunk_sizes),
            "prefill_budget": self.config.prefill_budget,
            "max_queue": self.config.max_queue,
            "max_top_logprobs": self._max_top_logprobs,
            "decode_steps_per_dispatch": max(self._decode_steps),  # the most, while no prompt waits
            "dispatch_ahead": self._dispatch_ahead,
            "prompt_cache": self.config.prompt_cache,
            "prompt_logprobs": self._scores_prompts,
            # speculative decode by prompt lookup (EngineConfig.draft_max; 0: off)
            "draft_max": self.config.draft_max,
        }
        model_info = getattr(model, "info", None)
        if callable(model_info):
            info.update(model_info())  # e.g. the runner's chosen kernels
        info.update(self._extra_info)
        return info

    def _run(self) -> None:
        # (PendingStep, {slot: request}) of the steps in flight, oldest first: up to
        # `_dispatch_ahead` more than the one being processed, so that the device has queued work
        # while the host reads a step's tokens, plans and launches. Rows are attributed to the
        # request recorded at dispatch, not to the slot's current occupant, so a slot can be
        # given to a new request (its SlotSetup in a later plan, which the runner applies after
        # the steps in flight) before those steps are processed: a finished request's extra
        # tokens are discarded.
        in_flight: collections.deque[tuple[PendingStep, dict[int, RequestState]]] = collections.deque()
        while True:
            self._drain_inbox()
            if self._is_stopping:
                return
            self._expire(time.monotonic())
            if in_flight and getattr(in_flight[-1][0], "deferred", ()) and not self._supply(*in_flight[-1]):
                # The newest step samples constrained rows whose allowed tokens follow a token of
                # an older step: read that step first (the device runs the newest's forward pass
                # meanwhile); nothing is dispatched before the newest step has its rows.
                self._process(*in_flight.popleft())
                self._publish("ready")
                continue
            if in_flight and not self._defers and self._awaits_tokens():
                # A model that cannot defer them: a constrained request's next allowed tokens
                # depend on the token in flight, so read the steps in flight before planning (it
                # samples in every step; the device idles while the host reads, plans, dispatches).
                self._process(*in_flight.popleft())
                self._publish("ready")
                continue
            # Slot actions here: the steps in flight are dispatched whole (a deferred step's
            # sampling too, which writes its slots' state), so the cache a save reads or a
            # restore writes follows every program that touches it.
            while self._slot_commands:
                self._slot_command(self._slot_commands.pop(0))
            plan, rows = self._plan_step()  # at most `_dispatch_ahead` steps are in flight here
            if plan is None and not in_flight:
                # Nothing to run: block on the inbox (no polling).
                self._publish("ready")
                self._handle(self._inbox.get())
                continue
            if plan is not None:
                in_flight.append((self._model.dispatch(plan), rows))
                self._publish("ready")  # admissions show while the device runs
                if len(in_flight) <= self._dispatch_ahead:
                    continue  # queue another before waiting for the oldest
            self._process(*in_flight.popleft())
            self._publish("ready")

    def _awaits_tokens(self) -> bool:
        return any(state is not None and state.awaits_token for state in self._slots)

    def _supply(self, pending: Any, rows: dict[int, RequestState]) -> bool:
        """Hands a deferred step its constrained rows' allowed tokens, where every one of those
        requests has read the tokens before this step's (a finished one gets every token: its
        output is discarded); False where some token is still in flight."""
        states = {slot: rows[slot] for slot in pending.deferred}
        if any(not s.is_finished and s.tokens_in_flight > 1 for s in states.values()):
            return False
        known = self._allowed_rows({slot: s for slot, s in states.items() if not s.is_finished})
        pending.supply({slot: known[slot] if known.get(slot) is not None else np.full((s.matcher.num_words,), -1, np.int32)
                        for slot, s in states.items()})
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(command)

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Submit):
            state = command.state
            if self._is_stopping:
                self._end_unqueued(state, "the engine is shutting down")
                return
            self._requests[state.seq] = state
            self._waiting.append(state)
        elif isinstance(command, _Cancel):
            state = self._requests.get(command.seq)
            if state is not None:
                self._finish(state, FINISH_CANCELLED)
        elif isinstance(command, _Shutdown):
            self._is_stopping = True
        elif isinstance(command, _SlotCommand):
            self._slot_commands.append(command)
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _slot_command(self, command: _SlotCommand) -> None:
        """A slot action's part here, between steps: the cache is read or written after the steps
        already dispatched (scheduler/slot_files.py)."""
        slot, prompts = command.slot, self._prompts
        try:
            if self._slots[slot] is not None:
                raise SlotBusyError(f"slot {slot} is busy: a request is running in it")
            if command.action == "save":
                held = prompts.held[slot]
                rows = self._model.read_slot(slot, len(held)) if len(held) else None
                result = (held.copy(), prompts.salts[slot], rows)
            elif command.action == "restore":
                tokens, salt, staged = command.data
                prompts.forget(slot)  # nothing of it is reused while it is written
                if len(tokens):
                    self._model.write_slot(slot, staged)
                prompts.restore(slot, tokens, salt, time.monotonic())
                result = len(tokens)
            else:
                result = prompts.forget(slot)
        except Exception as exc:  # noqa: BLE001 - the caller's to report
            self._publish("ready")
            command.done.set_exception(exc)
        else:
            self._publish("ready")  # (the slots' cached counts as of the answer: GET /slots after it agrees)
            command.done.set_result(result)

    def _expire(self, now: float) -> None:
        for state in [s for s in self._requests.values() if now >= s.deadline]:
            self._finish(state, FINISH_TIMEOUT, flush=True)

    def _process(self, pending: PendingStep, rows: PlannedRows) -> None:
        # A part's outputs are one per decode step of the plan; a request that ends at one step
        # ignores the rest. Each part's events reach the loop in one hand-over. Where the model
        # hands a step over as the device finishes its parts (`parts`: the decode part, then
        # each prompt's first token), a part does not wait for the step's last prompt chunk.
        if hasattr(pending, "parts"):
            parts = pending.parts()
        else:
            parts = [(pending.results() if hasattr(pending, "results") else [pending.result()], None)]
        done: set[int] = set()
        self._stepped = set()
        for outs, slots in parts:
            for scores in (s for out in outs for s in out.scores):  # before the tokens of the part
                state = rows.scored.get(scores.slot)
                if state is not None and not state.is_finished:
                    try:
                        state.add_scores(scores)
                    except Exception as exc:  # that request's alone
                        log.exception("request %s: its prompt scores failed", state.request.request_id)
                        self._finish(state, FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")
            part_rows = rows if slots is None else {s: rows[s] for s in slots if s in rows}
            self._process_part(outs, part_rows)
            done.update(part_rows)
        missed = {s: state for s, state in rows.items() if s not in done}
        if missed:  # rows no part covered: no token for them, as invalid rows of a whole output
            self._process_part([StepOutput.empty(len(self._slots), self._model.max_top_logprobs)], missed)

    def _process_part(self, outs: list[StepOutput], rows: dict[int, RequestState]) -> None:
        self._outbox = {}
        try:
            for out in outs:
                self._process_output(out, rows)
        finally:
            outbox, self._outbox = self._outbox, None
            for loop, items in outbox.items():
                _hand_over(loop, items)

    def _send(self, stream: RequestStream, event: StreamEvent) -> None:
        """Engine thread: to the step's outbox while a step is processed, else straight to the loop."""
        if self._outbox is None:
            stream._push(event)
        else:
            self._outbox.setdefault(stream._loop, []).append((stream, event))

    def _process_output(self, out: StepOutput, rows: dict[int, RequestState]) -> None:
        now = time.monotonic()
        for slot, state in rows.items():
            if state.is_finished:
                continue  # ended after this step was dispatched: its extra token is never sent
            if not out.valid[slot]:
                self._finish(state, FINISH_ERROR, error=f"the model sampled no token for slot {slot}")
                continue
            # the speculative decode's drafts, counted with the tokens the request keeps (before
            # `accept`, whose final event reports them)
            drafts = 0 if out.drafts is None else int(out.drafts[slot])
            drafted = out.drafted is not None and bool(out.drafted[slot])
            state.num_drafts += drafts
            state.num_drafts_accepted += drafted
            try:
                event = state.accept(
                    int(out.tokens[slot]), float(out.logprobs[slot]), out.top_ids[slot], out.top_logprobs[slot], now
                )
            except Exception as exc:  # one request's bad text (detokenizer) must not end the others
                log.exception("request %s failed while processing its token", state.request.request_id)
                self._finish(state, FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")
                continue
            self._generation_tokens_total += bool(event.token_ids)  # (none where max_tokens is 0)
            self._draft_tokens_total += drafts
            self._draft_tokens_accepted_total += drafted
            if state.seq not in self._stepped:  # the step's first token for it (a speculative step gives several)
                self._stepped.add(state.seq)
                state.num_steps += 1
            if event.finish_reason is None:
                self._send(state.stream, event)
            else:
                self._close(state, event, now)

    def _finish(self, state: RequestState, reason: str, error: str | None = None, flush: bool = False) -> None:
        self._close(state, state.final(reason, error, flush), time.monotonic())

    def _close(self, state: RequestState, event: StreamEvent, now: float) -> None:
        """Ends a request: frees its slot or queue place, sends its final event, tells observers."""
        state.is_finished = True
        if state.slot is not None:
            self._slots[state.slot] = None
            self._prompts.free(state.slot, now)
        else:
            self._waiting.remove(state)
        del self._requests[state.seq]
        self._capacity.release()
        self._send(state.stream, event)
        log.debug("request %s finished: %s", state.request.request_id, event.finish_reason)
        timing = state.timing(event.finish_reason, now)
        notify(self._observers, timing)

    def _end_all(self, reason: str, error: str) -> None:
        for state in list(self._requests.values()):
            self._finish(state, reason, error=error)
        self._drain_unqueued(error)

    def _end_unqueued(self, state: RequestState, error: str) -> None:
        """A submit that never joined the engine's tables (stopping or failed)."""
        self._capacity.release()
        state.stream._push(StreamEvent(finish_reason=FINISH_ERROR, error=error))

    def _drain_unqueued(self, error: str) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                self._end_unqueued(command.state, error)
            elif isinstance(command, _SlotCommand):
                command.done.set_exception(EngineUnavailableError(error))
            elif isinstance(command, _Shutdown):
                self._is_stopping = True
        while self._slot_commands:  # drained earlier, not yet run
            self._slot_commands.pop().done.set_exception(EngineUnavailableError(error))

    def _fail(self, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self._publish("failed", error)
        for state in list(self._requests.values()):
            try:
                self._finish(state, FINISH_ERROR, error=error)
            except Exception:
                log.exception("could not end request %s", state.request.request_id)
        self._drain_unqueued(error)

    def _serve_failed(self) -> None:
        """After a failure: answer submits that raced in with an error until shutdown (blocking)."""
        error = self._stats.error or "the engine failed"
        while not self._is_stopping:
            command = self._inbox.get()
            if isinstance(command, _Submit):
                self._end_unqueued(command.state, error)
            elif isinstance(command, _SlotCommand):
                command.done.set_exception(EngineUnavailableError(error))
            elif isinstance(command, _Shutdown):
                self._is_stopping = True

    def _snapshot(self, state: str, error: str | None = None) -> EngineStats:
        running = sum(1 for s in self._slots if s is not None)
        return EngineStats(
            state=state,
            num_slots=len(self._slots),
            slots_busy=running,
            requests_running=running,
            requests_waiting=len(self._waiting),
            requests_rejected_total=self._rejected,
            prompt_tokens_total=self._prompt_tokens_total,
            prompt_tokens_cached_total=self._prompt_tokens_cached_total,
            draft_tokens_total=self._draft_tokens_total,
            draft_tokens_accepted_total=self._draft_tokens_accepted_total,
            speculative_steps_total=int(getattr(self._model, "spec_steps", 0)),
            generation_tokens_total=self._generation_tokens_total,
            error=error,
            slots=tuple(s.slot_info() for s in self._slots if s is not None),
            cached=tuple(len(held) for held in self._prompts.held) if self._prompts.enabled else (),
        )

    def _publish(self, state: str, error: str | None = None) -> None:
        self._stats = self._snapshot(state, error)
