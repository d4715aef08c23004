"""Requests going into the engine and the events coming out, shared with `server/`.

The server builds a `GenerationRequest` (prompt already tokenized), calls `Engine.submit`,
and iterates the returned `RequestStream` (async) for `StreamEvent`s until one carries a
`finish_reason`. Text in events is already detokenized incrementally: no broken UTF-8, no
piece of a stop string that might still match.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from model.step_types import SamplingParams

FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context
FINISH_CANCELLED = "cancelled"  # client gone
FINISH_TIMEOUT = "timeout"  # deadline passed
FINISH_ERROR = "error"  # the engine failed


class QueueFullError(Exception):
    """The waiting queue is full: the server answers 429 with Retry-After."""

    def __init__(self, retry_after_s: float = 1.0) -> None:
        super().__init__("the server is at capacity; retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(Exception):
    """The engine is loading, failed or shutting down (HTTP 503)."""


class SlotBusyError(Exception):
    """A slot action (scheduler/slot_files.py) named a slot a request is running in (HTTP 409)."""


class RequestValidationError(ValueError):
    """A request the engine cannot take (HTTP 400); `field` names the offending input."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# Pooled embeddings (GenerationRequest.pooling): the prompt's hidden states after the output
# norm, averaged over its tokens or its last token's (llama.cpp's pooling types mean and last)
POOLING_KINDS = ("mean", "last")

# Constraint kinds: llguidance's grammar formats (scheduler/grammar.py)
CONSTRAINT_KINDS = ("json_schema", "regex", "lark", "gbnf", "choice")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow (constrained decoding, scheduler/grammar.py)."""

    kind: str  # one of CONSTRAINT_KINDS
    source: str  # the JSON schema as JSON text, the regex, the grammar, or the choices as a JSON list
    field: str = ""  # the request field it came from (in error messages)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not returned
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the chosen token's logprob (and sampling.top_logprobs alternatives)
    cache_prompt: bool = True  # may reuse a prompt prefix a slot's cache holds (llama.cpp's cache_prompt)
    cache_salt: str = ""  # reuses only what requests of the same salt prefilled (vLLM's cache_salt)
    timeout_s: float | None = None  # None: the engine's default
    constraint: Constraint | None = None  # constrained decoding: the output follows this grammar
    # Prompt logprobs (vLLM's prompt_logprobs; OpenAI's echo with logprobs): None, none; k, the
    # first event carries each prompt token's after the first (StreamEvent.prompt_logprobs) with
    # its rank and k alternatives. The prompt is then prefilled whole (no prompt cache reuse).
    prompt_logprobs: int | None = None
    # An embedding (one of POOLING_KINDS): the prompt is prefilled whole, as for prompt logprobs,
    # and the final event carries its pooled hidden states (StreamEvent.embedding); max_tokens 0.
    pooling: str | None = None
    # Code completion's stops (llama-server's n_indent and t_max_predict_ms, for editors' /infill):
    # a line after the first indented by fewer than `min_indent` spaces or tabs (a blank line
    # too) ends the output before its first other character; a token whose text holds a newline
    # and comes more than `newline_limit_s` after the first token ends it after that text. Either
    # ends it as max_tokens would ("length"), unless the token ended it anyway (its own reason).
    min_indent: int = 0
    newline_limit_s: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise RequestValidationError("the prompt is empty", "prompt")
        if self.max_tokens < 0:
            raise RequestValidationError("max_tokens must be >= 0", "max_tokens")
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise RequestValidationError(f"pooling must be one of {', '.join(POOLING_KINDS)}", "pooling")
        if self.pooling is not None and self.max_tokens:
            raise RequestValidationError("an embedding request generates nothing (max_tokens 0)", "max_tokens")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise RequestValidationError("prompt_logprobs must be >= 0", "prompt_logprobs")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise RequestValidationError("timeout must be > 0", "timeout")
        if self.min_indent < 0:
            raise RequestValidationError("min_indent must be >= 0", "min_indent")
        if self.newline_limit_s is not None and not self.newline_limit_s > 0:
            raise RequestValidationError("newline_limit_s must be > 0", "newline_limit_s")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int = 0  # a prompt token's rank in the model's distribution (1: the most likely); 0: not given


@dataclasses.dataclass(frozen=True)
class Timings:
    """One request's counts and times as llama-server's response `timings` has them, measured
    on the engine thread (monotonic clock) when it hands tokens over."""

    prompt_n: int  # prompt tokens prefilled
    cache_n: int  # prompt tokens reused from the prompt cache instead
    prompt_ms: float | None  # its first prompt chunk dispatched -> its first token; None: no token
    predicted_n: int  # tokens generated
    predicted_ms: float | None  # its first token -> its last; None: no token
    # the speculative decode's (EngineConfig.draft_max) drafts checked in the steps that gave it
    # tokens, and those it kept as tokens
    draft_n: int = 0
    draft_n_accepted: int = 0


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """What one engine step produced for one request."""

    text: str = ""  # safe-to-send text delta
    token_ids: tuple[int, ...] = ()  # tokens accepted this step (generated, not stop-trimmed)
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    # GenerationRequest.prompt_logprobs: on the request's first event, one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_tokens: int = 0  # usage, set on the final event
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those reused from the prompt cache, not prefilled
    timings: Timings | None = None  # set on the final event
    # GenerationRequest.pooling: on the final event of a request whose prompt was read whole, its
    # pooled hidden states [E] f32 (not normalized)
    embedding: np.ndarray | None = None


class SlotInfo(NamedTuple):
    """A busy slot, as llama-server's `GET /slots` shows it (EngineStats.slot_infos)."""

    slot: int
    task: int  # the engine's number of the request in it (not its id, which /slots must not show)
    prompt_tokens: int
    prompt_done: int  # of them, prefilled or reused
    prompt_cached: int  # of them, reused from the prompt cache
    generated: int
    limit: int  # the most it may generate (max_tokens, or the context left)
    params: tuple[Any, ...]  # its sampling settings, SLOT_PARAMS' values

    @staticmethod
    def params_of(sampling: SamplingParams) -> tuple[Any, ...]:
        return tuple(getattr(sampling, name) for name in SLOT_PARAMS)


SLOT_PARAMS = ("temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p",
               "top_n_sigma", "xtc_probability", "xtc_threshold", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "penalty_last_n", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
               "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta", "seed")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for /health and /metrics."""

    state: str  # "loading" | "ready" | "failed" | "stopped"
    num_slots: int
    slots_busy: int
    requests_running: int
    requests_waiting: int
    requests_rejected_total: int
    prompt_tokens_total: int  # prefilled
    generation_tokens_total: int
    error: str | None = None
    prompt_tokens_cached_total: int = 0  # reused from the prompt cache instead
    # speculative decode (EngineConfig.draft_max): drafts checked in a step's spare rows, and
    # accepted, for the tokens requests kept (not in steps dispatched past a request's end)
    draft_tokens_total: int = 0
    draft_tokens_accepted_total: int = 0
    speculative_steps_total: int = 0  # decode steps that ran the speculative program
    # the busy slots, by slot: each a SlotInfo's fields as a plain tuple, which the engine
    # process pickles at every step at a third of a named tuple's cost
    slots: tuple[tuple, ...] = ()
    # by slot: the prompt tokens whose keys and values it keeps for reuse (its prompt cache entry,
    # what a slot save writes; scheduler/slot_files.py)
    cached: tuple[int, ...] = ()

    def slot_infos(self) -> list[SlotInfo]:
        return [SlotInfo(*fields) for fields in self.slots]
