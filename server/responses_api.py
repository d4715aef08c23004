"""OpenAI's Responses API (`POST /v1/responses`), served by the chat pipeline.

A request becomes a chat request (`to_chat`): `instructions` a system message first, `input` (a
string, or items: messages with text parts, `function_call`, `function_call_output`,
`reasoning`) the messages, flat function `tools` and `tool_choice` the chat forms,
`text.format` the `response_format`, `max_output_tokens` the `max_completion_tokens`; the chat
endpoint's sampling fields and our extensions pass through. `parse_chat` then checks it as it
checks any chat request, and the reply is read for thoughts and calls as a chat reply is
(server/replies.py). The reply becomes output items: a `reasoning` item (the thought, as
`reasoning_text`), a `message` with one `output_text`, and a `function_call` per call; a reply
cut by `max_output_tokens` leaves the response `incomplete`.

`previous_response_id` continues a stored response: its conversation (input and output, not its
instructions) comes before the new input, as OpenAI's does. Responses are stored unless
`store` is false, in memory, the newest `ResponseStore.max_entries` of them; `GET` and `DELETE
/v1/responses/{id}` read and remove them. Not served (400): `background`, `conversation`,
`prompt`, `truncation: "auto"`, tools other than functions, `item_reference` and non-text
input (images, files, audio).

Streaming (`event_frames`) sends OpenAI's typed events as SSE (`event:` and `data:` lines, each
with its `sequence_number`): `response.created`, `response.in_progress`, per output item
`response.output_item.added` / `.done` with its part's events between (`response.content_part.*`
and `response.output_text.delta` / `.done`; `response.reasoning_text.*`;
`response.function_call_arguments.delta` / `.done`: a call's arguments come whole, once the
call is read), then `response.completed` or `response.incomplete`; an error after the headers an
`error` event and `response.failed`. No `[DONE]`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from scheduler.types import TokenLogprob
from server.errors import SERVER_ERROR, ApiError, invalid
from server.generation import Generation, abnormal_end
from server.openai_api import ChatRenderer, ChoiceResult, MAX_TOP_LOGPROBS, ParsedRequest
from server.tool_calls import ToolCall

log = logging.getLogger(__name__)

# Fields of a Responses request that pass to the chat request as they are: OpenAI's sampling
# fields the two APIs share, and the chat endpoint's extensions (README, "Request fields").
PASSED_THROUGH = (
    "model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
    "ignore_eos", "cache_prompt", "cache_salt", "chat_template_kwargs", "reasoning_format", "json_schema",
    "grammar", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "speculative.n_max",
)
# Chat fields a Responses request names otherwise, for the `param` of a 400.
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                ("messages", "input"), ("top_logprobs", "top_logprobs"))
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16  # OpenAI's: key/value pairs, keys up to 64 characters, values up to 512


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    chat_body: dict[str, Any]  # the chat request it is served as
    history: tuple[dict[str, Any], ...]  # the conversation's chat messages, instructions left out
    echo: dict[str, Any]  # the request's own fields, as the response object reports them
    store: bool
    logprobs: bool


@dataclasses.dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    messages: tuple[dict[str, Any], ...]  # its conversation with the reply, in chat form


class ResponseStore:
    """The newest `max_entries` responses, by id (any thread: the event loop writes, tests read)."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ----------------------------------------------------------------------------- the request


def chat_param(param: str | None) -> str | None:
    """A chat field's name in a 400 as the Responses request names it."""
    for chat, ours in _PARAM_NAMES:
        if param is not None and (param == chat or param.startswith(chat + ".") or param.startswith(chat + "[")):
            return ours + param[len(chat):]
    return param


def to_chat(body: Any, store: ResponseStore) -> ResponsesRequest:
    """The chat request a Responses request is served as, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    for name in ("background", "conversation", "prompt"):
        if body.get(name) not in (None, False):
            raise invalid(f"'{name}' is not supported by this server", name)
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("only 'truncation': 'disabled' is supported (a prompt over the context is a 400)", "truncation")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise invalid("'store' must be a boolean", "store")
    chat: dict[str, Any] = {k: body[k] for k in PASSED_THROUGH if k in body}
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise invalid(f"no stored response has the id {previous!r} (this server keeps the newest "
                          f"{store.max_entries}, and none made with 'store': false)", "previous_response_id")
        history += stored.messages
    inp = body.get("input")
    if inp is None and previous is None:
        raise invalid("'input' is required (a string or an array of items)", "input")
    if isinstance(inp, str):
        history.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        history += _input_messages(inp)
    elif inp is not None:
        raise invalid("'input' must be a string or an array of items", "input")
    if not history:
        raise invalid("'input' has no message", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text = body.get("text")
    fmt = None
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("'text' must be an object", "text")
        fmt = text.get("format")
        if fmt is not None:
            chat["response_format"] = _response_format(fmt)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object", "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:  # for templates that read it (gpt-oss's); others ignore it
            if not isinstance(effort, str):
                raise invalid("'reasoning.effort' must be a string", "reasoning.effort")
            kwargs = chat.get("chat_template_kwargs")
            chat["chat_template_kwargs"] = {"reasoning_effort": effort, **(kwargs if isinstance(kwargs, dict) else {})}
    logprobs = _wants_logprobs(body)
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise invalid(f"'metadata' must be an object of at most {MAX_METADATA} strings (keys up to 64 "
                      "characters, values up to 512)", "metadata")
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
        "temperature": body.get("temperature", 1.0),
        "text": {"format": fmt if fmt is not None else {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools or [],
        "top_logprobs": body.get("top_logprobs", 0),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(chat, tuple(history), echo, keep, logprobs)


def _wants_logprobs(body: dict[str, Any]) -> bool:
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise invalid("'include' must be an array of strings", "include")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    return "message.output_text.logprobs" in (include or []) or bool(top)


def _text_of(content: Any, where: str, parts: tuple[str, ...]) -> str:
    """A message's or output's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in parts:
            raise invalid(f"content part type {kind!r} is not supported (text parts only: {', '.join(parts)})",
                          f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise invalid("'text' must be a string", f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: a `function_call` joins the assistant message before it (or
    opens one), a `function_call_output` is a tool message, a `reasoning` item's text is the
    next assistant message's `reasoning_content`."""
    out: list[dict[str, Any]] = []
    thought: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal thought
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if thought is not None:
            out[-1]["reasoning_content"] = thought
            thought = None
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid("each input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"'role' must be user, system, developer or assistant, got {role!r}", f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                message = assistant()
                if message.get("tool_calls") or message["content"]:  # a new turn of the assistant's
                    out.append({"role": "assistant", "content": text})
                else:
                    message["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"a function_call item needs '{key}' (a string)", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid("a function_call_output item needs 'call_id' (a string)", f"{where}.call_id")
            text = _text_of(item.get("output"), f"{where}.output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = [p for p in (item.get("content") or []) if isinstance(p, dict)] or \
                    [p for p in (item.get("summary") or []) if isinstance(p, dict)]
            thought = "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str)) or None
        else:
            raise invalid(f"input item type {kind!r} is not supported (message, function_call, "
                          "function_call_output, reasoning)", f"{where}.type")
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of objects", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tool type {kind!r} is not supported: function tools only", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid("a function tool needs a 'name'", f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                  "\"name\": ...}", "tool_choice")


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise invalid("'text.format' must be an object with a 'type'", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": {**spec, "schema": fmt.get("schema")}}
    return fmt  # "text", "json_object"; anything else is refused as response_format's type


# ----------------------------------------------------------------------------- the response


class ResponseBuilder:
    """One response's objects: its output items as the reply gives them, the response object at
    each stage, and what the store keeps of it."""

    def __init__(self, response_id: str, model: str, request: ResponsesRequest, chat: ParsedRequest,
                 token_bytes: Callable[[int], bytes], count_tokens: Callable[[str], int]) -> None:
        self.response_id = response_id
        self.created = int(time.time())
        self.model = model
        self.request = request
        self.chat = chat
        self.count_tokens = count_tokens
        self._logprob_renderer = ChatRenderer(response_id, self.created, model, token_bytes, logprobs=True)
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
        if not self.request.logprobs or not entries:
            return []
        return self._logprob_renderer._logprobs(entries)["content"]  # type: ignore[index]

    def obj(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "model": self.model,
            "output": self.output,
            "store": self.request.store,
            "usage": self.usage,
            **self.request.echo,
        }

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        thought = "".join(p["text"] for item in self.output if item["type"] == "reasoning" for p in item["content"])
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            # the thought's text counted again by the tokenizer (the engine counts the reply's tokens whole)
            "output_tokens_details": {"reasoning_tokens": min(self.count_tokens(thought), completion_tokens) if thought else 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def stored(self) -> StoredResponse:
        """The response and its conversation with the reply as an assistant message (chat form)."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "reasoning":
                message["reasoning_content"] = "".join(p["text"] for p in item["content"])
            elif item["type"] == "message":
                message["content"] += "".join(p["text"] for p in item["content"])
            elif item["type"] == "function_call":
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return StoredResponse(self.obj(), (*self.request.history, message))

    # items
    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def message_item(self, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {"type": "message", "id": new_id("msg_"), "status": status, "role": "assistant",
                "content": [self.text_part(text, logprobs)]}

    @staticmethod
    def text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @staticmethod
    def call_item(call: ToolCall, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": status}

    def whole(self, result: ChoiceResult, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """A non-streamed response from its one choice."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        if result.reasoning:
            self.output.append(self.reasoning_item(result.reasoning, status))
        if result.text or not result.tool_calls:
            self.output.append(self.message_item(result.text, self.logprobs(result.logprobs), status))
        for call in result.tool_calls or []:
            self.output.append(self.call_item(call, "completed"))
        self.finish(result.finish_reason or "stop", prompt_tokens, completion_tokens, cached_tokens)
        return self.obj()


def sse_event(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


class _EventStream:
    """A streamed response's events as the reply's parts arrive: one output item open at a time."""

    def __init__(self, b: ResponseBuilder) -> None:
        self.b = b
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the open message's, or the reply's so far

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(obj)

    def _index(self) -> int:
        return len(self.b.output) - 1

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        self.b.output.append(item)
        self.open, self.text = item, []
        out = [self.event("response.output_item.added", output_index=self._index(), item=item)]
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part=self.b.text_part("", [])))
        return out

    def close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        text, i, out = "".join(self.text), self._index(), []
        if item["type"] == "message":
            part = self.b.text_part(text, self.logprobs)
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=text, logprobs=self.logprobs))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part))
            item["content"] = [part]
            self.logprobs = []
        else:
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=text))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def part(self, part: Any, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(part, ToolCall):
            out += self.close("completed")
            item = self.b.call_item(part, "in_progress")
            item["arguments"] = ""
            out += self._start(item)
            self.open = None
            i = self._index()
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=part.arguments))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=part.name, arguments=part.arguments))
            item.update(arguments=part.arguments, status="completed")
            out.append(self.event("response.output_item.done", output_index=i, item=item))
            return out
        kind, text = part
        wanted = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != wanted:
            out += self.close("completed")
            out += self._start(self.b.reasoning_item("", "in_progress") if wanted == "reasoning"
                               else self.b.message_item("", [], "in_progress"))
        self.text.append(text)
        item, i = self.open, self._index()
        if wanted == "message":
            self.logprobs += logprobs
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                                  delta=text, logprobs=logprobs))
        else:
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=i,
                                  content_index=0, delta=text))
        return out


async def event_frames(gen: Generation, b: ResponseBuilder, on_done: Callable[[ResponseBuilder], None],
                       on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response (the module docstring); `on_done` gets the builder of a
    response that completed or ended incomplete."""
    s = _EventStream(b)
    try:
        yield s.event("response.created", response=b.obj())
        yield s.event("response.in_progress", response=b.obj())
        reader = gen.reply_format.reader()
        pending: list[dict[str, Any]] = []  # logprobs of tokens not yet sent with a text delta
        async with contextlib.aclosing(gen.events()) as events:
            async for choice, event in events:
                pending += b.logprobs(event.logprobs)
                parts = reader.feed(event.text) if event.text else []
                if event.finish_reason is not None:
                    parts += reader.finish()
                for part in parts:
                    is_text = not isinstance(part, ToolCall) and part[0] != "reasoning"
                    frames = s.part(part, pending if is_text else [])
                    if is_text:
                        pending = []
                    for frame in frames:
                        if on_first_token is not None:
                            on_first_token()
                            on_first_token = None
                        yield frame
                if event.finish_reason is None:
                    continue
                error = abnormal_end(gen, choice, event)
                if error is not None:
                    for frame in _failed(s, error):
                        yield frame
                    return
                status = "incomplete" if event.finish_reason == "length" else "completed"
                if pending and s.open is not None and s.open["type"] == "message":
                    s.logprobs += pending
                for frame in s.close(status):
                    yield frame
                if not any(item["type"] in ("message", "function_call") for item in b.output):
                    for frame in s._start(b.message_item("", [], "in_progress")) + s.close(status):
                        yield frame
                b.finish(event.finish_reason, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
                on_done(b)
                yield s.event(f"response.{b.status}", response=b.obj())
    except Exception:
        log.exception("streaming response %s failed", b.response_id)
        gen.cancel()
        for frame in _failed(s, ApiError(500, "internal error while streaming", type=SERVER_ERROR,
                                         code="internal_error")):
            yield frame


def _failed(s: _EventStream, error: ApiError) -> list[bytes]:
    s.b.status = "failed"
    s.b.error = {"code": error.code or "server_error", "message": error.message}
    return [s.event("error", code=error.code, message=error.message, param=error.param),
            s.event("response.failed", response=s.b.obj())]
