"""llama-server's native completion API (`POST /completion`), for the tools and front ends
written against llama.cpp's server rather than OpenAI's.

A request becomes a completion request (`to_completion`), served by the completion pipeline:
`prompt` (a string, token ids, an array of prompts, or llama.cpp's mixed array of token ids and
strings, one prompt), `n_predict` (also `max_tokens`; -1 up to the context), `n_probs` (also
`logprobs`), `repeat_penalty`, `n_cmpl` (also `n`), `logit_bias` in llama.cpp's forms (pairs
`[token or string, bias or false]`, or an object; a string biases each of its tokens, `false`
bans), and the fields both APIs share (`temperature`, `top_k`, `top_p`, `min_p`, `stop`,
`seed`, `stream`, `presence_penalty`, `frequency_penalty`, `ignore_eos`, `cache_prompt`,
`grammar`, `json_schema`, ...). A request's defaults are this server's (`GET /props`), as a
llama-server's come from its command line. The penalties are llama.cpp's: `repeat_penalty`,
`presence_penalty` and `frequency_penalty` count the last `repeat_last_n` tokens (64; -1: all;
0: no penalties) of prompt and output alike. The temperature applies before the truncations
(vLLM's order). Refused (400) where set to anything but their neutral value: the samplers this
server does not have (`tfs_z`, gone from llama.cpp too), `post_sampling_probs` and `lora`.
`typical_p`, `top_n_sigma`, `xtc_probability`, `xtc_threshold`, `dynatemp_range`,
`dynatemp_exponent`, DRY's `dry_*` and `mirostat`, `mirostat_tau`, `mirostat_eta` are served
(server/samplers.py; the values llama.cpp reads as off are off).
Code completion's stops (an editor's, through `/infill`, server/infill.py), as llama-server's:
`n_indent` ends the output before the text of a later line indented by fewer spaces or tabs (a
blank line too; `stop_type` `limit`), and `t_max_predict_ms` after a newline that comes later
than that since the first token.
Accepted and ignored: `samplers` (the order is this server's), `id_slot` (the engine places
requests), `n_keep` (no context shift), `min_keep`, `timings_per_token`, `return_progress`,
`t_max_prompt_ms`.

The response is llama-server's: per prompt an object with `content`, `tokens` (with
`return_tokens`), `stop`, `model`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached` (the
prompt's tokens reused from the prompt cache), `prompt` (its text), `stop_type` (`eos`, `word`
with `stopping_word`, `limit`, `none`), `generation_settings`, `timings` and, with `n_probs`,
`completion_probabilities` (per token `id`, `token`, `bytes`, `logprob`, `top_logprobs`); one
prompt's is the body, several prompts' an array. `response_fields` keeps the fields named (a
`a/b` path lifts a nested one). Streamed, each step's tokens are a `data:` frame (`content`,
`tokens`, `stop: false`, with `n_probs` their `completion_probabilities`) and the last is the
whole object with `stop: true` and empty `content`; no `[DONE]`. A failure after the headers is a
frame `{"error": {...}}`. `id_slot` is -1: the slot is the engine's business. Errors are this
server's (OpenAI's shape), named by llama.cpp's fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from typing import Any, AsyncIterator, Callable

from server import samplers
from server.errors import ApiError, invalid
from server.generation import Generation, abnormal_end, matched_stop, sse_frame
from server.openai_api import MAX_TOP_LOGPROBS, ParsedRequest, render_timings, token_logprob
from server.samplers import sampling_settings

log = logging.getLogger(__name__)

# fields passed to the completion parser as they are (both APIs name them alike)
_SHARED = ("model", "temperature", "top_k", "top_p", "min_p", "stream", "seed", "presence_penalty",
           "frequency_penalty", "ignore_eos", "cache_prompt", "cache_salt", "grammar", "json_schema",
           "response_format", "stop_token_ids", "min_tokens", "speculative.n_max")
# llama.cpp's samplers (server/samplers.py's FIELDS) the completion parser takes too, passed as
# they are but for the values llama.cpp reads as off or saturated, folded into the parser's ranges:
# typical_p >= 1 is off, a negative dynatemp_range or xtc_probability or dry_multiplier off, an
# xtc_probability over 1 always
_CLAMPED = {"typical_p": (-math.inf, 1.0), "dynatemp_range": (0.0, math.inf), "xtc_probability": (0.0, 1.0),
            "xtc_threshold": (-math.inf, 1.0), "dry_multiplier": (0.0, math.inf)}
# samplers and switches this server does not have, with the value that leaves them off
_OFF = {"tfs_z": (1.0, "at least 1")}
Encode = Callable[[str, bool | None, bool], list[int]]  # (text, add_bos, parse_special) -> ids
# the completion parser's field names -> this API's, for the `param` and message of a 400
_PARAM_NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs", "repetition_penalty": "repeat_penalty",
                "n": "n_cmpl"}
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
REPEAT_LAST_N = 64  # llama-server's default window for its penalties
_MIN_BIAS, _MAX_BIAS = -100.0, 100.0  # the completion parser's range; `false` bans with the lowest
_RANDOM_SEED = 0xFFFFFFFF  # llama-server's -1 (random) as its responses give it back


@dataclasses.dataclass(frozen=True)
class NativeRequest:
    body: dict[str, Any]  # the completion request it is served as
    n_probs: int
    return_tokens: bool
    response_fields: tuple[str, ...]
    names: dict[str, str]  # a completion field -> the field of this request it came from (errors)
    # code completion's stops (n_indent, t_max_predict_ms): GenerationRequest's fields
    request_fields: dict[str, Any] = dataclasses.field(default_factory=dict)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def to_completion(body: Any, encode: Encode, bos_text: str | None = None,
                  max_probs: int = MAX_TOP_LOGPROBS) -> NativeRequest:
    """The completion request a `/completion` request is served as, or a 400 naming the field;
    `encode` is the tokenizer's (`model.tokenizer.Tokenizer.encode`), `bos_text` its BOS as text
    (a prompt string starting with it gets no other), `max_probs` the engine's most alternatives."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    body = {k: v for k, v in body.items() if v is not None}
    out: dict[str, Any] = {k: body[k] for k in _SHARED if k in body}
    names = dict(_PARAM_NAMES)
    if "prompt" not in body:
        raise invalid("'prompt' is required", "prompt")
    out["prompt"] = _prompt(body["prompt"], encode, bos_text)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature < 0:
        out["temperature"] = 0.0  # llama.cpp's greedy (it gave the probabilities as well)
    if body.get("seed") == _RANDOM_SEED and _is_int(body["seed"]):
        out.pop("seed")  # -1 as llama-server reports it back
    predict = predict_field(body)
    if predict is not None:
        name, value = predict
        if _is_int(value) and value < -1:
            raise invalid(f"'{name}' must be -1 (up to the context) or at least 0, got {value}", name)
        if value != -1:
            out["max_tokens"], names["max_tokens"] = value, name
    probs_name = "n_probs" if "n_probs" in body else "logprobs"
    n_probs = body.get(probs_name, 0)
    if not _is_int(n_probs) or n_probs < 0:
        raise invalid(f"'{probs_name}' must be an integer of at least 0", probs_name)
    n_probs = min(n_probs, max_probs, MAX_TOP_LOGPROBS)  # (llama-server's post-sampling lists can be shorter too)
    if n_probs:
        out["logprobs"], names["logprobs"] = n_probs, probs_name
    if "n_cmpl" in body or "n" in body:
        names["n"] = "n_cmpl" if "n_cmpl" in body else "n"
        out["n"] = body[names["n"]]
    if "repeat_penalty" in body:
        out["repetition_penalty"] = body["repeat_penalty"]
    if "repeat_last_n" not in body and any(name in out for name in _PENALTIES):
        out["repeat_last_n"] = REPEAT_LAST_N  # llama-server's window
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be an array of strings", "stop")
    out["stop"] = [s for s in stop if s]  # llama.cpp skips empty ones
    if "logit_bias" in body:
        out["logit_bias"] = _logit_bias(body["logit_bias"], encode)
    out.update((name, body[name]) for name in samplers.FIELDS if name in body)
    for name, (low, high) in _CLAMPED.items():
        value = out.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # (others: the parser's 400)
            out[name] = min(max(value, low), high)
    base = out.get("dry_base")
    if isinstance(base, (int, float)) and not isinstance(base, bool) and base < 1:
        out.pop("dry_base")  # llama-server's: the default base in its place
    for name, (neutral, what) in _OFF.items():
        value = body.get(name, neutral)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid(f"'{name}' must be a number", name)
        if value < neutral:
            raise invalid(f"'{name}' is not supported by this server (its sampler or switch is not "
                          f"there): leave it out or set it to {what}", name)
    for name in ("post_sampling_probs", "return_tokens"):
        if not isinstance(body.get(name, False), bool):
            raise invalid(f"'{name}' must be a boolean", name)
    if body.get("post_sampling_probs", False):
        raise invalid("'post_sampling_probs' is not supported: the probabilities given are those after the logit "
                      "bias and penalties, before the temperature and truncations", "post_sampling_probs")
    if body.get("lora", []) != []:
        raise invalid("'lora' is not supported: this server serves its GGUF's weights alone", "lora")
    fields = body.get("response_fields", [])
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise invalid("'response_fields' must be an array of strings", "response_fields")
    return NativeRequest(out, n_probs, body.get("return_tokens", False), tuple(fields), names, _line_stops(body))


def _line_stops(body: dict[str, Any]) -> dict[str, Any]:
    """`n_indent` (a later line indented less ends the output before its text) and
    `t_max_predict_ms` (a newline after this long ends it; 0 or less: none) as the engine
    request's fields (GenerationRequest.min_indent, newline_limit_s)."""
    out: dict[str, Any] = {}
    indent = body.get("n_indent", 0)
    if not _is_int(indent) or indent < 0:
        raise invalid("'n_indent' must be an integer of at least 0", "n_indent")
    if indent:
        out["min_indent"] = indent
    limit = body.get("t_max_predict_ms", 0)
    if _is_int(limit):
        limit = min(limit, 10**12)  # (a float of any larger int overflows; this is 30 years)
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not math.isfinite(limit):
        raise invalid("'t_max_predict_ms' must be a number", "t_max_predict_ms")
    if limit > 0:
        out["newline_limit_s"] = max(limit / 1e3, 1e-9)
    return out


def predict_field(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The request's limit on generated tokens as (field, value): the first given of `n_predict`,
    `max_tokens` and `max_completion_tokens` (unchecked), or None."""
    return next(((name, body[name]) for name in ("n_predict", "max_tokens", "max_completion_tokens")
                 if name in body), None)


def _prompt(value: Any, encode: Encode, bos_text: str | None) -> Any:
    """llama.cpp's prompt forms as the completion parser takes them: a mixed array (token ids and
    strings, one prompt) as token ids, a BOS first where a string starts it (special tokens read
    in the strings, as in a prompt string); an array of prompts whose forms differ (strings, token
    ids, mixed arrays) as token ids each; the other forms as they are."""
    if not isinstance(value, list) or not value:
        return value
    if any(_is_int(x) for x in value) and any(isinstance(x, str) for x in value):
        return _mixed(value, encode, bos_text)
    if any(isinstance(x, list) for x in value) and not all(isinstance(x, list) and all(map(_is_int, x)) for x in value):
        return [_mixed([x] if isinstance(x, str) else x, encode, bos_text) if isinstance(x, (str, list)) else x
                for x in value]  # (anything else the completion parser refuses)
    return value


def _mixed(parts: list[Any], encode: Encode, bos_text: str | None) -> list[int]:
    ids: list[int] = []
    for i, x in enumerate(parts):
        if isinstance(x, str):
            # a BOS as the file adds one before a prompt that starts with text, unless it has one
            add_bos = False if i or (bos_text and x.startswith(bos_text)) else None
            ids += _encoded(encode, x, add_bos, True, "prompt")
        elif _is_int(x):
            ids.append(x)
        else:
            raise invalid("a mixed 'prompt' holds token ids and strings only", "prompt")
    if not ids:
        raise invalid("'prompt' must not be empty", "prompt")
    return ids


def _encoded(encode: Encode, text: str, add_bos: bool | None, parse_special: bool, field: str) -> list[int]:
    try:
        return encode(text, add_bos, parse_special)
    except ValueError as e:  # e.g. a byte the vocabulary cannot represent
        raise invalid(f"cannot tokenize the {field}: {e}", field) from None


def _logit_bias(value: Any, encode: Encode) -> dict[str, float]:
    """llama.cpp's logit_bias, `[[token or text, bias or false], ...]` or `{token or text: bias
    or false}`, as the completion parser's `{token id: bias}`: text biases each of its tokens,
    `false` bans, a bias is held to the parser's [-100, 100]."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise invalid("'logit_bias' must be an array of [token or text, bias or false] pairs, or an object",
                      "logit_bias")
    out: dict[str, float] = {}
    for key, bias in pairs:
        number = math.nan
        if bias is False:
            number = _MIN_BIAS
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool):
            try:
                number = float(bias)
            except OverflowError:  # an integer beyond float range
                pass
        if not math.isfinite(number):
            raise invalid(f"logit_bias entry {key!r}: the bias must be a number or false, got {bias!r}", "logit_bias")
        if _is_int(key):
            ids = [key]
        elif isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            ids = [int(key)]
        elif isinstance(key, str) and key:
            ids = _encoded(encode, key, False, False, "logit_bias")
        else:
            raise invalid(f"logit_bias entry {key!r} is neither a token id nor text", "logit_bias")
        for token in ids:
            if token < 0:
                raise invalid(f"logit_bias entry {key!r} is not a token id", "logit_bias")
            out[str(token)] = min(max(number, _MIN_BIAS), _MAX_BIAS)
    return out


def renamed(error: ApiError, names: dict[str, str]) -> ApiError:
    """A completion parser's 400 named by this request's fields (NativeRequest.names)."""
    name = names.get(error.param or "")
    if name is None or name == error.param:
        return error
    message = error.message.replace(f"'{error.param}'", f"'{name}'")
    return ApiError(error.status, message, type=error.type, param=name, code=error.code, headers=error.headers)


class NativeBuilder:
    """One response's objects: a streamed step's frame, and each prompt's final object."""

    def __init__(self, parsed: ParsedRequest, native: NativeRequest, model: str, tokenizer: Any) -> None:
        self.parsed, self.native, self.model, self.tokenizer = parsed, native, model, tokenizer
        self.eog_ids = (*tokenizer.eog_ids, *parsed.stop_token_ids)

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"id": token_id, **token_logprob(self.tokenizer.token_bytes, token_id, logprob)}

    def probabilities(self, entries: Any) -> list[dict[str, Any]]:
        """llama-server's `completion_probabilities`: each token with its `n_probs` most likely."""
        return [{**self._token(e.token_id, e.logprob),
                 "top_logprobs": [self._token(t, lp) for t, lp in e.top[: self.native.n_probs]]} for e in entries]

    def step(self, index: int, text: str, token_ids: tuple[int, ...], entries: Any, predicted: int,
             evaluated: int) -> dict[str, Any]:
        chunk = {"index": index, "content": text, "tokens": list(token_ids), "stop": False, "id_slot": -1,
                 "tokens_predicted": predicted, "tokens_evaluated": evaluated}
        if self.native.n_probs:
            chunk["completion_probabilities"] = self.probabilities(entries)
        return chunk

    def settings(self) -> dict[str, Any]:
        s, p = self.parsed.sampling, self.parsed
        settings = sampling_settings(s)
        if settings["repeat_last_n"] is None:  # (no penalty on: the window llama-server would report)
            settings["repeat_last_n"] = REPEAT_LAST_N
        return {"n_predict": -1 if p.max_tokens is None else p.max_tokens, **settings,
                "stop": list(p.stop), "ignore_eos": p.ignore_eos,
                "n_probs": self.native.n_probs, "logit_bias": [{"token": t, "bias": b} for t, b in s.logit_bias],
                "stream": p.stream, "cache_prompt": p.cache_prompt}

    def final(self, index: int, text: str, token_ids: list[int], entries: list[Any], finish_reason: str,
              prompt: tuple[int, ...], cached: int, timings: Any, streamed: bool = False) -> dict[str, Any]:
        """A prompt's whole result, `text` the reply as sent (a stop string cut off); `streamed`:
        as a stream's last frame, without its content, tokens and probabilities (the frames
        before gave them)."""
        word = matched_stop(self.parsed.stop, token_ids, self.eog_ids, self.tokenizer.decode) \
            if finish_reason == "stop" else None
        stop_type = {"length": "limit", "stop": "word" if word is not None else "eos"}.get(finish_reason, "none")
        out: dict[str, Any] = {
            "index": index, "content": "" if streamed else text,
            "tokens": token_ids if self.native.return_tokens and not streamed else [],
            "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": len(token_ids),
            "tokens_evaluated": len(prompt), "generation_settings": self.settings(),
            "prompt": self.tokenizer.decode(prompt, skip_special=False), "has_new_line": "\n" in text,
            "truncated": False, "stop_type": stop_type, "stopping_word": word or "", "tokens_cached": cached,
        }
        if timings is not None:
            out["timings"] = render_timings(timings)
        if self.native.n_probs and not streamed:
            if word is not None:  # as llama-server: none for the tokens that made the stop string
                entries = entries[:self._covering(token_ids[:len(entries)], len(text))]
            out["completion_probabilities"] = self.probabilities(entries)
        return self.select(out)

    def _covering(self, token_ids: list[int], length: int) -> int:
        """The fewest of `token_ids` whose text holds `length` characters (by bisection: the text
        of a prefix only grows; a character whose bytes are cut counts once it is whole)."""
        lo, hi = 0, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(token_ids[:mid]).rstrip("\ufffd")) >= length:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def select(self, out: dict[str, Any]) -> dict[str, Any]:
        """`response_fields`: the fields named, a path `a/b` lifting a nested one; those missing left out."""
        if not self.native.response_fields:
            return out
        kept: dict[str, Any] = {}
        for path in self.native.response_fields:
            value: Any = out
            for key in path.split("/"):
                value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
            if value is not _MISSING:
                kept[path] = value
        return kept


_MISSING = object()


@dataclasses.dataclass
class _Result:
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    entries: list[Any] = dataclasses.field(default_factory=list)


async def whole(gen: Generation, b: NativeBuilder) -> dict[str, Any] | list[dict[str, Any]]:
    """The non-streamed body: one prompt's object, or several prompts' in an array, by index."""
    results = {c.index: _Result() for c in gen.choices}
    finals: dict[int, dict[str, Any]] = {}
    async with contextlib.aclosing(gen.events()) as events:
        async for choice, event in events:
            r = results[choice.index]
            r.texts.append(event.text)
            r.token_ids += event.token_ids
            r.entries += event.logprobs
            if event.finish_reason is not None:
                error = abnormal_end(gen, choice, event)
                if error is not None:
                    raise error
                finals[choice.index] = b.final(choice.index, "".join(r.texts), r.token_ids, r.entries,
                                               event.finish_reason, choice.prompt.tokens, event.cached_tokens,
                                               event.timings)
    ordered = [finals[i] for i in sorted(finals)]
    return ordered[0] if len(ordered) == 1 else ordered


async def event_frames(gen: Generation, b: NativeBuilder,
                       on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The streamed body: a frame per step of each prompt, its whole object last; no [DONE]."""
    results = {c.index: _Result() for c in gen.choices}
    try:
        async with contextlib.aclosing(gen.events()) as events:
            async for choice, event in events:
                r = results[choice.index]
                r.texts.append(event.text)
                r.token_ids += event.token_ids
                if event.text or event.token_ids:
                    frame = sse_frame(b.step(choice.index, event.text, event.token_ids, event.logprobs,
                                             len(r.token_ids), len(choice.prompt.tokens)))
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    yield frame
                if event.finish_reason is None:
                    continue
                error = abnormal_end(gen, choice, event)
                if error is not None:
                    yield sse_frame(error.body())
                    return
                yield sse_frame(b.final(choice.index, "".join(r.texts), r.token_ids, [], event.finish_reason,
                                        choice.prompt.tokens, event.cached_tokens, event.timings, streamed=True))
    except ApiError as error:
        yield sse_frame(error.body())
    except Exception:
        log.exception("streaming native completion failed")
        gen.cancel()
        yield sse_frame(ApiError(500, "internal error while streaming", type="server_error",
                                 code="internal_error").body())
