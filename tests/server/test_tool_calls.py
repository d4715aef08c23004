"""Tool calls read out of chat replies (server/tool_calls.py): the parsers on their own, streamed
in pieces of every size against the whole text, and through /v1/chat/completions on the fake
engine, streamed and not, with OpenAI's SDK reading them."""

from __future__ import annotations

import json

import openai
import pytest

from server import replies, tool_calls
from server.config import ServerConfig
from server.replies import ReplyFormat
from server.tool_calls import ToolCall, ToolCallStream
from tests.server.fakes import BOS, FakeEngine, client_for, make_app, parse_sse, tok

HI = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# A Hermes-style template (Qwen2.5's form, cut down): the tools, then each message; an assistant
# message's calls as <tool_call> JSON with the arguments written by tojson.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def pieces_of(parser: str, text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream(parser)
    out = []
    for i in range(0, len(text), size):
        out += stream.feed(text[i : i + size])
    out += stream.finish()
    content = "".join(p for p in out if isinstance(p, str))
    return content or None, [(p.name, p.arguments) for p in out if isinstance(p, ToolCall)]


CASES = [
    # (parser, text, content, calls)
    ("hermes", "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"),
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')]),
    ("hermes", CALL + "\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", "a < b, <tool and <tool_cal\n\n", "a < b, <tool and <tool_cal\n\n", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", '{"x": [1, 2]}')]),  # unclosed
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>',  # broken JSON stays text
     '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"é\\"}"}</tool_call>', None, [("f", '{"x": "é"}')]),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    ("hermes", '<tool_call>{"name": "f", "arg\n\n', '<tool_call>{"name": "f", "arg\n\n', []),  # cut short
    ("hermes", "See a <tool_call>not json</tool_call> here", "See a <tool_call>not json</tool_call> here", []),
    ("hermes", "Hello " + CALL + " world\n", "Hello world", [("get_weather", '{"city": "Paris"}')]),
    ("hermes", "<tool_call>" + "[" * 1100 + "</tool_call>", "<tool_call>" + "[" * 1100 + "</tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("mistral", "[" * 3000, "[" * 3000, []),
    ("llama3_json", ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    ("llama3_json", '{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', []),  # JSON, not a call
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    ("mistral", '[{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]', None,
     [("f", '{"q": "x"}'), ("g", "{}")]),
    ("mistral", "[1, 2] are numbers", "[1, 2] are numbers", []),
    # separators as `_json_calls` reads them: none, or a run of them
    ("llama3_json", '{"name": "f", "parameters": {}}{"name": "g", "parameters": {}} ;; {"name": "h", "parameters": {}}',
     None, [("f", "{}"), ("g", "{}"), ("h", "{}")]),
    ("mistral", '[{"name": "f", "arguments": {}}] [{"name": "g", "arguments": {}}]', None, [("f", "{}"), ("g", "{}")]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parsers_whole_and_in_pieces(parser: str, text: str, content: str | None, calls: list) -> None:
    whole = replies.read(ReplyFormat(tool_parser=parser), text)
    assert (whole.content or None, [(c.name, c.arguments) for c in whole.tool_calls]) == (content, calls)
    for size in (1, 2, 3, 7, len(text)):
        assert pieces_of(parser, text, size) == (content, calls), size


def test_parallel_false_keeps_the_first_call() -> None:
    whole = replies.read(ReplyFormat(tool_parser="hermes", parallel_tool_calls=False), CALL + CALL.replace("Paris", "Lyon"))
    assert whole.content == "" and [json.loads(c.arguments) for c in whole.tool_calls] == [{"city": "Paris"}]


def test_text_streams_without_waiting() -> None:
    """Text that cannot start a call is handed back as it comes; a possible start is held."""
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello") == ["Hello"]
    assert stream.feed(" <tool") == []
    assert stream.feed("s>") == [" <tools>"]
    json_stream = ToolCallStream("llama3_json")
    assert json_stream.feed("  ") == [] and json_stream.feed("Hi") == ["  Hi"]


def test_detect_and_resolve() -> None:
    assert tool_calls.detect(HERMES_TEMPLATE) == "hermes"
    assert tool_calls.detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    llama3 = "<|start_header_id|>{{ '{\"name\": ...' }}\"parameters\"<|eot_id|>"
    assert tool_calls.detect(llama3) == "llama3_json"
    assert tool_calls.detect("<|im_start|>{{ m }}") is None and tool_calls.detect(None) is None
    assert tool_calls.resolve("auto", HERMES_TEMPLATE) == "hermes"
    assert tool_calls.resolve("none", HERMES_TEMPLATE) is None
    assert tool_calls.resolve("mistral", None) == "mistral"
    with pytest.raises(ValueError):
        tool_calls.resolve("xml", None)
    with pytest.raises(ValueError, match="tool call parser"):
        ServerConfig(model_name="m.gguf", tool_call_parser="xml")


def joined_calls(deltas: list[dict]) -> dict[int, dict]:
    """A streamed choice's calls as OpenAI's SDKs join their deltas: by index, the arguments
    concatenated."""
    calls: dict[int, dict] = {}
    for tc in (tc for d in deltas for tc in d.get("tool_calls", [])):
        call = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
        call.update({k: v for k, v in tc.items() if k not in ("index", "function")})
        call["function"]["name"] = call["function"].get("name") or tc["function"].get("name")
        call["function"]["arguments"] += tc["function"].get("arguments", "")
    return calls


def streamed_pieces(text: str, size: int, parallel: bool = True, parser: str = "hermes") -> list:
    stream = ToolCallStream(parser, parallel, stream_args=True)
    out = []
    for i in range(0, len(text), size):
        out += stream.feed(text[i : i + size])
    return out + stream.finish()


# What a streamed call gives where its text breaks once its arguments opened: the arguments as
# far as they were JSON (the call went out in parts already), the text from the break on content.
# In the whole-reply forms a call that went out stays one when a later part is no call.
STREAMED_BROKEN = {
    '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>': (None, [("f", '{"x": 1')]),
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>': ("NaN}}", [("f", '{"x": ')]),
    # a literal, a number or an escape that breaks is content whole, from where it began
    '<tool_call>{"name": "f", "arguments": {"x": [1, tru]}}</tool_call>': ("tru]}}", [("f", '{"x": [1, ')]),
    '<tool_call>{"name": "f", "arguments": {"x": "a\\qb"}}</tool_call>': ('\\qb"}}', [("f", '{"x": "a')]),
    '<tool_call>{"name": "f", "arguments": {"x": "\\ud83d\\u12G"}}</tool_call>': ('\\ud83d\\u12G"}}', [("f", '{"x": "')]),
}
STREAMED_ONLY = [
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; junk', "junk", [("f", '{"a": 1}')]),
    ("mistral", '[{"name": "f", "arguments": {"q": "x"}}, {"name": "Ada"}]', '{"name": "Ada"}]', [("f", '{"q": "x"}')]),
    ("mistral", '[{"name": "f", "arguments": {"q": "x"', None, [("f", '{"q": "x"')]),  # cut short
    ("mistral", '[{"name": "f", "arguments": {"q": NaN}}] after', "NaN}}] after", [("f", '{"q": ')]),
    ("mistral", "[]", "[]", []),
    ("llama3_json", '{"name": "f", "parameters": "{\\"a\\": 2}"}', None, [("f", '{"a": 2}')]),  # read whole
]


STREAMED_BROKEN_CASES = [("hermes", text, None, []) for text in STREAMED_BROKEN if not any(c[1] == text for c in CASES)]


@pytest.mark.parametrize("parser, text, content, calls", CASES + STREAMED_ONLY + STREAMED_BROKEN_CASES)
def test_streamed_arguments_in_pieces(parser: str, text: str, content: str | None, calls: list) -> None:
    """With `stream_args` a call that opens as {"name": ..., "arguments": {  goes out as its head,
    its arguments' pieces and the call that ends it; joined, they are the call read whole
    (unless its text broke: STREAMED_BROKEN, STREAMED_ONLY)."""
    content, calls = STREAMED_BROKEN.get(text, (content, calls))
    for size in (1, 2, 5, len(text)):
        out = streamed_pieces(text, size, parser=parser)
        assert ("".join(p for p in out if isinstance(p, str)) or None) == content
        ended = [p for p in out if isinstance(p, ToolCall)]
        assert [(c.name, c.arguments) for c in ended] == calls
        for call in ended:
            if not call.streamed:  # read whole (e.g. arguments given as a string)
                continue
            parts = [p for p in out if getattr(p, "id", None) == call.id]
            assert parts[0] == tool_calls.CallStart(call.id, call.name) and parts[-1] is call
            assert "".join(p.text for p in parts[1:-1]) == call.arguments
            assert all(isinstance(p, tool_calls.CallArgs) for p in parts[1:-1])


def test_streamed_arguments_go_out_as_they_arrive() -> None:
    stream = ToolCallStream("hermes", stream_args=True)
    assert stream.feed('Hi <tool_call>\n{"name": "f", ') == ["Hi"]
    [head, args] = stream.feed('"arguments": {"code": "print(')
    assert isinstance(head, tool_calls.CallStart) and head.name == "f"
    assert args == tool_calls.CallArgs(head.id, '{"code": "print(')
    assert stream.feed("1)\\n") == [tool_calls.CallArgs(head.id, "1)\\n")]  # an escape written whole
    assert stream.feed('"}}\n</tool') == [tool_calls.CallArgs(head.id, '"}')]
    [call] = stream.feed("_call> ")
    assert call.streamed and call.id == head.id and json.loads(call.arguments) == {"code": "print(1)\n"}
    assert stream.finish() == [] and stream.num_calls == 1


@pytest.mark.parametrize("parser, text", [
    ("hermes", CALL + CALL.replace("Paris", "Lyon")),
    ("mistral", '[{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'),
])
def test_streamed_parallel_false_streams_the_first_call_only(parser: str, text: str) -> None:
    out = streamed_pieces(text, 3, parallel=False, parser=parser)
    assert [type(p).__name__ for p in out if not isinstance(p, tool_calls.CallArgs)] == ["CallStart", "ToolCall"]


def hermes_engine(reply: str) -> FakeEngine:
    engine = FakeEngine(max_context=512)
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    engine.reply = reply
    return engine


@pytest.mark.anyio
async def test_chat_returns_tool_calls() -> None:
    engine = hermes_engine("Checking." + CALL)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS})
        health = (await c.get("/health")).json()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.requests[0].prompt_tokens[:9] == (BOS, *tok("<tools>g"))  # the tools reached the template
    assert health["tool_call_parser"] == "hermes"


@pytest.mark.anyio
async def test_streamed_tool_calls_match_the_whole_response() -> None:
    reply = "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon")
    engine = hermes_engine(reply)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "stream": True,
                                                       "logprobs": True})
    chunks = [c for c in parse_sse(r.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = joined_calls(deltas)
    assert [(i, tc["function"]["name"], tc["function"]["arguments"]) for i, tc in calls.items()] == [
        (0, "get_weather", '{"city": "Paris"}'), (1, "get_weather", '{"city": "Lyon"}')]
    assert len({tc["id"] for tc in calls.values()}) == 2
    # each call's head (id, name, empty arguments) came first, then its arguments in pieces
    pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
    heads = [tc for tc in pieces if "id" in tc]
    assert [tc["function"]["arguments"] for tc in heads] == ["", ""] and len(pieces) > 4
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in pieces
               if "id" not in tc)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # every token's logprob is sent once, in order, though the call's tokens were held back
    sent = [e["token"] for c in chunks if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    assert "".join(sent) == reply


@pytest.mark.anyio
async def test_a_lone_surrogate_in_the_arguments_goes_out_as_its_escape() -> None:
    """A JSON escape of half a surrogate pair reads as a string UTF-8 cannot hold: both responses
    send it as the escape, inside its string."""
    engine = hermes_engine('<tool_call>{"name": "f", "arguments": {"x": "a\\ud83db"}}</tool_call>')
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS})
        s = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "stream": True})
    assert r.status_code == s.status_code == 200
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"x": "a\ud83db"}
    [streamed] = joined_calls([c["choices"][0]["delta"] for c in parse_sse(s.text) if c != "[DONE]"]).values()
    assert streamed["function"]["arguments"] == call["function"]["arguments"]


@pytest.mark.anyio
async def test_a_call_cut_by_max_tokens() -> None:
    """Streamed, a call cut inside its arguments keeps what went out (finish_reason length, as
    OpenAI's own); the whole response reads the cut call as text."""
    cut = len('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')  # one token a byte
    engine = hermes_engine(CALL)
    async with client_for(make_app(engine)) as c:
        body = {"messages": HI, "tools": TOOLS, "max_tokens": cut}
        r = await c.post("/v1/chat/completions", json=body)
        s = await c.post("/v1/chat/completions", json={**body, "stream": True})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == CALL[:cut]
    assert "tool_calls" not in choice["message"]
    chunks = [c for c in parse_sse(s.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    [call] = joined_calls(deltas).values()
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert "".join(d.get("content") or "" for d in deltas) == "" and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
@pytest.mark.parametrize("extra, parses", [({}, True), ({"tool_choice": "auto"}, True),
                                           ({"tool_choice": "none"}, False), ({"tools": []}, False)])
async def test_tool_choice(extra: dict, parses: bool) -> None:
    engine = hermes_engine(CALL)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, **extra})
    message = r.json()["choices"][0]["message"]
    assert ("tool_calls" in message) == parses
    assert message["content"] == (None if parses else CALL)
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_tokens)
    assert ("<tools>" in prompt) == parses  # "none": the model is not told of the tools


@pytest.mark.anyio
@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),  # not a tool
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"tools": [1]}}, "chat_template_kwargs"),  # tools only through the checked field
])
async def test_tool_fields_refused(body: dict, param: str) -> None:
    engine = hermes_engine(CALL)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.requests == []


@pytest.mark.anyio
async def test_no_parser_keeps_calls_as_text() -> None:
    """The fake's own template names no call format, and --tool-call-parser none turns it off."""
    engine = FakeEngine(max_context=512)
    engine.reply = CALL
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS})
    assert r.json()["choices"][0]["message"]["content"] == CALL
    engine = hermes_engine(CALL)
    async with client_for(make_app(engine, tool_call_parser="none")) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": CALL, "refusal": None}


@pytest.mark.anyio
async def test_previous_calls_reach_the_template_as_objects() -> None:
    engine = hermes_engine("It is sunny.")
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    assert r.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "It is sunny.",
                                                              "refusal": None},
                                      "logprobs": None, "finish_reason": "stop"}
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_tokens)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    # arguments that are no JSON object (here nested past json's recursion) reach it as they came
    deep = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]}]
    engine = hermes_engine("ok")
    engine.max_context = 8192
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": deep, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert '"arguments": "' + "[" * 5000 in engine.tokenizer.decode(engine.requests[0].prompt_tokens)


@pytest.mark.anyio
async def test_openai_sdk_reads_the_calls() -> None:
    engine = hermes_engine(CALL + CALL.replace("Paris", "Lyon"))
    app = make_app(engine)
    http = client_for(app)
    sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
    async with http:
        done = await sdk.chat.completions.create(model="m", messages=HI, tools=TOOLS)
        stream = await sdk.chat.completions.create(model="m", messages=HI, tools=TOOLS, stream=True)
        merged: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for tc in chunk.choices[0].delta.tool_calls or []:
                entry = merged.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None
    got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in done.choices[0].message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(merged.items())] == got
    assert finish == "tool_calls"


FORCED = [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]


@pytest.mark.anyio
@pytest.mark.parametrize("choice, name", FORCED)
async def test_a_forced_call_constrains_the_reply_to_calls(choice, name) -> None:
    """tool_choice "required" or a named function: the engine gets the template's call format as
    a grammar, and the reply is read for calls."""
    engine = hermes_engine(CALL)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "tool_choice": choice,
                                                       "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    constraint = engine.requests[0].constraint
    assert (constraint.kind, constraint.field) == ("lark", "tool_choice")
    assert constraint.source == tool_calls.forced_grammar("hermes", TOOLS, name, False)
    assert "<tools>" in engine.tokenizer.decode(engine.requests[0].prompt_tokens)


@pytest.mark.anyio
async def test_a_forced_call_needs_a_format_it_can_force() -> None:
    engine = FakeEngine(max_context=512)  # its template names no call format
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "cannot be forced" in r.json()["error"]["message"] and engine.requests == []


def _walk(grammar_text: str, text: str) -> tuple[bool, bool]:
    """(whether every byte of `text` is allowed in turn, whether the grammar is then complete or
    may end) over a byte vocabulary."""
    from scheduler import grammar
    from scheduler.types import Constraint
    from tests.scheduler.conftest import EOS, ByteTokenizer

    m = grammar.Vocabulary(ByteTokenizer()).matcher(Constraint("lark", grammar_text))
    for b in text.encode():
        if not grammar.allowed(m.mask(), [b])[0]:
            return False, False
        m.consume(b)
    return True, m.is_stopped or grammar.allowed(m.mask(), [EOS])[0]


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("parser, name, parallel, text, ok", [
    ("hermes", None, False, CALL, (True, True)),
    ("hermes", None, True, CALL + "\n" + CALL.replace("Paris", "Rome"), (True, True)),
    ("hermes", None, False, CALL + "\n<", (False, False)),  # one call only
    ("hermes", "get_time", False, CALL, (False, False)),  # another function's name
    ("hermes", None, False, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     (True, True)),
    ("hermes", None, False, '<tool_call>\n{"name": "get_time", "arguments": {}}', (False, False)),  # zone required
    ("llama3_json", None, True, '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Oslo"}}', (True, True)),
    ("llama3_json", "get_weather", False, 'Sure', (False, False)),
    ("hermes", None, False, CALL.replace('{"name"', '{\n  "name"'), (True, True)),
    ("hermes", None, False, CALL.replace('{"name"', "{" + " " * 25 + '"name"'), (False, False)),  # JSON_WHITESPACE
])
def test_forced_grammars_admit_exactly_the_calls(parser, name, parallel, text, ok) -> None:
    assert _walk(tool_calls.forced_grammar(parser, TWO_TOOLS, name, parallel), text) == ok


def _walk_tokens(grammar_text: str, tokens: list[int]) -> tuple[bool, bool]:
    """`_walk` over token ids, in a byte vocabulary whose token 257 is Mistral's [TOOL_CALLS]."""
    from scheduler import grammar
    from scheduler.types import Constraint
    from tests.scheduler.conftest import EOS, OTHER_SPECIAL, ByteTokenizer

    class WithToolCalls(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            return b"[TOOL_CALLS]" if token_id == OTHER_SPECIAL else super().token_bytes(token_id)

    m = grammar.Vocabulary(WithToolCalls()).matcher(Constraint("lark", grammar_text))
    for t in tokens:
        if not grammar.allowed(m.mask(), [t])[0]:
            return False, False
        m.consume(t)
    return True, m.is_stopped or grammar.allowed(m.mask(), [EOS])[0]


MISTRAL_CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}'
MISTRAL_TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}]'


@pytest.mark.parametrize("name, parallel, text, opens, ok", [
    (None, False, MISTRAL_CALL + "]", True, (True, True)),
    (None, False, " " + MISTRAL_CALL + "]", True, (True, True)),
    (None, False, MISTRAL_CALL + "]", False, (False, False)),  # the control token first, not its text
    (None, True, MISTRAL_CALL + ", " + MISTRAL_TIME, True, (True, True)),
    (None, False, MISTRAL_CALL + ", " + MISTRAL_TIME, True, (False, False)),  # one call only
    ("get_time", False, MISTRAL_CALL + "]", True, (False, False)),  # another function's name
    (None, False, '[{"name": "get_time", "arguments": {}}]', True, (False, False)),  # zone required
])
def test_mistrals_forced_calls_open_with_its_control_token(name, parallel, text, opens, ok) -> None:
    from tests.scheduler.conftest import OTHER_SPECIAL

    grammar_text = tool_calls.forced_grammar("mistral", TWO_TOOLS, name, parallel, OTHER_SPECIAL)
    tokens = ([OTHER_SPECIAL] if opens else list(b"[TOOL_CALLS]")) + list(text.encode())
    assert _walk_tokens(grammar_text, tokens) == ok


def test_mistrals_calls_need_its_control_token() -> None:
    with pytest.raises(ValueError, match="lacks"):
        tool_calls.forced_grammar("mistral", TOOLS, None, True)
    with pytest.raises(ValueError, match="cannot be forced"):
        tool_calls.forced_grammar(None, TOOLS, None, True)


def test_control_token_finds_only_a_control_tokens_id() -> None:
    from tests.server.fakes import EOS, FakeTokenizer

    tokenizer = FakeTokenizer()
    assert tool_calls.control_token(tokenizer, "</s>") == EOS
    assert tool_calls.control_token(tokenizer, "[TOOL_CALLS]") is None  # its text, byte by byte
    assert tool_calls.control_token(tokenizer, "a") is None  # one token, but text


@pytest.mark.anyio
async def test_a_forced_call_in_mistrals_format_opens_with_its_control_token(monkeypatch) -> None:
    """A model whose vocabulary has Mistral's [TOOL_CALLS] control token: the request's grammar
    names that token by id, and the reply after it (the token itself skipped in the text) comes
    back as tool_calls."""
    from tests.server import fakes

    tool_calls_id = fakes.FakeTokenizer.vocab_size
    monkeypatch.setitem(fakes.SPECIALS, tool_calls_id, "[TOOL_CALLS]")
    engine = FakeEngine(max_context=512)
    engine.tokenizer.vocab_size = tool_calls_id + 1
    engine.tokenizer.chat_template = "{{ '[TOOL_CALLS]' }}" + engine.tokenizer.chat_template
    engine.reply = " " + MISTRAL_CALL + "]"  # as the text reads after the control token
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    constraint = engine.requests[0].constraint
    assert constraint.source == tool_calls.forced_grammar("mistral", TOOLS, None, True, tool_calls_id)
    assert f"<[{tool_calls_id}]>" in constraint.source


@pytest.mark.anyio
async def test_a_forced_call_with_mistrals_template_needs_its_token() -> None:
    """A template in Mistral's call format, served by a model without the [TOOL_CALLS] token: a
    400 naming tool_choice, nothing submitted."""
    engine = FakeEngine(max_context=512)
    engine.tokenizer.chat_template = "{{ '[TOOL_CALLS]' }}" + engine.tokenizer.chat_template
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "[TOOL_CALLS]" in r.json()["error"]["message"] and engine.requests == []
