"""Constrained decoding: a request's output held to a grammar, token by token (llguidance).

A `GenerationRequest.constraint` (`scheduler.types.Constraint`) names a JSON schema, a regular
expression, a Lark or GBNF grammar, or a list of choices; `grammar_text` turns it into
llguidance's grammar, and `Vocabulary.matcher` refuses one that does not compile or run (HTTP
400, before the request takes a place). The engine keeps one `Matcher` per constrained request:
before each token it samples, `mask` gives the tokens the grammar allows next as a bitmask row
([W] int32, bit t % 32 of word t // 32 for token t: llguidance's layout), which the step program
applies to the logits (`model.sampling`); after the token is read, `consume` advances the grammar. A grammar that can
take no further token (a JSON object closed) ends the request, finish reason "stop".

`Vocabulary` builds llguidance's tokenizer once per engine from ours: every token's bytes, the
control tokens marked with a leading 0xff (so that grammar text never spells them), the
end-of-generation tokens as its EOS set (a grammar that may end allows them). It compiles a
grammar once and computes its first mask there, so that one llguidance accepts but cannot run
(a rule that never ends, a lexer too large) is refused at submit, not failed in the engine; the
last COMPILED_KEPT grammars are kept, and each request gets a copy of its grammar's matcher (a
request of n choices compiles once).

JSON schemas allow whitespace between their tokens as llama.cpp's grammars do (JSON_WHITESPACE:
nothing, one space, or one or two newlines and at most 20 spaces or tabs), not llguidance's
default of any run of it, on which a small model can spend its whole max_tokens; a schema whose
own `x-guidance` sets `whitespace_flexible` or `whitespace_pattern` (where the server puts vLLM's
`disable_any_whitespace` and `whitespace_pattern`) is compiled as it says.

Dimension letters: V vocabulary, W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any, Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from model.step_types import mask_words
from scheduler.types import Constraint, RequestValidationError

log = logging.getLogger(__name__)

# llama.cpp's `space` rule (common/json-schema-to-grammar): the whitespace a JSON schema's
# grammar allows between tokens (module docstring)
JSON_WHITESPACE = r"(?:[ ]?|\n{1,2}[ \t]{0,20})"


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet compiled: `Vocabulary.matcher` does)."""
    if constraint.kind == "choice" and not _is_choice_list(constraint.source):
        raise RequestValidationError("invalid choice list: a JSON array of strings, at least one, expected",
                                     constraint.field)
    try:
        schema = _bounded_whitespace(constraint.source) if constraint.kind == "json_schema" else None
        if schema is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        return llguidance.grammar_from(constraint.kind, constraint.source)  # our kinds are its format names
    except Exception as exc:  # noqa: BLE001 - llguidance's parsers raise ValueError and others
        raise RequestValidationError(f"invalid {_describe(constraint)}: {_first_line(exc)}", constraint.field) from None


def _bounded_whitespace(source: str) -> dict | None:
    """The JSON schema to compile with JSON_WHITESPACE (llguidance's options need an object: `true`
    is `{}`), or None where it takes none: not an object, or its own `x-guidance` sets
    `whitespace_flexible` or `whitespace_pattern` (or not JSON: llguidance's own error then)."""
    try:
        schema = json.loads(source)
    except ValueError:
        return None
    schema = {} if schema is True else schema
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or (isinstance(own, dict) and {"whitespace_flexible", "whitespace_pattern"} & own.keys()):
        return None
    return schema


def _is_choice_list(source: str) -> bool:
    try:
        value = json.loads(source)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _describe(constraint: Constraint) -> str:
    return {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar",
            "gbnf": "GBNF grammar", "choice": "choice list"}[constraint.kind]


def _first_line(message: Any) -> str:
    text = str(message).strip()
    return text.splitlines()[0] if text else "no reason given"


COMPILED_KEPT = 32


class Vocabulary:
    """llguidance's view of a tokenizer (`model.tokenizer.Tokenizer`'s interface: vocab_size,
    token_bytes, is_special, encode, bos_id, eos_id, eog_ids). `num_words`: W of a mask row for
    `vocab_size` tokens (the model's logits; ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        num_tokens = int(tokenizer.vocab_size)
        self.vocab_size = max(num_tokens, int(vocab_size or 0))
        self.num_words = mask_words(self.vocab_size)
        pieces = []
        for i in range(num_tokens):
            piece = tokenizer.token_bytes(i)
            pieces.append(b"\xff" + piece if tokenizer.is_special(i) else piece)
        pieces += [b""] * (self.vocab_size - num_tokens)  # ids the tokenizer lacks: empty, so never allowed
        eog = sorted(int(i) for i in tokenizer.eog_ids)
        eos = tokenizer.eos_id if tokenizer.eos_id is not None else (eog[0] if eog else None)
        if eos is None:
            raise ValueError("constrained decoding needs an end-of-generation token; the vocabulary has none")
        source = _TokenizerSource(tokenizer, pieces, int(eos))
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), eos_token=eog or [int(eos)])
        # (kind, source) -> (matcher at the start, its first mask): submit threads share it
        self._compiled: collections.OrderedDict[tuple[str, str], tuple[Any, np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A fresh matcher for the constraint: its grammar compiled against this vocabulary
        (about a millisecond for a small schema, a tenth of a second for a huge one; kept for the
        next requests) and its first mask computed; RequestValidationError where either fails."""
        key = (constraint.kind, constraint.source)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return Matcher(hit[0].deep_copy(), self.num_words, hit[1].copy())
        inner = llguidance.LLMatcher(self._tokenizer, grammar_text(constraint), log_level=0)
        try:
            if inner.is_error():
                raise RuntimeError(inner.get_error())
            first = Matcher(inner, self.num_words).mask()  # leaves the matcher's state as it was
        except RuntimeError:
            raise RequestValidationError(f"invalid {_describe(constraint)}: {_first_line(inner.get_error())}",
                                         constraint.field) from None
        if not first.any():
            raise RequestValidationError(f"invalid {_describe(constraint)}: it allows no token to start with",
                                         constraint.field)
        with self._lock:
            self._compiled[key] = (inner, first)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return Matcher(inner.deep_copy(), self.num_words, first.copy())


def build_vocabulary(tokenizer: Any, vocab_size: int | None = None) -> tuple[Vocabulary | None, str]:
    """(the vocabulary, "") or (None, why not): a tokenizer that cannot give one (no token bytes,
    no end-of-generation token) leaves constrained requests refused, the rest served."""
    try:
        return Vocabulary(tokenizer, vocab_size), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def matcher_for(vocabulary: Vocabulary | None, unavailable: str, constraint: Constraint) -> "Matcher":
    """`vocabulary.matcher(constraint)`, or RequestValidationError saying why constrained decoding
    is unavailable (`unavailable`) where there is no vocabulary."""
    if vocabulary is None:
        raise RequestValidationError(f"constrained decoding is not available: {unavailable}", constraint.field)
    return vocabulary.matcher(constraint)


class _TokenizerSource:
    """What llguidance.TokenizerWrapper reads (tokens, ids, and tokenizing text it is given)."""

    def __init__(self, tokenizer: Any, pieces: list[bytes], eos: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = pieces
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, p in enumerate(pieces) if p.startswith(b"\xff")]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "surrogateescape")
        return list(self._tokenizer.encode(text, add_bos=False))


class Matcher:
    """One request's grammar state (engine thread only)."""

    def __init__(self, inner: Any, num_words: int, first: np.ndarray | None = None) -> None:
        self._inner = inner
        self.num_words = num_words
        self._next = first  # the next mask, where already known (the first one, from the compile)

    def mask(self) -> np.ndarray:
        """The tokens allowed next as a new row ([W] int32); RuntimeError where the grammar fails."""
        if self._next is not None:
            row, self._next = self._next, None
            return row
        row = np.zeros((self.num_words,), np.int32)
        llguidance.numpy.fill_next_token_bitmask(self._inner, row.reshape(1, -1))
        if self._inner.is_error():
            raise RuntimeError(f"the grammar failed: {self._inner.get_error()}")
        return row

    def consume(self, token: int) -> None:
        """Advances past a sampled token; RuntimeError where the grammar does not take it."""
        self._next = None
        if not self._inner.consume_token(int(token)):
            raise RuntimeError(f"the grammar does not allow token {token}: {self._inner.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """The grammar takes no further token: the output is complete."""
        return self._inner.is_stopped()


_executor: Any = None  # llguidance's thread pool for `masks` (80% of the CPUs, at most 32 threads)


def masks(matchers: Sequence[Matcher]) -> list[np.ndarray | Exception]:
    """Each matcher's `mask()`, or the exception it raised: several computed at once on
    llguidance's threads, where a step has more than one to compute (a counted repetition's
    mask takes ~0.7 ms on this CPU, and 8 streams' masks in series would outlast a GPU step)."""
    global _executor
    out: list[np.ndarray | Exception | None] = [None] * len(matchers)
    todo = []
    for i, m in enumerate(matchers):
        if m._next is not None or len(matchers) == 1:
            try:
                out[i] = m.mask()
            except Exception as exc:  # noqa: BLE001 - one grammar's failure is its request's alone
                out[i] = exc
        else:
            todo.append(i)
    if todo:
        try:
            if _executor is None:
                _executor = llguidance.LLExecutor()
            rows = np.zeros((len(todo), matchers[todo[0]].num_words), np.int32)
            llguidance.numpy.fill_next_token_bitmask_par(
                _executor, [(matchers[i]._inner, j) for j, i in enumerate(todo)], rows)
        except Exception:  # noqa: BLE001 - one by one instead, each failure its own request's
            log.warning("llguidance's batched masks failed; computing %d one by one", len(todo), exc_info=True)
            for i in todo:
                out[i] = masks([matchers[i]])[0]
            return out  # type: ignore[return-value]
        for j, i in enumerate(todo):
            inner = matchers[i]._inner
            out[i] = RuntimeError(f"the grammar failed: {inner.get_error()}") if inner.is_error() else rows[j].copy()
    return out  # type: ignore[return-value]


def without(row: np.ndarray, tokens: Iterable[int]) -> np.ndarray:
    """A mask row with these tokens' bits cleared, as a new row; the row itself where that would
    leave no token allowed."""
    kept = row.copy().view(np.uint32)
    for t in tokens:
        if 0 <= t < 32 * kept.size:
            kept[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return kept.view(np.int32) if kept.any() else row


def allowed(row: np.ndarray, tokens: Iterable[int]) -> list[bool]:
    """Whether each token's bit is set in a mask row (for tests and checks)."""
    words = row.view(np.uint32)
    return [bool((int(words[t // 32]) >> (t % 32)) & 1) for t in tokens]


