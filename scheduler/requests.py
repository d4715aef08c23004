"""Per-request host state, owned by the engine thread (`scheduler/engine.py`).

A `RequestState` follows one `GenerationRequest` from the waiting queue through its prompt
chunks and decode steps: how far its prompt was dispatched, how many tokens were dispatched
and accepted, its deadline, and the text pipeline that turns accepted token ids into
`StreamEvent`s: incremental detokenizer (holds back incomplete UTF-8) -> `StopMatcher` (holds
back text that may still become a stop string). `RequestTiming` is what the engine hands its
observers when a request ends (the server turns it into Prometheus histograms).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Protocol

import numpy as np

from model.step_types import MAX_STOP_TOKEN_IDS, PromptScores
from scheduler import grammar
from scheduler.types import (
    FINISH_LENGTH, FINISH_STOP, GenerationRequest, RequestValidationError, SlotInfo, StreamEvent, Timings, TokenLogprob)

log = logging.getLogger(__name__)


def with_min_tokens_bans(request: GenerationRequest, eog_ids: frozenset[int]) -> GenerationRequest:
    """The request with its stop tokens (stop_token_ids, and the end-of-generation ones unless
    ignore_eos) as the tokens min_tokens bans (SamplingParams.min_tokens_ids)."""
    if not request.sampling.min_tokens:
        return request
    stops = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eog_ids))
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, min_tokens_ids=tuple(sorted(stops))))


def with_dry_breakers(request: GenerationRequest, breaker_ids: Callable[[tuple[str, ...]], tuple[int, ...]]
                      ) -> GenerationRequest:
    """The request with its DRY sequence breakers' tokens (SamplingParams.dry_breaker_ids, from
    `breaker_ids`: `Tokenizer.tokens_containing`, cached) where it uses DRY."""
    sampling = request.sampling
    if not sampling.uses_dry:
        return request
    ids = breaker_ids(tuple(sampling.dry_sequence_breakers))
    return dataclasses.replace(request, sampling=dataclasses.replace(sampling, dry_breaker_ids=ids))


def validate_request(
    request: GenerationRequest, *, vocab_size: int, max_context: int, max_top_logprobs: int, max_logit_bias: int,
    scores_prompts: bool = False,
) -> None:
    """Raises `RequestValidationError` for a request the engine cannot take: the checks of
    `Engine.submit`, and of `scheduler.engine_process.EngineProcess.submit` with the limits its
    engine process reported."""
    vocab = vocab_size
    prompt = np.asarray(request.prompt_tokens)
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise RequestValidationError(f"prompt token ids must be in [0, {vocab})", "prompt")
    num_prompt = len(request.prompt_tokens)
    if num_prompt >= max_context:
        raise RequestValidationError(
            f"the prompt has {num_prompt} tokens; the context holds {max_context} "
            "including at least one generated token",
            "prompt",
        )
    if num_prompt + request.max_tokens > max_context:
        raise RequestValidationError(
            f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) exceeds the "
            f"context of {max_context} tokens",
            "max_tokens",
        )
    sampling = request.sampling
    if sampling.top_logprobs > max_top_logprobs:
        raise RequestValidationError(f"top_logprobs must be <= {max_top_logprobs}", "top_logprobs")
    if len(sampling.logit_bias) > max_logit_bias:
        raise RequestValidationError(f"at most {max_logit_bias} logit_bias entries", "logit_bias")
    if sampling.min_tokens and len(sampling.logit_bias) + len(sampling.min_tokens_ids) > max_logit_bias:
        raise RequestValidationError(f"at most {max_logit_bias} logit_bias entries and stop tokens with min_tokens",
                                     "logit_bias")
    if sampling.min_tokens and request.constraint is not None:
        raise RequestValidationError("min_tokens together with a constrained output is not supported", "min_tokens")
    if sampling.min_tokens > request.max_tokens:
        raise RequestValidationError(f"min_tokens ({sampling.min_tokens}) exceeds the {request.max_tokens} tokens this "
                                     "request may generate (max_tokens, or what the context leaves)", "min_tokens")
    if any(not 0 <= token < vocab for token, _ in sampling.logit_bias):
        raise RequestValidationError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if request.pooling is not None and not scores_prompts:
        raise RequestValidationError("embeddings need the scored prompt programs, off on this server "
                                     "(--no-prompt-logprobs)", "input")
    if request.prompt_logprobs is not None and not scores_prompts:
        raise RequestValidationError("prompt logprobs are off on this server (--no-prompt-logprobs)", "prompt_logprobs")
    if (request.prompt_logprobs or 0) > max_top_logprobs:
        raise RequestValidationError(f"prompt_logprobs must be <= {max_top_logprobs}", "prompt_logprobs")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestValidationError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids", "stop_token_ids")


class Detokenizer(Protocol):
    """`model.tokenizer.IncrementalDetokenizer`'s shape."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """One finished request's timings (seconds, monotonic clock, measured on the engine thread).

    `ttft_s` and `itl_s` are taken when the engine thread hands the tokens to the stream, so
    they include host processing and the pipeline lag (the model's `dispatch_ahead` steps) the
    client actually sees.
    """

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float | None  # submit -> the first prompt chunk dispatched; None: never got a slot
    ttft_s: float | None  # submit -> the first generated token; None: no token
    itl_s: tuple[float, ...]  # gaps between successive generated tokens (0-ish within one step)
    e2e_s: float  # submit -> finish
    # engine steps (dispatches) that gave it tokens, the prefill's first token included: with the speculative
    # decode (EngineConfig.draft_max) a step may give several
    steps: int = 0


Observer = Callable[[RequestTiming], None]


def notify(observers: tuple[Observer, ...], timing: RequestTiming) -> None:
    """Each observer of a finished request; one that raises is logged and skipped."""
    for observer in observers:
        try:
            observer(timing)
        except Exception:
            log.exception("engine observer %r failed", observer)


class LineRules:
    """The lines of a request's output, for its code completion stops
    (`GenerationRequest.min_indent`, `newline_limit_s`): text goes in as it is sent."""

    def __init__(self, min_indent: int) -> None:
        self.min_indent = min_indent
        self._lead: int | None = None  # the current line's indentation while only it has come (not the first line)

    def cut(self, text: str) -> int | None:
        """Where in `text` a line after the first, indented by fewer than min_indent spaces or
        tabs, has its first other character (a blank line's newline too, as llama-server's);
        None where none does."""
        for i, ch in enumerate(text):
            if self._lead is not None:
                if ch in " \t":
                    self._lead += 1
                    continue
                if self._lead < self.min_indent:
                    return i
                self._lead = None
            if ch == "\n" and self.min_indent:
                self._lead = 0
        return None


class StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that may still start one.

    Text is released only once no stop string can match across it, so a stop string is never
    sent in part. After a match, the match and everything after it are dropped.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str, may_match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to send, whether a stop string matched). `may_match` False (the
        request's first min_tokens tokens): no match is taken, but a tail that may start one is
        held back as ever, so that a stop string ending after that still matches whole."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # A match cannot start in text already released (that text ends with no stop prefix).
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0] if may_match else []
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def release(self) -> str:
        """The held-back text, once the stream ends without it completing a stop string."""
        text, self._held = self._held, ""
        return text


class RequestState:
    """Host bookkeeping for one request. Only the engine thread touches it."""

    def __init__(
        self,
        request: GenerationRequest,
        stream: Any,  # scheduler.request_stream.RequestStream
        seq: int,
        *,
        detokenizer: Detokenizer,
        stop_ids: frozenset[int],
        max_context: int,
        deadline: float,
        submitted_at: float,
        matcher: grammar.Matcher | None = None,
    ) -> None:
        self.request = request
        self.stream = stream
        self.seq = seq  # engine-wide id; request ids from clients need not be unique
        self.prompt = np.asarray(request.prompt_tokens, np.int32)  # [P]
        self.num_prompt = len(request.prompt_tokens)
        # Tokens this request may generate: max_tokens, and the context (prompt + output).
        self.limit = min(request.max_tokens, max_context - self.num_prompt)
        self.deadline = deadline
        self.slot: int | None = None
        self.num_reused = 0  # prompt tokens the slot's cache held at admission (the prompt cache)
        self.num_prefilled = 0  # prompt tokens dispatched (or reused)
        self.num_scheduled = 0  # generated tokens whose sampling was dispatched (some in flight)
        self.num_generated = 0  # generated tokens accepted
        self.num_steps = 0  # engine steps that gave it tokens (RequestTiming.steps)
        self.num_drafts = 0  # the speculative decode's drafts checked for it, and kept (Timings)
        self.num_drafts_accepted = 0
        self.is_finished = False
        self._detok = detokenizer
        self._stop = StopMatcher(request.stop)
        self._stop_ids = stop_ids
        self._lines = (LineRules(request.min_indent)
                       if request.min_indent or request.newline_limit_s is not None else None)
        self.matcher = matcher  # constrained decoding: the grammar's state, past the accepted tokens
        self._slot_params: tuple | None = None  # slot_info's, made once
        self.submitted_at = submitted_at
        self.admitted_at: float | None = None
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._gaps: list[float] = []
        # GenerationRequest.prompt_logprobs: the prompt tokens' scores so far, by position - 1,
        # until the first event takes them
        self._prompt_logprobs: list[TokenLogprob] | None = [] if request.prompt_logprobs is not None else None
        # GenerationRequest.pooling: the prompt's pooled hidden states so far (PromptScores.hidden_*)
        self._pooled_n = 0
        self._pooled_sum: np.ndarray | None = None
        self._pooled_last: np.ndarray | None = None

    @property
    def scores_prompt(self) -> bool:
        """Its prompt chunks are scored (PrefillChunk.score), which also pools their hidden
        states: prompt logprobs, or an embedding; its prompt is prefilled whole, reusing no
        cached prefix."""
        return self.request.prompt_logprobs is not None or self.request.pooling is not None

    def add_scores(self, scores: PromptScores) -> None:
        """A scored chunk's prompt tokens; chunks come in order."""
        first = scores.first
        if self.request.pooling is not None:
            if scores.hidden_sum is None or self._pooled_n != first - 1:
                raise RuntimeError(f"pooled states from position {first - 1} out of order ({self._pooled_n} held)")
            total = scores.hidden_sum.astype(np.float64)
            self._pooled_sum = total if self._pooled_sum is None else self._pooled_sum + total
            self._pooled_last, self._pooled_n = scores.hidden_last, self._pooled_n + scores.hidden_tokens
        got = self._prompt_logprobs
        if self.request.prompt_logprobs is None:
            return
        if got is None or len(got) != first - 1:
            raise RuntimeError(f"prompt scores from position {first} out of order ({len(got or ())} held)")
        k = self.request.prompt_logprobs
        for j, token in enumerate(self.prompt[first:first + len(scores.logprobs)]):
            top = tuple((int(i), float(v)) for i, v in zip(scores.top_ids[j, :k], scores.top_logprobs[j, :k]))
            got.append(TokenLogprob(int(token), float(scores.logprobs[j]), top, int(scores.ranks[j])))

    def _embedding(self) -> np.ndarray | None:
        """The pooled embedding, once the whole prompt was read (GenerationRequest.pooling)."""
        if self.request.pooling is None or self._pooled_n != self.num_prompt or self._pooled_sum is None:
            return None
        if self.request.pooling == "last":
            return np.asarray(self._pooled_last, np.float32)
        return (self._pooled_sum / self.num_prompt).astype(np.float32)

    @property
    def is_decoding(self) -> bool:
        """The prompt is fully dispatched, so the slot decodes from the device-held token."""
        return self.num_prefilled == self.num_prompt

    @property
    def tokens_in_flight(self) -> int:
        """Generated tokens dispatched and not yet read (a constrained request's next allowed
        tokens follow all of them)."""
        return self.num_scheduled - self.num_generated

    @property
    def awaits_token(self) -> bool:
        """A constrained request with a token in flight."""
        return self.matcher is not None and self.tokens_in_flight > 0

    def accept(
        self,
        token: int,
        logprob: float,
        top_ids: np.ndarray,  # [L] int32
        top_logprobs: np.ndarray,  # [L] f32
        now: float,
    ) -> StreamEvent:
        """Takes one generated token; the event's finish_reason is set when it ends the request.
        With max_tokens 0 the token sampled after the prompt is dropped: the request ends. Code
        completion's stops (GenerationRequest.min_indent, newline_limit_s) apply to the text
        as it is sent, as llama-server applies them."""
        event = self._take(token, logprob, top_ids, top_logprobs, now)
        rules = self._lines
        if rules is None or (event.finish_reason is not None and not event.text):
            return event
        at = rules.cut(event.text)
        if at is not None:  # a line indented less than min_indent: the output ends before its text
            return self._ended(event, event.text[:at], FINISH_LENGTH)
        limit = self.request.newline_limit_s
        if event.finish_reason is None and limit is not None and "\n" in event.text and now - self._first_at > limit:
            tail, matched = self._finish_text()  # (text held back for a stop string, with its lines checked)
            at = rules.cut(tail)
            if at is not None:
                return self._ended(event, event.text + tail[:at], FINISH_LENGTH)
            return self._ended(event, event.text + tail, FINISH_STOP if matched else FINISH_LENGTH)
        return event

    def _ended(self, event: StreamEvent, text: str, reason: str) -> StreamEvent:
        """`event` with `text`, as the request's last event (its own reason where it was one)."""
        if event.finish_reason is not None:
            return dataclasses.replace(event, text=text)
        last = self._event("", (), (), reason)
        return dataclasses.replace(last, text=text, token_ids=event.token_ids, logprobs=event.logprobs,
                                   prompt_logprobs=event.prompt_logprobs)

    def _take(self, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray,
              now: float) -> StreamEvent:
        if self.limit == 0:
            self._record_time(now)  # (timings: the prompt's time)
            return self._event("", (), (), FINISH_LENGTH)
        self.num_generated += 1
        self._record_time(now)
        logprobs: tuple[TokenLogprob, ...] = ()
        if self.request.logprobs:
            n = self.request.sampling.top_logprobs
            top = tuple((int(i), float(v)) for i, v in zip(top_ids[:n], top_logprobs[:n]))
            logprobs = (TokenLogprob(int(token), float(logprob), top),)
        if token in self._stop_ids:
            # The stop token's own text is not sent; text held back for a stop string is.
            text, _ = self._finish_text()
            return self._event(text, (token,), logprobs, FINISH_STOP)
        if self.matcher is not None:
            self.matcher.consume(token)  # raises where the grammar does not take it: the request fails
        # stop strings end nothing within the first min_tokens tokens either (vLLM's): the first
        # token that may hold the end of one is the first a stop token may be
        text, matched = self._stop.feed(self._detok.add(token), may_match=self.num_generated > self.request.sampling.min_tokens)
        if matched:
            return self._event(text, (token,), logprobs, FINISH_STOP)
        if self.matcher is not None and self.matcher.is_stopped:  # the grammar is complete
            tail, _ = self._finish_text()
            return self._event(text + tail, (token,), logprobs, FINISH_STOP)
        if self.num_generated >= self.limit:
            tail, matched = self._finish_text()
            return self._event(text + tail, (token,), logprobs, FINISH_STOP if matched else FINISH_LENGTH)
        return self._event(text, (token,), logprobs, None)

    def final(self, reason: str, error: str | None = None, flush: bool = False) -> StreamEvent:
        """The last event when the request ends from outside (cancel, timeout, error)."""
        text = ""
        if flush:
            try:
                text, _ = self._finish_text()
            except Exception:  # noqa: BLE001 - the request ends anyway; the text is best effort
                text = ""
        return self._event(text, (), (), reason, error)

    def slot_info(self) -> tuple:
        """SlotInfo's fields, as EngineStats.slots holds them."""
        if self._slot_params is None:
            self._slot_params = SlotInfo.params_of(self.request.sampling)
        return (self.slot if self.slot is not None else -1, self.seq, self.num_prompt, self.num_prefilled,
                self.num_reused, self.num_generated, self.limit, self._slot_params)

    def timing(self, finish_reason: str, now: float) -> RequestTiming:
        return RequestTiming(
            request_id=self.request.request_id,
            finish_reason=finish_reason,
            prompt_tokens=self.num_prompt,
            completion_tokens=self.num_generated,
            queue_s=None if self.admitted_at is None else self.admitted_at - self.submitted_at,
            # max_tokens 0 (scoring, embeddings): the prompt's end is stamped, but no token came
            ttft_s=None if self._first_at is None or not self.num_generated else self._first_at - self.submitted_at,
            itl_s=tuple(self._gaps),
            e2e_s=now - self.submitted_at,
            steps=self.num_steps,
        )

    def timings(self) -> Timings:
        """llama-server's `timings` of the request so far."""
        first, last = self._first_at, self._last_at
        return Timings(
            prompt_n=self.num_prompt - self.num_reused,
            cache_n=self.num_reused,
            prompt_ms=None if first is None or self.admitted_at is None else (first - self.admitted_at) * 1e3,
            predicted_n=self.num_generated,
            predicted_ms=None if first is None else (last - first) * 1e3,
            draft_n=self.num_drafts,
            draft_n_accepted=self.num_drafts_accepted,
        )

    def _finish_text(self) -> tuple[str, bool]:
        """Flushes the detokenizer and the stop matcher: (text, whether a stop string matched)."""
        text, matched = self._stop.feed(self._detok.flush())
        return (text, True) if matched else (text + self._stop.release(), False)

    def _record_time(self, now: float) -> None:
        if self._first_at is None:
            self._first_at = now
        else:
            self._gaps.append(now - self._last_at)
        self._last_at = now

    def _event(
        self,
        text: str,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...],
        reason: str | None,
        error: str | None = None,
    ) -> StreamEvent:
        prompt: tuple[TokenLogprob, ...] = ()
        if self._prompt_logprobs is not None and len(self._prompt_logprobs) == self.num_prompt - 1:
            # on the first event, once whole (an event that ends a request before its prompt's
            # last chunk was read carries none)
            prompt, self._prompt_logprobs = tuple(self._prompt_logprobs), None
        if reason is None:
            return StreamEvent(text=text, token_ids=token_ids, logprobs=logprobs, prompt_logprobs=prompt)
        return StreamEvent(
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            finish_reason=reason,
            error=error,
            prompt_tokens=self.num_prompt,
            completion_tokens=self.num_generated,
            cached_tokens=self.num_reused,
            timings=self.timings(),
            embedding=self._embedding(),
        )
