"""Tool calls in a chat model's output, returned as OpenAI's `tool_calls` (vLLM's
`--tool-call-parser`, llama-server's tool-call formats).

A chat request with `tools` (and `tool_choice` "auto", the default) has its generated text read
by the parser for the chat template's call format, `detect` (or `--tool-call-parser`):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
  them (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3 and other templates that name `<tool_call>`).
- `llama3_json`: the whole reply is one JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), as Llama 3.1-3.3 templates ask for (`<|python_tag|>`, a control
  token, is not in the text).
- `mistral`: the whole reply is a JSON array of `{"name", "arguments"}` objects, after the
  `[TOOL_CALLS]` control token (Mistral's v3 templates).

`ToolCallStream` reads a choice's text as it streams and hands back content and complete calls;
a non-streaming response feeds it the whole text (server/replies.py), so both see the same calls
and content. With `stream_args` (a streamed response's reader) a call that opens as
`{"name": ..., "arguments": {` (or "parameters") goes out in parts as it is generated:
`CallStart` (its id and name), `CallArgs` (its arguments' text as `json.dumps` of the parsed
object writes it: server/json_stream.py), then the call itself, `streamed` (in the whole-reply
forms each object of the reply so, `_CallSequence`). Such a call that breaks once its
arguments began (cut short, or text that stops being JSON) ends with the arguments sent so
far, and the text from the break on is content, as is, in the whole-reply forms, a later part
of the reply that is no call; read whole, those replies are text.

Text a call might be starting (a prefix of `<tool_call>`, or a reply that opens like a JSON
call) is held back until it is known. Content on both sides of a call is joined by the
whitespace before the call; whitespace that only borders calls is dropped. A call whose JSON
does not parse (or holds NaN or Infinity, which strict JSON readers refuse) comes back as the
text it was, so nothing else the model wrote is lost.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from scheduler.grammar import JSON_WHITESPACE
from server.json_stream import WHITESPACE, ObjectReader

PARSERS = ("hermes", "llama3_json", "mistral")
CHOICES = ("auto", "none", *PARSERS)  # --tool-call-parser
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def detect(template: str | None) -> str | None:
    """The call format a chat template asks its model for; None where it names none."""
    if not template:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return "llama3_json"
    return None


def resolve(flag: str, template: str | None) -> str | None:
    """--tool-call-parser's value for the template served: a parser name, or None (calls stay text)."""
    if flag not in CHOICES:
        raise ValueError(f"tool call parser must be one of {', '.join(CHOICES)}, got {flag!r}")
    if flag == "auto":
        return detect(template)
    return None if flag == "none" else flag


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=_call_id)
    # its head and arguments went out before it (`CallStart`, `CallArgs`): this ends the call
    streamed: bool = False

    def arguments_object(self) -> dict[str, Any] | None:
        """The arguments parsed; None where they are no JSON object (a streamed call cut short or
        broken, or nested deeper than json reads)."""
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError):
            return None
        return value if isinstance(value, dict) else None

    def render(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def call_from(obj: Any) -> ToolCall | None:
    """A call from a parsed JSON object with a name and an arguments object (`parameters` in
    Llama 3's form; an arguments string holding a JSON object is taken too); None otherwise."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if "arguments" not in obj and "parameters" not in obj:  # e.g. a JSON answer that has a name
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    try:  # strict JSON: NaN or a number beyond float's range (Infinity) is no call a client can read
        return ToolCall(name, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


def _json_calls(text: str, separators: str) -> list[ToolCall] | None:
    """Every JSON value in `text` (between `separators` and whitespace) as calls (an array's
    items each one); None unless all of the text is such values and each is a call."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        for obj in value if isinstance(value, list) else [value]:
            call = call_from(obj)
            if call is None:
                return None
            calls.append(call)


MISTRAL_OPEN = "[TOOL_CALLS]"


def control_token(tokenizer: Any, text: str) -> int | None:
    """The id of the control token spelled `text` (e.g. Mistral's `[TOOL_CALLS]`), or None where
    the vocabulary has none: `text` must encode, control tokens parsed, to one token that decodes
    to nothing once control tokens are skipped."""
    ids = tokenizer.encode(text, add_bos=False, parse_special=True)
    if len(ids) != 1 or tokenizer.decode(ids, skip_special=True):
        return None
    return int(ids[0])


def forced_grammar(parser: str | None, tools: list[dict[str, Any]], name: str | None, parallel: bool,
                   mistral_open: int | None = None) -> str:
    """tool_choice "required" (`name` None: any of the tools) or a named function: a Lark
    grammar (llguidance's, with its %json schemas) that admits only calls in the parser's format,
    each with a tool's name and arguments that follow its parameters' schema; one call, or with
    `parallel` several. The hermes tags are text (a vocabulary's `<tool_call>` token, user-defined,
    not a control token, is their text: the grammar admits it whole); mistral's calls open with its
    `[TOOL_CALLS]` control token, `mistral_open` (its id: `control_token`), which the grammar names
    by id. ValueError where the format cannot be forced (no parser, or mistral's without that
    token)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    schemas = [{"type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: f.get("parameters") or {"type": "object"}},
                "required": ["name", args_key], "additionalProperties": False} for f in chosen]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # the whitespace a JSON schema's grammar allows everywhere else (scheduler/grammar.py)
    body = json.dumps({**body, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}, ensure_ascii=False)
    if parser == "hermes":
        lines = ['start: call ("\\n" call)*' if parallel else "start: call",
                 f'call: {json.dumps(HERMES_OPEN)} "\\n" body "\\n" {json.dumps(HERMES_CLOSE)}']
    elif parser == "llama3_json":
        lines = ['start: body ("; " body)*' if parallel else "start: body"]
    elif parser == "mistral" and mistral_open is not None:
        # `[TOOL_CALLS] [{...}, {...}]`; the reader sees the array alone (the token is skipped)
        lines = [f'start: <[{mistral_open}]> " "? "[" body ' + ('(", " body)* "]"' if parallel else '"]"')]
    elif parser == "mistral":
        raise ValueError(f"tool_choice \"required\" or a named function: mistral's call format opens with the "
                         f"{MISTRAL_OPEN} control token, which this model's vocabulary lacks")
    else:
        raise ValueError(f"tool_choice \"required\" or a named function: the {parser or 'chat template'}'s call "
                         "format cannot be forced (hermes', llama3_json's and mistral's can)")
    return "\n".join([*lines, f"body: %json {body}", ""])


@dataclasses.dataclass(frozen=True)
class CallStart:
    """A streamed call's head (`ToolCallStream`'s `stream_args`): its arguments follow in
    `CallArgs` pieces, and the call itself, `streamed`, ends it."""

    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The next piece of a streamed call's arguments text."""

    id: str
    text: str


# Items `ToolCallStream` hands back: content text, a whole call, or a streamed call's parts.
Piece = str | ToolCall | CallStart | CallArgs
ARGUMENT_KEYS = ("arguments", "parameters")  # `call_from`'s


class _StreamedCall:
    """One call object read as its text comes (a hermes call's body, or one object of the JSON
    forms): once its arguments open as an object after a name, the call's head (`CallStart`),
    then its arguments as `CallArgs` pieces, and at `end` the `streamed` call. `streams` is None
    until that is known; False where the call may not go out (`allowed`), has no name, or
    closed or broke before arguments that open as an object (its owner reads it whole)."""

    def __init__(self) -> None:
        self.reader = ObjectReader(ARGUMENT_KEYS)
        self.head: CallStart | None = None
        self.streams: bool | None = None
        self._args: list[str] = []

    def feed(self, text: str, allowed: bool, out: list[Piece]) -> bool:
        """Reads on (`allowed`: the call may go out, see `parallel`); True where its head went
        out just now."""
        reader = self.reader
        echoed = reader.feed(text)
        opened = False
        if self.streams is None and (reader.echo_open is not None or reader.done or reader.error):
            name = reader.members.get("name")
            self.streams = bool(reader.echo_open and name and allowed)
            if self.streams:
                self.head, opened = CallStart(_call_id(), name), True
                out.append(self.head)
        if self.head is not None and echoed:
            self._args.append(echoed)
            out.append(CallArgs(self.head.id, echoed))
        return opened

    def end(self, out: list[Piece]) -> None:
        """The call's text has ended (a broken or cut call's as far as it was JSON): the rest of
        its arguments, then the call."""
        head = self.head
        assert head is not None
        last = self.reader.end()
        if last:
            self._args.append(last)
            out.append(CallArgs(head.id, last))
        out.append(ToolCall(head.name, "".join(self._args), head.id, streamed=True))


class _CallSequence:
    """`stream_args` in the whole-reply forms (llama3_json: call objects separated by ";";
    mistral: a JSON array of them): each call object read as it comes, one that opens as
    {"name": ..., "arguments" (or "parameters"): {  streamed as hermes' are (`CallStart`,
    `CallArgs`, the call), any other read whole once it closes. `broken` once the text stops
    being calls, from `rest` on."""

    def __init__(self, parser: str, parallel: bool) -> None:
        self.array = parser == "mistral"
        self.separator = "," if self.array else ";"
        self.parallel = parallel
        # open (before "["), item, sep (after an object), end (after "]": another array may follow)
        self.state = "open" if self.array else "item"
        self.num_calls = 0
        self.broken = False
        self.rest = ""
        self._call: _StreamedCall | None = None  # the open object
        self._raw = ""  # the object's text so far

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        i = 0
        while i < len(text) and not self.broken:
            if self._call is not None:
                i += self._object(text[i:], out)
                if self.broken:
                    self.rest += text[i:]
                continue
            c = text[i]
            if c in WHITESPACE or not self.array and c == self.separator and self.state == "sep":
                pass  # llama3_json: any run of ";" between objects, or none, as `_json_calls` reads them
            elif self.state in ("open", "end") and c == "[" or self.array and self.state == "sep" and c == ",":
                self.state = "item"
            elif c == "{" and (self.state == "item" or not self.array and self.state == "sep"):
                self._call, self._raw = _StreamedCall(), ""
                continue  # the reader takes the "{"
            elif self.state == "sep" and self.array and c == "]":
                self.state = "end"
            else:
                self.broken, self.rest = True, text[i:]
            i += 1
        return out

    def finish(self) -> list[Piece]:
        """The text has ended: an object still open ends as a call (a streamed one with the
        arguments sent) or, if it is none, is `rest`."""
        out: list[Piece] = []
        if self._call is not None and not self.broken:
            self._end_object(out)
        return out

    def _object(self, piece: str, out: list[Piece]) -> int:
        """Feeds the open object; returns how much of `piece` it took."""
        call = self._call
        assert call is not None
        reader = call.reader
        base = reader.fed
        if call.feed(piece, self.parallel or self.num_calls == 0, out):
            self.num_calls += 1
        used = reader.error_at - base if reader.error else len(piece)
        self._raw += piece[:used]
        if reader.done or reader.error:
            self._end_object(out)
            self.broken = self.broken or not reader.done  # the text stopped being JSON inside it
            self.state = "sep"
        return used

    def _end_object(self, out: list[Piece]) -> None:
        streamed, self._call = self._call, None
        assert streamed is not None
        if streamed.head is not None:
            streamed.end(out)
            return
        try:
            call = call_from(json.loads(self._raw)) if streamed.reader.done else None
        except (ValueError, RecursionError):
            call = None
        if call is None:  # not a call: the text from this object on
            self.broken, self.rest = True, self._raw
        elif self.parallel or self.num_calls == 0:
            out.append(call)
            self.num_calls += 1


class ToolCallStream:
    """One choice's text in, content and calls out, in order (see the module docstring)."""

    def __init__(self, parser: str, parallel: bool = True, stream_args: bool = False) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}")
        self.parser = parser
        self.parallel = parallel  # False: the first call only (OpenAI's parallel_tool_calls)
        # a call that opens as {"name": ..., "arguments": {...  goes out in parts as its text
        # arrives (`CallStart`, `CallArgs`, the `streamed` call): `_stream_body`, `_CallSequence`
        self.stream_args = stream_args
        self._call: _StreamedCall | None = None  # hermes: the call being streamed
        self._fed = 0  # characters of the call's body given to `_call`
        self.num_calls = 0
        self._held = ""  # text not yet handed back
        self._space = ""  # hermes: content's trailing whitespace, sent before more content, dropped at the end
        self._in_call = False  # hermes: inside <tool_call>
        self._scanned = 0  # hermes: how much of the call's body was searched for its end already
        self._after_call = False  # hermes: the whitespace right after a call is dropped, however it arrives
        self._whole = None if parser == "hermes" else "undecided"  # JSON forms: "undecided", "text", "json", "calls"
        self._sequence: _CallSequence | None = None  # "calls": `stream_args` in a JSON form
        self._raw = ""  # "calls": the reply's text so far

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        if self._whole is not None:
            return self._feed_whole()
        out: list[Piece] = []
        while True:
            if self._in_call:  # search only the new text (and a tag it may finish): a long call stays linear
                end = self._held.find(HERMES_CLOSE, max(0, self._scanned - len(HERMES_CLOSE) + 1))
                if end < 0:
                    self._scanned = len(self._held)
                    self._stream_body(self._held[: len(self._held) - marker_start(self._held, HERMES_CLOSE)], out)
                    return out
                body, self._held = self._held[:end], self._held[end + len(HERMES_CLOSE) :]
                self._in_call = False
                self._stream_body(body, out)
                self._end_call(body, closed=True, out=out)
                continue
            if self._after_call:
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._after_call = False
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                cut = len(self._held) - marker_start(self._held, HERMES_OPEN)
                text, self._held = self._held[:cut], self._held[cut:]
                self._emit(text, out)
                return out
            self._emit(self._held[:start], out)
            self._held = self._held[start + len(HERMES_OPEN) :]
            self._in_call, self._scanned = True, 0
            streams = self.stream_args and (self.parallel or self.num_calls == 0)
            self._call, self._fed = _StreamedCall() if streams else None, 0

    def finish(self) -> list[Piece]:
        """What is left once the text has ended (an unclosed last call is read as a call)."""
        out: list[Piece] = []
        held, self._held = self._held, ""
        if self._whole == "calls":
            self._held = held
            out = self._feed_sequence(finish=True)
            if self._whole == "calls" and self.num_calls == 0 and self._raw:  # no call in it: all of it is text
                out.append(self._raw)
            return out
        if self._whole is not None:
            if self._whole == "json":
                calls = _json_calls(held, ";" if self.parser == "llama3_json" else "")
                if calls is None:
                    out.append(held)
                else:
                    for call in calls:
                        self._add_call(call, out)
            elif held:
                out.append(held)
            return out
        if self._in_call:
            self._in_call = False
            self._stream_body(held, out)
            self._end_call(held, closed=False, out=out)
        else:
            self._emit(held, out)
        if self._space and self.num_calls == 0:  # a reply with calls loses only whitespace beside them
            out.append(self._space)
        self._space = ""
        return out

    def _feed_whole(self) -> list[Piece]:
        if self._whole == "undecided":
            stripped = self._held.lstrip()
            if not stripped:
                return []
            opening = "{" if self.parser == "llama3_json" else "["
            self._whole = "json" if stripped[0] == opening else "text"
            if self._whole == "json" and self.stream_args:
                self._whole, self._sequence, self._raw = "calls", _CallSequence(self.parser, self.parallel), ""
        if self._whole == "calls":
            return self._feed_sequence()
        if self._whole == "json":
            return []  # held whole until the end: only all of it parsed says whether it is calls
        out, self._held = [self._held] if self._held else [], ""
        return out

    def _feed_sequence(self, finish: bool = False) -> list[Piece]:
        """The held text through the call sequence (and, `finish`, its end). Once it breaks, the
        rest is content: all of the reply where no call went out (as the whole reading makes it),
        else the text from the break on."""
        text, self._held = self._held, ""
        self._raw += text
        seq = self._sequence
        assert seq is not None
        out = seq.feed(text)
        if finish and not seq.broken:
            out += seq.finish()
        if seq.broken:
            self._whole = "text"
            rest = self._raw if seq.num_calls == 0 else seq.rest
            if rest:
                out.append(rest)
        self.num_calls = seq.num_calls
        return out

    def _stream_body(self, body: str, out: list[Piece]) -> None:
        """A streamed call's body so far (up to its end or a tag it may be ending in) read on: once
        the arguments open as an object after a name, the call's head, then its arguments as they
        come. A body that opens otherwise (or breaks before that) is read whole at its end."""
        call = self._call
        if call is None or len(body) <= self._fed:
            return
        if call.feed(body[self._fed :], True, out):
            self.num_calls += 1
        self._fed = len(body)
        if call.streams is False:
            self._call = None

    def _end_call(self, body: str, closed: bool, out: list[Piece]) -> None:
        """A call's body has ended: a streamed call ends with what went out of its arguments (a
        broken or cut one as far as it was JSON, the text from there on content); any other is
        read whole."""
        call, self._call = self._call, None
        if call is None or call.head is None:
            self._hermes_call(body, closed, out)
            return
        call.end(out)
        self._after_call = True
        reader = call.reader
        if reader.error and body[reader.error_at :].strip():
            self._after_call = False
            self._emit(body[reader.error_at :], out)

    def _hermes_call(self, body: str, closed: bool, out: list[Piece]) -> None:
        try:
            call = call_from(json.loads(body))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json's recursion
            call = None
        if call is None:  # not a call after all: the text as the model wrote it
            self._emit(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), out)
        else:
            self._add_call(call, out)
            self._after_call = True

    def _add_call(self, call: ToolCall, out: list[Piece]) -> None:
        if self.parallel or self.num_calls == 0:
            out.append(call)
            self.num_calls += 1

    def _emit(self, text: str, out: list[Piece]) -> None:
        """Content, after the whitespace waiting before it; its own trailing whitespace waits."""
        text = self._space + text
        body = text.rstrip()
        if body:
            out.append(body)
        self._space = text[len(body) :]


def marker_start(text: str, marker: str) -> int:
    """How many of text's last characters could begin `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
