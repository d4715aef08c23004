"""The contract between the scheduler and the model runner.

The scheduler (`scheduler/`) decides, each engine step, which slots decode and which prompt
chunks are prefilled; it packs that into a `StepPlan` and hands it to
`model.runner.ModelRunner.dispatch`, which enqueues one device program per part and returns a
`PendingStep` at once (JAX dispatch is asynchronous). `PendingStep.result()` copies the step's
outputs to the host as one `StepOutput`. The scheduler dispatches step n before it reads step
n-1, so host bookkeeping overlaps device work.

Device-resident per-slot state (next input token, position, penalty counts, RNG seed) lives in
the runner: the scheduler never passes sampled tokens back. A slot's token sampled in step n is
the input of its decode in step n+1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np

MAX_STOP_TOKEN_IDS = 16


def mask_words(vocab_size: int) -> int:
    """W: the int32 words of a row of allowed tokens (StepPlan.allowed), one bit a token."""
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. Become traced [B] arrays on device, never static args."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + generated tokens (vLLM semantics)
    presence_penalty: float = 0.0  # over generated tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # over generated tokens
    # None: the three penalties above as described (OpenAI's and vLLM's); else llama.cpp's: all
    # three over the last penalty_last_n tokens of prompt and output (-1: all of them; 0: none)
    penalty_last_n: int | None = None
    # llama.cpp's samplers (model/sampling.py gives their order here)
    typical_p: float = 1.0  # locally typical sampling's mass; 1 = off
    top_n_sigma: float = 0.0  # keep logits within n standard deviations of the largest; <= 0 = off
    xtc_probability: float = 0.0  # exclude top choices: the chance a step applies it; 0 = off
    xtc_threshold: float = 0.1  # ... to the tokens of at least this probability; > 0.5 = off
    dynatemp_range: float = 0.0  # dynamic temperature in temperature +- range by entropy; 0 = off
    dynatemp_exponent: float = 1.0
    # llama.cpp's DRY ("don't repeat yourself"): a token that would extend a repeat of at least
    # dry_allowed_length tokens of the last dry_penalty_last_n (-1: the whole context) loses
    # dry_multiplier * dry_base ** (length - dry_allowed_length) of its logit; a repeat does not
    # reach back past a token whose text holds one of the breakers. 0 = off.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    dry_breaker_ids: tuple[int, ...] = ()  # the breakers' tokens (the engine fills them in)
    # llama.cpp's mirostat (1 or 2; 0 = off): in place of the truncations, keeps the tokens that
    # steer the text's surprise towards mirostat_tau bits a token, learning at mirostat_eta
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    seed: int | None = None  # None: the runner draws one
    top_logprobs: int = 0  # how many alternatives per token to return (0..max_top_logprobs)
    # the most drafts a speculative decode checks per step for this request (EngineConfig.draft_max
    # caps it; None: that cap; 0: none)
    draft_max: int | None = None
    # vLLM's min_tokens: `min_tokens_ids` (the engine puts the request's stop tokens there) cannot be
    # sampled before min_tokens tokens were generated; they count against EngineConfig.max_logit_bias
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if self.penalty_last_n is not None and self.penalty_last_n < -1:
            raise ValueError("penalty_last_n must be >= -1")
        if not 0 < self.typical_p <= 1:
            raise ValueError("typical_p must be in (0, 1]")
        if not math.isfinite(self.top_n_sigma):
            raise ValueError("top_n_sigma must be finite")
        if not 0 <= self.xtc_probability <= 1:
            raise ValueError("xtc_probability must be in [0, 1]")
        if not 0 <= self.xtc_threshold <= 1:
            raise ValueError("xtc_threshold must be in [0, 1]")
        if not 0 <= self.dynatemp_range < math.inf:
            raise ValueError("dynatemp_range must be >= 0")
        if not 0 <= self.dynatemp_exponent < math.inf:
            raise ValueError("dynatemp_exponent must be >= 0")
        if not 0 <= self.dry_multiplier < math.inf:
            raise ValueError("dry_multiplier must be >= 0")
        if not 1 <= self.dry_base < math.inf:
            raise ValueError("dry_base must be >= 1")
        if self.dry_allowed_length < 0:
            raise ValueError("dry_allowed_length must be >= 0")
        if self.dry_penalty_last_n < -1:
            raise ValueError("dry_penalty_last_n must be >= -1")
        if self.mirostat not in (0, 1, 2):
            raise ValueError("mirostat must be 0, 1 or 2")
        if not 0 <= self.mirostat_tau < math.inf or not 0 <= self.mirostat_eta < math.inf:
            raise ValueError("mirostat_tau and mirostat_eta must be >= 0")
        if self.top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.draft_max is not None and self.draft_max < 0:
            raise ValueError("draft_max must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalty_window(self) -> bool:
        """llama.cpp's penalties over a window of recent tokens, with some penalty on."""
        penalised = self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        return self.penalty_last_n not in (None, 0) and penalised

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def uses_llama_samplers(self) -> bool:
        """Some of llama.cpp's samplers beyond the common ones (temperature, top-k, top-p, min-p,
        the OpenAI penalties, logit bias): a penalty window or DRY, or in a sampled row typical_p,
        top-n-sigma, XTC, the dynamic temperature or mirostat; what `model.sampling`'s
        `llama_samplers=False` leaves out (the rows its conditionals would change)."""
        sampled = self.temperature > 0
        return self.uses_penalty_window or self.uses_dry or sampled and (
            self.typical_p < 1 or self.top_n_sigma > 0 or (self.xtc_probability > 0 and self.xtc_threshold <= 0.5)
            or self.dynatemp_range > 0 or self.mirostat != 0)


@dataclasses.dataclass(frozen=True)
class SlotSetup:
    """Installs a new request in a slot: resets its penalty counts, seed and sampling arrays."""

    slot: int
    sampling: SamplingParams


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start_pos, start_pos + len(tokens)) of the request in `slot`.

    `is_last`: the chunk ends the prompt, so the step samples the request's first token.
    Chunks of one prompt arrive in order; the runner pads `tokens` to a compiled chunk size.
    `reused`: positions [0, reused) of the slot's cache already hold this request's first
    prompt tokens, prefilled for an earlier request with the same ones (the engine's prompt
    cache); its first chunk starts there, and that chunk (start_pos == reused) resets the
    slot's penalty state, taking the prompt tokens below it from the slot's token history.
    `score` (a runner that `scores_prompts`): the step's output also holds the chunk's
    `PromptScores`: the model's log-probability of each prompt token the chunk's tokens
    predict, positions start_pos + 1 through start_pos + len(tokens), the last of them
    `next_token` (the prompt's token after the chunk); the prompt's last chunk has none
    (`next_token` -1: the token after the prompt is sampled, not scored), so its scores end at
    the prompt's last position.
    """

    slot: int
    tokens: np.ndarray  # [T] int32, 1 <= T <= largest compiled chunk
    start_pos: int
    is_last: bool
    reused: int = 0
    score: bool = False
    next_token: int = -1

    def __post_init__(self) -> None:
        if self.score and (self.next_token < 0) != self.is_last:
            raise ValueError("a scored chunk has a next token exactly when it is not the prompt's last")

    @property
    def is_first(self) -> bool:
        return self.start_pos == self.reused


@dataclasses.dataclass(frozen=True)
class PrefixCopy:
    """The keys and values of positions [0, num_tokens) (and their prompt tokens) copied from
    slot `src` to slot `dst`, where a new request reuses a prompt prefix another slot holds (the
    engine's prompt cache). Positions past num_tokens may be copied too (the runner copies a
    whole context bucket); the request overwrites them before it reads them."""

    src: int
    dst: int
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    setups: tuple[SlotSetup, ...] = ()  # applied first
    copies: tuple[PrefixCopy, ...] = ()  # applied after the decode, in order, before the prefills
    decode_slots: tuple[int, ...] = ()  # slots that compute their next token this step
    prefills: tuple[PrefillChunk, ...] = ()  # applied after the decode, in order
    # Decode steps run back to back in one device program (lax.scan), each feeding the next its
    # sampled tokens; only with no prefills. One StepOutput per decode step comes back.
    num_decode_steps: int = 1
    # Constrained decoding: (slot, [W] int32 bitmask of the tokens its sample may take, bit t % 32
    # of word t // 32 for token t; W = ceil(V / 32)) for each decoding slot, or slot whose last
    # prompt chunk is in the plan, that samples under a grammar this step; the others are free.
    # Only in plans of one decode step and no speculative drafts: the host fills a row after it
    # has read the slot's previous token.
    allowed: tuple[tuple[int, np.ndarray], ...] = ()
    # Constrained decoding slots whose allowed tokens follow a token the host has not read yet (a
    # runner that `defers_allowed`): the decode runs its forward pass now and samples once the
    # host hands the pending step those rows (`supply`), so the device computes the step while
    # the host reads the token before it. Decode slots, not in `allowed`.
    deferred: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_decode_steps < 1:
            raise ValueError("num_decode_steps must be >= 1")
        if self.num_decode_steps > 1 and self.prefills:
            raise ValueError("several decode steps per dispatch run only without prefill chunks")
        if self.num_decode_steps > 1 and (self.allowed or self.deferred):
            raise ValueError("constrained slots (allowed, deferred) decode one step per dispatch")
        if not set(self.deferred) <= set(self.decode_slots) or set(self.deferred) & {s for s, _ in self.allowed}:
            raise ValueError("deferred slots must be decode slots without allowed rows in the plan")


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """A scored prompt chunk's (`PrefillChunk.score`) log-probabilities of the prompt tokens at
    positions [first, first + n) of its slot, each under the model's raw distribution after the
    tokens before it (no sampling settings: penalties, bias, temperature), with its rank in that
    distribution (1: the most likely) and the `max_top_logprobs` most likely tokens there; with
    the chunk's normed hidden states pooled (`hidden_sum`, `hidden_last`: embeddings)."""

    slot: int
    first: int  # the position of the first token scored (the chunk's start_pos + 1)
    logprobs: np.ndarray  # [n] f32
    ranks: np.ndarray  # [n] int32
    top_ids: np.ndarray  # [n, max_top_logprobs] int32, descending
    top_logprobs: np.ndarray  # [n, max_top_logprobs] f32
    # the chunk's rows' last hidden states after the output norm (what the output head reads), for
    # pooled embeddings: their sum over the chunk's tokens, and its last token's; None: not given
    hidden_sum: np.ndarray | None = None  # [E] f32, over the chunk's hidden_tokens tokens from position first - 1
    hidden_last: np.ndarray | None = None  # [E] f32
    hidden_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Host copy of one step's sampled tokens. Row b is meaningful only where `valid[b]`."""

    tokens: np.ndarray  # [B] int32
    valid: np.ndarray  # [B] bool: a token was sampled for slot b (decode, or last prefill chunk)
    logprobs: np.ndarray  # [B] f32, log-probability of the sampled token (after penalties, before temperature)
    top_ids: np.ndarray  # [B, max_top_logprobs] int32, best alternatives, descending (id 0 / -inf padding where not asked)
    top_logprobs: np.ndarray  # [B, max_top_logprobs] f32
    # The speculative decode's (EngineConfig.draft_max): slot b's token was a draft it accepted,
    # and the drafts checked for slot b in the step whose first token this output holds (0 in its
    # other outputs), so that the engine counts drafts only for tokens a request keeps.
    drafted: np.ndarray | None = None  # [B] bool; None: no drafts
    drafts: np.ndarray | None = None  # [B] int32
    # the scored prompt chunks (PrefillChunk.score) whose outputs this one carries, in dispatch order
    scores: list[PromptScores] = dataclasses.field(default_factory=list)

    @staticmethod
    def empty(num_slots: int, num_top: int, drafts: bool = False) -> "StepOutput":
        """No slot valid: the start a step's results are filled into (`drafts`: with the
        speculative decode's counts, zero)."""
        return StepOutput(
            tokens=np.zeros((num_slots,), np.int32),
            valid=np.zeros((num_slots,), bool),
            logprobs=np.zeros((num_slots,), np.float32),
            top_ids=np.zeros((num_slots, num_top), np.int32),
            top_logprobs=np.zeros((num_slots, num_top), np.float32),
            drafted=np.zeros((num_slots,), bool) if drafts else None,
            drafts=np.zeros((num_slots,), np.int32) if drafts else None,
        )


class PendingStep(Protocol):
    """A dispatched step. A runner may also offer `parts()`: ([StepOutput, ...], slots) pairs as
    the device finishes them (the decode part, then each chunk that ends its prompt), each
    output meaningful for its slots only; the engine then hands each part over at once. A
    speculative decode (`EngineConfig.draft_max`, model/speculative.py) hands its decode part
    over as one part per token offset, each for the slots that emitted a token there: a slot may
    get several tokens from one step."""

    def result(self) -> StepOutput: ...  # the (first) step's output

    def results(self) -> list[StepOutput]: ...  # one per decode step of the plan, in order (speculative: per token offset)


class StepModel(Protocol):
    """What the scheduler needs of a model runner (the real one and test fakes)."""

    num_slots: int
    max_context: int
    prefill_chunks: tuple[int, ...]
    max_top_logprobs: int
    decode_steps: tuple[int, ...]  # compiled decode steps per dispatch, e.g. (1,) or (1, 8)
    # (optional) the logits' vocabulary, for StepPlan.allowed's row width (default: the tokenizer's)
    # vocab_size: int
    # (optional, default False) takes StepPlan.deferred: dispatch returns a step whose `deferred`
    # slots sample once `supply({slot: row})` is called (the engine calls it before any other dispatch)
    # defers_allowed: bool
    # (optional, default 1) programs the engine keeps queued beyond the one it reads
    # (the runner's is EngineConfig.dispatch_ahead)
    # dispatch_ahead: int
    # (optional, default False) takes scored prompt chunks (PrefillChunk.score, prompt logprobs),
    # each run at the smallest prefill chunk size that holds it, as a plain chunk is
    # scores_prompts: bool

    def warmup(self) -> None: ...

    def dispatch(self, plan: StepPlan) -> PendingStep: ...
