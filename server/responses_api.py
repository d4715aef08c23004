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
instructions) comes before the new input, as OpenAI's does. Responses are stored unless `store`
is false, in memory (`ResponseStore`: the newest 256, at most 64 MiB of their JSON); `GET` and
`DELETE /v1/responses/{id}` read and remove them. Not served (400): `background`,
`conversation`, `prompt`, `truncation: "auto"`, tools other than functions, `item_reference` and
non-text input (images, files, audio). A null field is an absent one.

The reply's parts become items in the order they come (`_Items`; text after a call is a message
of its own), the same items streamed or not. Streaming (`event_frames`) sends OpenAI's typed
events as SSE (`event:` and `data:` lines, each with its `sequence_number`):
`response.created`, `response.in_progress`, per output item `response.output_item.added` (its
content empty) / `.done` with its part's events between (`response.content_part.added` /
`.done` around `response.output_text.delta` / `.done`, or `response.reasoning_text.delta` /
`.done`; `response.function_call_arguments.delta` / `.done`: a call's arguments as they are
generated, or whole once the call is read, as the chat stream sends them), then `response.completed` or `response.incomplete`; an error after the
headers an `error` event and `response.failed`. No `[DONE]`. Logprobs (`top_logprobs`, or
`include: ["message.output_text.logprobs"]`) are those of the tokens whose text reaches an
`output_text` (a thought's or a call's tokens have none).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from scheduler.types import TokenLogprob
from server import samplers
from server.errors import SERVER_ERROR, ApiError, invalid
from server.generation import Generation, reply_parts, typed_sse_frame
from server.openai_api import ChatRenderer, MAX_TOP_LOGPROBS
from server.tool_calls import CallArgs, CallStart, ToolCall

log = logging.getLogger(__name__)

# Fields of a Responses request that pass to the chat request as they are: OpenAI's sampling
# fields the two APIs share, and the chat endpoint's extensions (README, "Request fields").
PASSED_THROUGH = (
    "model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "seed", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
    "ignore_eos", "cache_prompt", "cache_salt", "chat_template_kwargs", "reasoning_format", "json_schema",
    "grammar", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "speculative.n_max", "min_tokens", *samplers.FIELDS,
)
# Chat fields a Responses request names otherwise, for the `param` and message of a 400 (the
# more specific first).
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"), ("messages", "input"))
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
    size: int = 0  # bytes it is counted as (its JSON)


class ResponseStore:
    """The newest responses by id, at most `max_entries` of them and `max_bytes` of their JSON
    (oldest dropped first; a response larger than that is not kept). Any thread: the event loop
    writes, tests read."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        stored.size = len(json.dumps(stored.response)) + len(json.dumps(stored.messages))
        with self._lock:
            self._drop(response_id)
            if stored.size > self.max_bytes:
                log.info("response %s (%d bytes) is larger than the store's %d bytes: not kept",
                         response_id, stored.size, self.max_bytes)
                return
            self._items[response_id] = stored
            self._bytes += stored.size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        return old is not None

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ----------------------------------------------------------------------------- the request


def chat_param(param: str | None) -> str | None:
    """A chat field's name in a 400 as the Responses request names it."""
    for chat, ours in _PARAM_NAMES:
        if param is not None and (param == chat or param.startswith(chat + ".") or param.startswith(chat + "[")):
            return ours + param[len(chat):]
    return param


def renamed(error: ApiError) -> ApiError:
    """A chat request's error with its fields named as the Responses request names them."""
    message = error.message
    for chat, ours in _PARAM_NAMES:
        message = message.replace(f"'{chat}'", f"'{ours}'")
    for chat, ours in _PARAM_NAMES[:4]:  # names no English word shares
        message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
    return ApiError(error.status, message, type=error.type, param=chat_param(error.param), code=error.code,
                    headers=error.headers)


def to_chat(body: Any, store: ResponseStore) -> ResponsesRequest:
    """The chat request a Responses request is served as, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    for name in ("background", "conversation", "prompt"):
        if body.get(name) not in (None, False):
            raise invalid(f"'{name}' is not supported by this server", name)
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("only 'truncation': 'disabled' is supported (a prompt over the context is a 400)", "truncation")
    body = {k: v for k, v in body.items() if v is not None}  # null: the field's default, as elsewhere
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


def text_of(content: Any, where: str, parts: tuple[str, ...]) -> str:
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
    thought: list[str] | None = None  # reasoning items' text since the last assistant output

    def assistant() -> dict[str, Any]:
        """The assistant message the next output joins: a new one after a reasoning item (a new
        turn's thought) or after another role's message."""
        nonlocal thought
        if not out or out[-1]["role"] != "assistant" or thought is not None:
            out.append({"role": "assistant", "content": ""})
        if thought:
            out[-1]["reasoning_content"] = "\n".join(thought)
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
            text = text_of(item.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                message = assistant()
                if message.get("tool_calls") or message["content"]:  # a new turn of the assistant's
                    out.append({"role": "assistant", "content": text})
                else:
                    message["content"] = text
            else:
                thought = None  # a thought the assistant did not act on is not part of the conversation
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
            text = text_of(item.get("output"), f"{where}.output", TEXT_PARTS)
            thought = None
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            texts = _reasoning_texts(item, where)
            thought = (thought or []) + ([texts] if texts else [])
        else:
            raise invalid(f"input item type {kind!r} is not supported (message, function_call, "
                          "function_call_output, reasoning)", f"{where}.type")
    return out


def _reasoning_texts(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary's text."""
    found = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise invalid(f"a reasoning item's '{key}' must be an array of parts with a 'text'", f"{where}.{key}")
        found.append("\n".join(p["text"] for p in parts))
    return next((text for text in found if text), "")


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
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("a 'json_schema' format needs a 'schema' object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": {**spec, "schema": fmt.get("schema")}}
    return fmt  # "text", "json_object"; anything else is refused as response_format's type


# ----------------------------------------------------------------------------- the response


class ResponseBuilder:
    """One response's object: its output items as the reply gives them, its status and usage,
    and what the store keeps of it."""

    def __init__(self, response_id: str, model: str, request: ResponsesRequest,
                 token_bytes: Callable[[int], bytes], count_tokens: Callable[[str], int]) -> None:
        self.response_id = response_id
        self.created = int(time.time())
        self.model = model
        self.request = request
        self.count_tokens = count_tokens
        self._logprob_renderer = ChatRenderer(response_id, self.created, model, token_bytes)
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
        if not self.request.logprobs or not entries:
            return []
        return self._logprob_renderer.logprob_entries(entries)

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

    def thought(self) -> str:
        return "".join(p["text"] for item in self.output if item["type"] == "reasoning" for p in item["content"])

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: int) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion_tokens)},
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

    def failed(self, error: ApiError) -> dict[str, Any]:
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}
        return self.obj()


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


class _Items:
    """The reply's parts made into output items, one item open at a time, and the events that
    stream them (a non-streamed response makes the same items and drops the events)."""

    def __init__(self, b: ResponseBuilder) -> None:
        self.b = b
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.calls: dict[str, tuple[dict[str, Any], int]] = {}  # an open call's item and output index, by call id

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return typed_sse_frame(obj)

    def _added(self, item: dict[str, Any]) -> list[bytes]:
        self.b.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.b.output) - 1, item=item)]

    def _open(self, kind: str) -> list[bytes]:
        prefix, part = ("rs_", {"type": "reasoning_text", "text": ""}) if kind == "reasoning" else ("msg_", _text_part("", []))
        item: dict[str, Any] = {"type": kind, "id": new_id(prefix), "status": "in_progress", "content": []}
        if kind == "reasoning":
            item["summary"] = []
        else:
            item["role"] = "assistant"
        out = self._added(item)
        self.open, self.text, self.logprobs = item, [], []
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.b.output) - 1,
                              content_index=0, part=part))
        return out

    def close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        text, i = "".join(self.text), len(self.b.output) - 1
        at = dict(item_id=item["id"], output_index=i, content_index=0)
        if item["type"] == "message":
            part = _text_part(text, self.logprobs)
            out = [self.event("response.output_text.done", **at, text=text, logprobs=self.logprobs)]
        else:
            part = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", **at, text=text)]
        out.append(self.event("response.content_part.done", **at, part=part))
        item.update(content=[part], status=status)
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def call_start(self, head: CallStart) -> list[bytes]:
        """A call's item opened (its arguments to come: `call_args`, then `call`)."""
        out = self.close("completed")
        item = {"type": "function_call", "id": "fc_" + head.id.removeprefix("call_"), "call_id": head.id,
                "name": head.name, "arguments": "", "status": "in_progress"}
        out += self._added(item)
        self.calls[head.id] = item, len(self.b.output) - 1
        return out

    def call_args(self, call_id: str, text: str) -> list[bytes]:
        item, i = self.calls[call_id]
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=text)]

    def call(self, call: ToolCall) -> list[bytes]:
        """A call's item done (opened and its arguments sent first, unless they went out as streamed)."""
        out = [] if call.streamed else self.call_start(CallStart(call.id, call.name)) + self.call_args(call.id, call.arguments)
        item, i = self.calls.pop(call.id)
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=call.name, arguments=call.arguments))
        # a streamed call cut short (max_tokens) or broken has arguments that are no JSON object
        item.update(arguments=call.arguments, status="completed" if call.arguments_object() is not None else "incomplete")
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def text_delta(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close("completed")
            out += self._open(kind)
        self.text.append(text)
        at = dict(item_id=self.open["id"], output_index=len(self.b.output) - 1, content_index=0)  # type: ignore[index]
        if kind == "message":
            self.logprobs += logprobs
            out.append(self.event("response.output_text.delta", **at, delta=text, logprobs=logprobs))
        else:
            out.append(self.event("response.reasoning_text.delta", **at, delta=text))
        return out


async def _reply_items(gen: Generation, items: _Items, streamed: bool = False) -> AsyncIterator[bytes]:
    """The reply read into output items (thoughts, text, calls, as a chat reply is read) with
    their events, then the response finished; an abnormal end raises its `ApiError`. The
    logprobs of a token go with the text part its text reaches first (those of a thought's or a
    call's tokens go nowhere: output items other than text have no logprobs)."""
    b = items.b
    pending: list[dict[str, Any]] = []  # logprobs of the tokens read since the last part
    async for event, parts, _ in reply_parts(gen, streamed):
        pending += b.logprobs(event.logprobs)
        for part in parts:
            if isinstance(part, CallStart):
                frames = items.call_start(part)
            elif isinstance(part, CallArgs):
                frames = items.call_args(part.id, part.text)
            elif isinstance(part, ToolCall):
                frames = items.call(part)
            else:
                kind = "reasoning" if part[0] == "reasoning" else "message"
                frames = items.text_delta(kind, part[1], pending if kind == "message" else [])
            pending = []
            for frame in frames:
                yield frame
        if event.finish_reason is None:
            continue
        status = "incomplete" if event.finish_reason == "length" else "completed"
        if items.open is not None and items.open["type"] == "message":
            items.logprobs += pending  # tokens held back at the end (a stop string's)
        frames = items.close(status)
        if not any(item["type"] in ("message", "function_call") for item in b.output):
            frames += items._open("message") + items.close(status)  # every reply has its message
        for frame in frames:
            yield frame
        thought = b.thought()
        # counted again by the tokenizer, off the event loop (the engine counts the reply whole)
        reasoning_tokens = await asyncio.to_thread(b.count_tokens, thought) if thought else 0
        b.finish(event.finish_reason, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, reasoning_tokens)


async def whole(gen: Generation, b: ResponseBuilder) -> dict[str, Any]:
    """A non-streamed response: the items a stream would have made; raises `ApiError` on failure."""
    async for _ in _reply_items(gen, _Items(b)):
        pass
    return b.obj()


async def event_frames(gen: Generation, b: ResponseBuilder, on_done: Callable[[ResponseBuilder], None],
                       on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response (the module docstring); `on_done` gets the builder of a
    response that completed or ended incomplete."""
    items = _Items(b)
    try:
        yield items.event("response.created", response=b.obj())
        yield items.event("response.in_progress", response=b.obj())
        async for frame in _reply_items(gen, items, streamed=True):
            if on_first_token is not None:
                on_first_token()
                on_first_token = None
            yield frame
        on_done(b)
        yield items.event(f"response.{b.status}", response=b.obj())
    except ApiError as error:  # the engine's end of the request (abnormal_end logged it)
        for frame in _failed(items, error):
            yield frame
    except Exception:
        log.exception("streaming response %s failed", b.response_id)
        gen.cancel()
        for frame in _failed(items, ApiError(500, "internal error while streaming", type=SERVER_ERROR,
                                             code="internal_error")):
            yield frame


def _failed(items: _Items, error: ApiError) -> list[bytes]:
    frames = [items.event("error", code=error.code, message=error.message, param=error.param)]
    try:
        frames.append(items.event("response.failed", response=items.b.failed(error)))
    except Exception:  # the response object itself cannot be written: the error event says it all
        log.exception("response %s: its failed response could not be written", items.b.response_id)
    return frames
