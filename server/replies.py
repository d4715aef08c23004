"""A chat choice's reply read for its parts: thoughts (`reasoning_content`, server/reasoning.py),
tool calls (`tool_calls`, server/tool_calls.py) and the content left. `ReplyReader` takes the
text as it streams (server/generation.py's SSE path) or whole (its non-streaming path, `read`),
so that both give the same parts.
"""

from __future__ import annotations

import dataclasses

from server.reasoning import ReasoningStream
from server.tool_calls import CallArgs, CallStart, ToolCall, ToolCallStream

# What the reader hands back: ("reasoning", text), ("content", text), a whole call, or (with
# `stream_args`) a streamed call's head and arguments before the call that ends it.
Part = tuple[str, str] | ToolCall | CallStart | CallArgs


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """How one request's replies are read: `thoughts` split out (and whether the prompt opened
    one), calls read by `tool_parser` (None: none)."""

    thoughts: bool = False
    opens_thought: bool = False
    tool_parser: str | None = None
    parallel_tool_calls: bool = True

    @property
    def is_plain(self) -> bool:
        return not self.thoughts and self.tool_parser is None

    def reader(self, stream_args: bool = False) -> ReplyReader:
        """`stream_args`: a call's arguments go out as they arrive (a streamed response's reader;
        `ToolCallStream`), rather than in the whole call."""
        thoughts = ReasoningStream(self.opens_thought) if self.thoughts else None
        calls = ToolCallStream(self.tool_parser, self.parallel_tool_calls, stream_args) if self.tool_parser else None
        return ReplyReader(thoughts, calls)


class ReplyReader:
    def __init__(self, thoughts: ReasoningStream | None, calls: ToolCallStream | None) -> None:
        self._thoughts = thoughts
        self._calls = calls

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls if self._calls is not None else 0

    def feed(self, text: str) -> list[Part]:
        parts = self._thoughts.feed(text) if self._thoughts is not None else [("content", text)]
        return self._read_calls(parts)

    def finish(self) -> list[Part]:
        out = self._read_calls(self._thoughts.finish()) if self._thoughts is not None else []
        if self._calls is not None:
            out += [("content", p) if isinstance(p, str) else p for p in self._calls.finish()]
        return out

    def _read_calls(self, parts: list[tuple[str, str]]) -> list[Part]:
        if self._calls is None:
            return list(parts)
        out: list[Part] = []
        for kind, text in parts:
            if kind != "content":
                out.append((kind, text))
                continue
            out += [("content", p) if isinstance(p, str) else p for p in self._calls.feed(text)]
        return out


@dataclasses.dataclass
class Reply:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall] | None  # None: not read for calls


def read(fmt: ReplyFormat, text: str) -> Reply:
    """A whole reply's parts, as a stream of it gives them."""
    reader = fmt.reader()
    parts = reader.feed(text) + reader.finish()
    reasoning = "".join(p[1] for p in parts if not isinstance(p, ToolCall) and p[0] == "reasoning")
    return Reply(
        content="".join(p[1] for p in parts if not isinstance(p, ToolCall) and p[0] == "content"),
        reasoning=reasoning or None,
        tool_calls=[p for p in parts if isinstance(p, ToolCall)] if fmt.tool_parser else None,
    )
