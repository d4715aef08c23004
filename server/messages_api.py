"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served by the
chat pipeline, for Anthropic's SDKs and the tools built on them.

A request becomes a chat request (`to_chat`): `system` a system message first, each message's
content blocks the chat messages (`text`; an assistant's `tool_use` blocks its `tool_calls`, its
`thinking` its `reasoning_content`; a user's `tool_result` blocks tool messages, before the
user's text), `tools` (`name`, `description`, `input_schema`) function tools, `tool_choice`
(`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`) the chat forms, `stop_sequences`
the `stop`, `thinking` the chat template's `enable_thinking` (Qwen3's switch; other templates
ignore it; off unless asked, as Anthropic's default is), and a final assistant message a
prefill that the reply continues (`continue_final_message`). The chat endpoint's sampling
fields and our extensions pass through (`seed`, `min_p`, `repetition_penalty`, ...). Refused
(400): image and document blocks, server tools (a `type` other than `custom`), and a missing
`max_tokens`.

The reply, read as a chat reply is (server/replies.py), becomes content blocks in the order it
gives them: `thinking`, `text`, and a `tool_use` per call (its `input` the arguments object);
`stop_reason` is `end_turn`, `max_tokens`, `stop_sequence` (with the one matched) or
`tool_use`. Streaming sends Anthropic's events (`message_start`, per block
`content_block_start` / `content_block_delta` (`text_delta`, `thinking_delta`,
`input_json_delta`: a call's input as the chat stream sends its arguments) / `content_block_stop`, then
`message_delta` and `message_stop`; a failure after the headers an `error` event). Errors are
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

from server.errors import ApiError, anthropic_error_body, invalid
from server.generation import Generation, matched_stop, reply_parts, typed_sse_frame
from server.responses_api import PASSED_THROUGH, new_id, text_of
from server.tool_calls import CallArgs, CallStart, ToolCall

log = logging.getLogger(__name__)

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
_PARAM_NAMES = (("max_completion_tokens", "max_tokens"), ("messages", "messages"), ("stop", "stop_sequences"))


def to_chat(body: Any) -> dict[str, Any]:
    """The chat request an Anthropic Messages request is served as, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    body = {k: v for k, v in body.items() if v is not None}
    chat: dict[str, Any] = {k: body[k] for k in PASSED_THROUGH if k in body and k not in ("stop", "parallel_tool_calls")}
    if "max_tokens" not in body:
        raise invalid("'max_tokens' is required", "max_tokens")
    chat["max_completion_tokens"] = body["max_tokens"]
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _blocks_text(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(given):
        messages += _chat_messages(message, f"messages[{i}]")
    chat["messages"] = messages
    if messages[-1]["role"] == "assistant":  # a prefill: the reply continues it (Anthropic's way)
        chat["continue_final_message"] = True
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = _chat_tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _chat_tool_choice(choice)
        chat["parallel_tool_calls"] = parallel
    thinking = body.get("thinking", {"type": "disabled"})  # Anthropic's default: no thinking
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("'thinking' must be {\"type\": \"enabled\" | \"adaptive\" | \"disabled\", ...}", "thinking")
    kwargs = chat.get("chat_template_kwargs", {})
    if isinstance(kwargs, dict):  # (anything else the chat parser refuses)
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled", **kwargs}
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("'metadata' must be an object", "metadata")
    return chat


def renamed(error: ApiError) -> ApiError:
    param = error.param
    for chat, ours in _PARAM_NAMES:
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            param = ours + param[len(chat):]
    message = error.message.replace("'max_completion_tokens'", "'max_tokens'")
    return ApiError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


def _blocks_text(content: Any, where: str) -> str:
    """A string, or text blocks, as one string."""
    return text_of(content, where, ("text",))


def _chat_messages(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise invalid("each message must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"'role' must be user or assistant, got {role!r}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of blocks", f"{where}.content")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thought: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid("a tool_result block needs 'tool_use_id' (a string)", f"{at}.tool_use_id")
            text = _blocks_text(block.get("content", ""), f"{at}.content")
            if not isinstance(block.get("is_error", False), bool):
                raise invalid("'is_error' must be a boolean", f"{at}.is_error")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid("a tool_use block needs 'id' and 'name' (strings)", at)
            if not isinstance(block.get("input", {}), dict):
                raise invalid("a tool_use block's 'input' must be an object", f"{at}.input")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thought.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind in ("text", "thinking"):
            raise invalid(f"a {kind} block needs '{kind}' (a string)", at)
        else:
            raise invalid(f"block type {kind!r} is not supported in the {role}'s message", at)
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if thought:
            reply["reasoning_content"] = "\n".join(thought)
        if calls:
            reply["tool_calls"] = calls
        return [reply]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of objects", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tool type {kind!r} is not supported: client tools only", f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid("a tool needs a 'name'", f"tools[{i}].name")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid("a tool's 'input_schema' must be an object (a JSON schema)", f"tools[{i}].input_schema")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> tuple[Any, bool]:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise invalid("'disable_parallel_tool_use' must be a boolean", "tool_choice.disable_parallel_tool_use")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("a tool_choice of type 'tool' needs its 'name'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


# ----------------------------------------------------------------------------- the reply


class MessageBuilder:
    """One reply's content blocks as its parts arrive, their stream events, and the message."""

    def __init__(self, message_id: str, model: str, stop: tuple[str, ...], eog_ids: tuple[int, ...],
                 decode: Callable[[list[int]], str]) -> None:
        self.message_id, self.model, self.stop, self.eog_ids, self.decode = message_id, model, stop, eog_ids, decode
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the text or thinking block being written
        self.calls: dict[str, int] = {}  # an open tool_use block's index, by call id
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                                      "cache_read_input_tokens": 0}

    def message(self) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}

    event = staticmethod(typed_sse_frame)

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self.event({"type": "content_block_stop", "index": len(self.content) - 1})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.content.append(block)
        return [self.event({"type": "content_block_start", "index": len(self.content) - 1,
                            "content_block": {**block, **({"input": {}} if block["type"] == "tool_use" else {})}})]

    def part(self, part: Any) -> list[bytes]:
        if isinstance(part, (CallStart, CallArgs, ToolCall)):
            return self._call_part(part)
        out = self._close() if self.open is None or self.open["type"] != ("thinking" if part[0] == "reasoning" else "text") else []
        kind, text = part
        if self.open is None:
            self.open = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else {"type": "text", "text": ""}
            out += self._start(self.open)
        key, delta = ("thinking", "thinking_delta") if kind == "reasoning" else ("text", "text_delta")
        self.open[key] += text
        out.append(self.event({"type": "content_block_delta", "index": len(self.content) - 1,
                               "delta": {"type": delta, key: text}}))
        return out

    def _call_part(self, part: CallStart | CallArgs | ToolCall) -> list[bytes]:
        """A tool_use block: opened by a streamed call's head (or a whole call), its input as
        `input_json_delta`s, closed by the call."""
        out: list[bytes] = []
        if isinstance(part, CallStart) or isinstance(part, ToolCall) and not part.streamed:
            out += self._close()
            block = {"type": "tool_use", "id": "toolu_" + part.id.removeprefix("call_"), "name": part.name, "input": {}}
            out += self._start(block)
            self.calls[part.id] = len(self.content) - 1
        if isinstance(part, CallStart):
            return out
        i = self.calls[part.id]
        text = part.text if isinstance(part, CallArgs) else None if part.streamed else part.arguments
        if text:
            out.append(self.event({"type": "content_block_delta", "index": i,
                                   "delta": {"type": "input_json_delta", "partial_json": text}}))
        if isinstance(part, ToolCall):
            self.content[i]["input"] = part.arguments_object() or {}  # {}: a streamed call cut short or broken
            out.append(self.event({"type": "content_block_stop", "index": i}))
            del self.calls[part.id]
        return out

    def finish(self, finish_reason: str, calls: int, prompt_tokens: int, completion_tokens: int, cached: int) -> list[bytes]:
        out = self._close()
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        self.stop_reason = _STOP_REASONS.get(reason, "end_turn")
        if self.stop_reason == "end_turn":
            self.stop_sequence = matched_stop(self.stop, self.token_ids, self.eog_ids, self.decode)
            if self.stop_sequence is not None:
                self.stop_reason = "stop_sequence"
        self.usage.update(input_tokens=prompt_tokens - cached, cache_read_input_tokens=cached,
                          output_tokens=completion_tokens)
        return out


async def _reply(gen: Generation, b: MessageBuilder, streamed: bool = False) -> AsyncIterator[bytes]:
    """The reply's blocks and their events (`streamed`: a call's arguments as they arrive); an
    abnormal end raises its `ApiError`."""
    async for event, parts, reader in reply_parts(gen, streamed):
        b.token_ids += event.token_ids
        for part in parts:
            for frame in b.part(part):
                yield frame
        if event.finish_reason is not None:
            for frame in b.finish(event.finish_reason, reader.num_calls, gen.prompt_tokens, gen.completion_tokens,
                                  gen.cached_tokens):
                yield frame


async def whole(gen: Generation, b: MessageBuilder) -> dict[str, Any]:
    async for _ in _reply(gen, b):
        pass
    return b.message()


async def event_frames(gen: Generation, b: MessageBuilder, prompt_tokens: int,
                       on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    start = b.message()
    start["usage"] = {**b.usage, "input_tokens": prompt_tokens}
    try:
        yield b.event({"type": "message_start", "message": start})
        async for frame in _reply(gen, b, streamed=True):
            if on_first_token is not None:
                on_first_token()
                on_first_token = None
            yield frame
        yield b.event({"type": "message_delta", "delta": {"stop_reason": b.stop_reason, "stop_sequence": b.stop_sequence},
                       "usage": b.usage})
        yield b.event({"type": "message_stop"})
    except ApiError as error:
        yield b.event(anthropic_error_body(error))
    except Exception:
        log.exception("streaming message %s failed", b.message_id)
        gen.cancel()
        yield b.event({"type": "error", "error": {"type": "api_error", "message": "internal error while streaming"}})


def message_id() -> str:
    return new_id("msg_")
