"""OpenAI's /v1/completions and /v1/chat/completions: request parsing and response rendering.

Parsing takes the decoded JSON body and checks types and ranges only (no tokenizer, no engine),
yielding a `ParsedRequest`; `server/prompts.py` tokenizes it and `server/generation.py` submits
it. Every rejection is an `ApiError` 400 whose `param` names the field. Unknown fields are
ignored, as llama-server and vLLM do; fields whose meaning we cannot honour are refused.

Rendering turns engine `StreamEvent`s into OpenAI's objects: whole responses and SSE chunks, in
the shape of each endpoint (`text_completion` with legacy logprobs, `chat.completion(.chunk)`
with `logprobs.content`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from model.step_types import MAX_STOP_TOKEN_IDS, SamplingParams
from scheduler.types import Constraint, Timings, TokenLogprob
from server.constraints import parse_constraint
from server.errors import invalid
from server.reasoning import CHOICES as REASONING_FORMATS
from server.samplers import parse_llama_samplers
from server.tool_calls import ToolCall

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63
ROLES = ("system", "user", "assistant", "tool", "developer")
# Reserved names of render_chat, and `tools` (a field of its own, checked); chat_template_kwargs may not set them.
RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")
MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf; JSON has no infinity

Prompt = str | tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    is_chat: bool
    model: str | None  # echoed in responses; any value is accepted
    prompts: tuple[Prompt, ...] = ()  # completions: one entry per prompt
    messages: tuple[dict[str, Any], ...] = ()  # chat: content flattened to a string
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # tools, chat_template_kwargs
    add_generation_prompt: bool = True
    # vLLM's field: the prompt ends inside the final (assistant) message, which the reply continues
    continue_final_message: bool = False
    n: int = 1
    max_tokens: int | None = None  # None: up to the context
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    # vLLM's field: each prompt token's logprob, rank and this many alternatives (non-streamed)
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # vLLM's field: the prompt's and each choice's token ids (non-streamed)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    cache_prompt: bool = True  # llama-server's field: false prefills the whole prompt
    cache_salt: str = ""  # vLLM's field: reuse only what requests of the same salt prefilled
    tool_calls: bool = False  # chat with `tools` and tool_choice "auto": read calls out of the reply
    reasoning_format: str | None = None  # llama-server's field (server/reasoning.py's CHOICES); None: the server's
    parallel_tool_calls: bool = True  # False: a reply's first call only
    constraint: Constraint | None = None  # constrained decoding: response_format, json_schema, grammar, ...
    # tool_choice "required" or a named function: the reply is held to calls (server/tool_calls.py's
    # forced_grammar, which needs the template's call format: the constraint is made later)
    forces_call: bool = False
    forced_function: str | None = None  # the named function; None: any of the tools

    @property
    def prompt_field(self) -> str:
        return "messages" if self.is_chat else "prompt"

    @property
    def logprobs_field(self) -> str:
        return "top_logprobs" if self.is_chat else "logprobs"

    @property
    def scores_prompt(self) -> int | None:
        """The engine's GenerationRequest.prompt_logprobs: the most alternatives that vLLM's
        `prompt_logprobs` or a completion's `echo` with `logprobs` (OpenAI's legacy prompt
        logprobs) asks for; None: neither."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


# ----------------------------------------------------------------------------- field readers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Fields:
    """Typed access to a JSON object; `null` counts as absent, as OpenAI's SDKs send it."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix  # names nested fields in errors: "stream_options."

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean", self.prefix + name)
        return value

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise invalid(f"'{name}' must be an integer", self.prefix + name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise invalid(f"'{name}' must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], got {value}", self.prefix + name)
        return value

    def number(self, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        try:
            number = float(value) if _is_number(value) else math.nan
        except OverflowError:  # an integer beyond float range
            number = math.nan
        if not math.isfinite(number):
            raise invalid(f"'{name}' must be a finite number", self.prefix + name)
        if not (lo < number if lo_open else lo <= number) or not number <= hi:
            bracket = "(" if lo_open else "["
            raise invalid(f"'{name}' must be in {bracket}{lo:g}, {hi:g}], got {number:g}", self.prefix + name)
        return number

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(f"'{name}' must be a string", self.prefix + name)
        return value


# ----------------------------------------------------------------------------- parsing


def parse_completion(body: Any, max_choices: int) -> ParsedRequest:
    fields = _require_object(body)
    prompts = parse_prompts(fields.raw("prompt"))
    if fields.string("suffix"):
        raise invalid("'suffix' is not supported", "suffix")
    logprobs = fields.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = fields.boolean("echo", False)
    # max_tokens 0: the prompt alone, scored where echo and logprobs ask (OpenAI's legacy scoring)
    common = _parse_common(fields, max_tokens_names=("max_tokens",), top_logprobs=logprobs or 0, fewest=0)
    _check_best_of(fields, common["n"])
    _check_choices(len(prompts) * common["n"], max_choices)
    return ParsedRequest(is_chat=False, prompts=prompts, logprobs=logprobs, echo=echo, **common)


def parse_chat(body: Any, max_choices: int) -> ParsedRequest:
    fields = _require_object(body)
    messages = _parse_messages(fields.raw("messages"))
    wants_logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not wants_logprobs:
        raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    common = _parse_common(
        fields, max_tokens_names=("max_completion_tokens", "max_tokens"), top_logprobs=logprobs or 0
    )
    _check_choices(common["n"], max_choices)
    template_kwargs = _parse_template_kwargs(fields)
    tool_calls, forced_function = _parse_tool_choice(fields, template_kwargs.get("tools", []))
    forces_call = tool_calls and fields.raw("tool_choice") not in (None, "auto")
    if forces_call and common["constraint"] is not None:
        raise invalid(f"tool_choice {fields.raw('tool_choice')!r} constrains the reply to calls, and "
                      f"'{common['constraint'].field}' to something else: give one", "tool_choice")
    if not tool_calls:
        template_kwargs.pop("tools", None)  # tool_choice "none": the model is not told of them
    # a reply constrained otherwise is what its grammar allows: no calls are read out of it
    tool_calls = tool_calls and common["constraint"] is None
    continues = fields.boolean("continue_final_message", False)
    add_generation_prompt = fields.boolean("add_generation_prompt", not continues)
    if continues and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise invalid("'continue_final_message' continues a final assistant message, without "
                      "'add_generation_prompt'", "continue_final_message")
    return ParsedRequest(
        is_chat=True,
        messages=messages,
        template_kwargs=template_kwargs,
        tool_calls=tool_calls,
        forces_call=forces_call,
        forced_function=forced_function,
        parallel_tool_calls=fields.boolean("parallel_tool_calls", True),
        reasoning_format=_parse_reasoning_format(fields),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continues,
        logprobs=logprobs,
        **common,
    )


def _require_object(body: Any) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    return Fields(body)


def _parse_common(fields: Fields, max_tokens_names: tuple[str, ...], top_logprobs: int,
                  fewest: int = 1) -> dict[str, Any]:
    model = fields.string("model")
    n = fields.integer("n", 1, 1, MAX_N)
    max_tokens = None
    for name in max_tokens_names:  # first present wins (max_completion_tokens over max_tokens)
        max_tokens = fields.integer(name, None, fewest)
        if max_tokens is not None:
            break
    fields.string("user")  # accepted for compatibility, type-checked, unused
    seed = fields.integer("seed", None, -1, MAX_SEED - 1)
    top_k = fields.integer("top_k", 0, -1, 2**30)
    sampling = SamplingParams(
        temperature=fields.number("temperature", 1.0, 0.0, 2.0),
        top_k=max(top_k, 0),  # -1 (vLLM) and 0 (llama.cpp) both mean off
        top_p=fields.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        min_p=fields.number("min_p", 0.0, 0.0, 1.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0, 0.0, math.inf, lo_open=True),
        presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
        **parse_llama_samplers(fields),
        logit_bias=_parse_logit_bias(fields.raw("logit_bias")),
        seed=None if seed in (None, -1) else seed,  # -1: random, as llama-server
        top_logprobs=top_logprobs,
        # llama-server's field: the most drafts the speculative decode checks per step (--draft-max caps it)
        draft_max=fields.integer("speculative.n_max", None, 0),
        # vLLM's: no stop token or stop string before this many tokens
        min_tokens=fields.integer("min_tokens", 0, 0),
    )
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({sampling.min_tokens}) exceeds the most tokens asked for ({max_tokens})",
                      "min_tokens")
    stream = fields.boolean("stream", False)
    options = fields.raw("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    include_usage = Fields(options or {}, "stream_options.").boolean("include_usage", False)
    prompt_logprobs = fields.integer("prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise invalid("'prompt_logprobs' is not available with 'stream': true (as in vLLM); a streamed completion "
                      "gives its prompt's logprobs with 'echo' and 'logprobs'", "prompt_logprobs")
    return_token_ids = fields.boolean("return_token_ids", False)
    if return_token_ids and stream:
        raise invalid("'return_token_ids' is served for non-streamed requests only", "return_token_ids")
    return dict(
        prompt_logprobs=prompt_logprobs,
        return_token_ids=return_token_ids,
        model=model,
        n=n,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_parse_stop(fields.raw("stop")),
        stop_token_ids=_parse_stop_token_ids(fields.raw("stop_token_ids")),
        ignore_eos=fields.boolean("ignore_eos", False),
        cache_prompt=fields.boolean("cache_prompt", True),
        cache_salt=fields.string("cache_salt") or "",
        stream=stream,
        include_usage=stream and include_usage,
        constraint=parse_constraint(fields),
    )


def _check_best_of(fields: Fields, n: int) -> None:
    best_of = fields.integer("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise invalid("'best_of' different from 'n' is not supported", "best_of")


def _check_choices(count: int, max_choices: int) -> None:
    if count > max_choices:
        raise invalid(f"prompts x n is {count}; this server takes at most {max_choices} per request", "n")


def parse_prompts(value: Any, name: str = "prompt") -> tuple[Prompt, ...]:
    """A `prompt` (completions) or `input` (embeddings): a string, an array of strings, of token
    ids (one prompt) or of token id arrays."""
    if value is None:
        raise invalid(f"'{name}' is required", name)
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise invalid(f"'{name}' must be a string, a non-empty array of strings or of token ids", name)
    if all(_is_int(x) for x in value):
        return (_token_ids(value, name),)
    if all(isinstance(x, str) for x in value):
        return tuple(value)
    if all(isinstance(x, list) for x in value):
        out = []
        for i, ids in enumerate(value):
            if not ids or not all(_is_int(x) for x in ids):
                raise invalid("each token id list must be a non-empty array of integers", f"{name}[{i}]")
            out.append(_token_ids(ids, f"{name}[{i}]"))
        return tuple(out)
    raise invalid(f"'{name}' must be a string, an array of strings, of token ids or of token id arrays", name)


def _token_ids(ids: list[int], param: str) -> tuple[int, ...]:
    if any(x < 0 for x in ids):
        raise invalid("token ids must be >= 0", param)
    return tuple(ids)


def _parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid("each message must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
            raise invalid("'tool_calls' must be an array on an assistant message", f"{where}.tool_calls")
        parsed: dict[str, Any] = {
            # Chat templates predate the developer role; OpenAI treats it as system.
            "role": "system" if role == "developer" else role,
            "content": _message_content(message.get("content"), where, allow_none=tool_calls is not None),
        }
        for key in ("name", "tool_call_id", "reasoning_content"):  # the last for thinking models' templates
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise invalid(f"'{key}' must be a string", f"{where}.{key}")
                parsed[key] = message[key]
        if tool_calls is not None:
            parsed["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(tool_calls)]
        out.append(parsed)
    return tuple(out)


def _template_call(call: Any, where: str) -> Any:
    """An assistant message's tool call for the chat template: OpenAI sends `function.arguments`
    as JSON text, which templates write with `tojson` as an object (vLLM and llama-server hand
    them the object too); arguments that are no JSON object are left as they came."""
    if not isinstance(call, dict):
        raise invalid("each tool call must be an object", where)
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(args := function.get("arguments"), str):
        return call
    try:
        value = json.loads(args)
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": value}} if isinstance(value, dict) else call


def _message_content(content: Any, where: str, allow_none: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if allow_none:
            return ""
        raise invalid("'content' is required", f"{where}.content")
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of text parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported", param)
        if not isinstance(part.get("text"), str):
            raise invalid("'text' must be a string", f"{param}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_template_kwargs(fields: Fields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = fields.raw("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("'tools' must be an array of objects", "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or tool.get("type") != "function":
                raise invalid("each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise invalid("a function needs a 'name'", f"tools[{i}].function.name")
        if tools:
            out["tools"] = tools  # rendered by the chat template; calls read back by server/tool_calls.py
    extra = fields.raw("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        for key in extra:
            if key in RESERVED_TEMPLATE_NAMES or not key.isidentifier():
                raise invalid(f"'{key}' cannot be set through chat_template_kwargs", "chat_template_kwargs")
        out.update(extra)
    return out


def _parse_tool_choice(fields: Fields, tools: list[dict[str, Any]]) -> tuple[bool, str | None]:
    """(whether calls are read out of the reply, the function tool_choice names). "auto" (the
    default with tools) lets the model choose; "none" leaves the tools out of the prompt;
    "required" and {"type": "function", "function": {"name": ...}} hold the reply to calls (of
    that function) by constrained decoding."""
    choice = fields.raw("tool_choice")
    if choice is None or choice == "auto":
        return bool(tools), None
    if choice == "none":
        return False, None
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise invalid("tool_choice 'required' or a named function needs 'tools'", "tool_choice")
        if choice == "required":
            return True, None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return True, name
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or an object", "tool_choice")


def _parse_reasoning_format(fields: Fields) -> str | None:
    value = fields.string("reasoning_format")
    if value is not None and value not in REASONING_FORMATS:
        raise invalid(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    return value


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"at most {MAX_STOP} stop strings are supported", "stop")
    return tuple(dict.fromkeys(stops))


def _parse_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(x) and x >= 0 for x in value):
        raise invalid("'stop_token_ids' must be an array of token ids", "stop_token_ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are supported", "stop_token_ids")
    return tuple(dict.fromkeys(value))


def _parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if token < 0:
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(out))


# ----------------------------------------------------------------------------- rendering


@dataclasses.dataclass
class ChoiceResult:
    """One choice of a non-streaming response, gathered from its events."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    timings: Timings | None = None
    tool_calls: list[ToolCall] | None = None  # read out of `text` (chat with tools); text then the rest
    reasoning: str | None = None  # the reply's thought, split out of `text` (server/reasoning.py)
    prompt_tokens: tuple[int, ...] = ()  # the choice's prompt
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # its tokens' after the first (ParsedRequest.scores_prompt)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # generated (a stop token included)


def render_timings(t: Timings) -> dict[str, Any]:
    """llama-server's `timings` object: its counts and times, and the rates they give (null
    where a rate has no time to divide by). The decode rate counts the tokens after the first
    over the time from the first to the last (the first comes with the prompt's time); the draft
    fields appear where the speculative decode checked drafts for the request."""

    def rate(n: int, ms: float | None) -> tuple[float | None, float | None]:
        if ms is None or n <= 0 or ms <= 0:
            return None, None
        return ms / n, n * 1e3 / ms

    prompt_per_token, prompt_per_second = rate(t.prompt_n, t.prompt_ms)
    predicted_per_token, predicted_per_second = rate(t.predicted_n - 1, t.predicted_ms)
    out: dict[str, Any] = {
        "cache_n": t.cache_n,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": prompt_per_token,
        "prompt_per_second": prompt_per_second,
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": predicted_per_token,
        "predicted_per_second": predicted_per_second,
    }
    if t.draft_n:
        out["draft_n"], out["draft_n_accepted"] = t.draft_n, t.draft_n_accepted
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens reused from the prompt cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def vllm_prompt_logprobs(token_text: Callable[[int], str], tokens: tuple[int, ...],
                         entries: tuple[TokenLogprob, ...], k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first token (nothing came before it), then for
    each token {id: {logprob, rank, decoded_token}} of the token itself (its rank in the model's
    distribution) and of its k most likely alternatives (ranks 1 to k)."""
    out: list[dict[str, Any] | None] = [None] if tokens else []
    for entry in entries:
        item = {str(entry.token_id): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                      "decoded_token": token_text(entry.token_id)}}
        for rank, (token, logprob) in enumerate(entry.top[:k], start=1):
            item.setdefault(str(token), {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token)})
        out.append(item)
    return out


def token_logprob(token_bytes: Callable[[int], bytes], token_id: int, logprob: float) -> dict[str, Any]:
    """A token's logprob object (chat's `logprobs.content` entries, the Responses API's, and with
    its id llama-server's `completion_probabilities`): its text, logprob and bytes."""
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", "replace"), "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


class Renderer:
    """Builds one response's objects; `token_bytes` maps a token id to the bytes it stands for
    (`Tokenizer.token_bytes`; a token may hold part of a UTF-8 character)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        token_bytes: Callable[[int], bytes],
        *,
        include_usage: bool = False,
        logprobs: bool = False,
        echo_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        token_ids: bool = False,
    ) -> None:
        self.response_id = response_id
        self.token_ids = token_ids  # vLLM's return_token_ids
        self.echo_logprobs = echo_logprobs  # a completion's echo with logprobs: its prompt's, legacy form
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs
        self.created = created
        self.model = model
        self.token_bytes = token_bytes
        self.include_usage = include_usage
        self.is_logprobs = logprobs

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            out["usage"] = None  # OpenAI sends null on every chunk but the usage one
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        out = self._envelope(self.chunk_object_name, [])
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return out

    def response(self, choices: list[ChoiceResult], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> dict[str, Any]:
        rendered = [self._choice(c) for c in choices]
        out = self._envelope(self.object_name, rendered)
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        # llama-server's `timings`: the response's own with one choice, else each choice's
        if len(choices) == 1 and choices[0].timings is not None:
            out["timings"] = render_timings(choices[0].timings)
        elif len(choices) > 1:
            for item, c in zip(rendered, choices):
                if c.timings is not None:
                    item["timings"] = render_timings(c.timings)
        return out

    # Per endpoint.
    def start_chunks(self, index: int, echo_text: str, prompt_tokens: tuple[int, ...] = (),
                     prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        """A choice's first chunks: an echoed prompt (with its logprobs where echo_logprobs)."""
        raise NotImplementedError

    def delta_chunk(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def _choice(self, choice: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    """`text_completion` objects with legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def _logprobs(self, index: int, entries: list[TokenLogprob] | tuple[TokenLogprob, ...],
                  out: dict[str, list[Any]] | None = None, k: int | None = None) -> dict[str, Any] | None:
        """The legacy logprobs of `entries` (after `out`'s, where given), at most k alternatives
        each besides the token itself (k None: all given)."""
        if not self.is_logprobs:
            return None
        out = out or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for entry in entries:
            piece = self.token_text(entry.token_id)
            out["tokens"].append(piece)
            out["token_logprobs"].append(_finite(entry.logprob))
            top = {self.token_text(t): _finite(lp) for t, lp in entry.top[:k]}
            top.setdefault(piece, _finite(entry.logprob))  # the sampled (or prompt) token is always listed
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(piece)
        self._offsets[index] = offset
        return out

    def _prompt_logprobs(self, index: int, tokens: tuple[int, ...],
                         entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """An echoed prompt's legacy logprobs (echo_logprobs): its first token's are null (nothing
        came before it). `text_offset` runs over every token's text, the prompt's and then the
        generated ones (as vLLM's does): the echoed text may differ from the prompt tokens' (a
        BOS token's text, a leading space a decode strips), and the offsets never go back."""
        if self.echo_logprobs is None or not tokens:
            return None
        first = self.token_text(tokens[0])
        out: dict[str, list[Any]] = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None],
                                     "text_offset": [0]}
        self._offsets[index] = len(first)
        return self._logprobs(index, entries, out, self.echo_logprobs)

    def _item(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def start_chunks(self, index: int, echo_text: str, prompt_tokens: tuple[int, ...] = (),
                     prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        logprobs = self._prompt_logprobs(index, prompt_tokens, prompt_logprobs)
        if logprobs is None:
            self._offsets[index] = len(echo_text)
        return [self._chunk(self._item(index, echo_text, logprobs, None))] if echo_text else []

    def delta_chunk(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return self._chunk(self._item(index, text, self._logprobs(index, logprobs), None))

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._item(index, "", None, finish_reason))

    def _choice(self, choice: ChoiceResult) -> dict[str, Any]:
        echoed = self._prompt_logprobs(choice.index, choice.prompt_tokens, choice.prompt_logprobs)
        item = self._item(choice.index, choice.text, self._logprobs(choice.index, choice.logprobs, echoed),
                          choice.finish_reason)
        if self.prompt_logprobs is not None:  # vLLM's, per choice
            item["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, choice.prompt_tokens,
                                                           choice.prompt_logprobs, self.prompt_logprobs)
        if self.token_ids:  # vLLM's, per choice
            item["prompt_token_ids"], item["token_ids"] = list(choice.prompt_tokens), list(choice.token_ids)
        return item


class ChatRenderer(Renderer):
    """`chat.completion` / `chat.completion.chunk` objects with `logprobs.content`."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return token_logprob(self.token_bytes, token_id, logprob)

    def _logprobs(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        if not self.is_logprobs:
            return None
        return {"content": self.logprob_entries(entries), "refusal": None}

    def logprob_entries(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        """OpenAI's per-token logprob objects (token, logprob, bytes, top_logprobs): chat's
        `logprobs.content` and the Responses API's `output_text.logprobs`."""
        out = []
        for entry in entries:
            item = self._entry(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in entry.top]
            out.append(item)
        return out

    def _item(self, index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def start_chunks(self, index: int, echo_text: str, prompt_tokens: tuple[int, ...] = (),
                     prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        return [self._chunk(self._item(index, {"role": "assistant", "content": ""}, None, None))]

    def delta_chunk(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return self._chunk(self._item(index, {"content": text}, self._logprobs(logprobs), None))

    def reasoning_chunk(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return self._chunk(self._item(index, {"reasoning_content": text}, self._logprobs(logprobs), None))

    def tool_call_chunk(self, index: int, call: ToolCall, call_index: int,
                        logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """A call's head, or a whole call, in one delta (OpenAI's SDKs join a call's deltas by index)."""
        return self._chunk(self._item(index, {"tool_calls": [call.render(call_index)]}, self._logprobs(logprobs), None))

    def tool_args_chunk(self, index: int, call_index: int, text: str,
                        logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        delta = {"tool_calls": [{"index": call_index, "function": {"arguments": text}}]}  # a streamed call's next piece
        return self._chunk(self._item(index, delta, self._logprobs(logprobs), None))

    def finish_chunk(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(self._item(index, {}, None, finish_reason))

    def response(self, choices: list[ChoiceResult], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> dict[str, Any]:
        out = super().response(choices, prompt_tokens, completion_tokens, cached_tokens)
        if self.prompt_logprobs is not None and choices:  # vLLM's, of the one prompt, beside the choices
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, choices[0].prompt_tokens,
                                                          choices[0].prompt_logprobs, self.prompt_logprobs)
        if self.token_ids and choices:  # vLLM's: the prompt's beside the choices, each choice's own
            out["prompt_token_ids"] = list(choices[0].prompt_tokens)
            for item, choice in zip(out["choices"], choices):
                item["token_ids"] = list(choice.token_ids)
        return out

    def _choice(self, choice: ChoiceResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        if choice.reasoning is not None:
            message["reasoning_content"] = choice.reasoning
        if choice.tool_calls is not None:
            message["content"] = choice.text or None
            if choice.tool_calls:
                message["tool_calls"] = [call.render() for call in choice.tool_calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
        }
