"""Constrained decoding's request fields: OpenAI's response_format, llama-server's json_schema and
grammar, vLLM's structured_outputs and guided_* fields, each to the one `Constraint` the engine
gets (the grammar itself: tests/scheduler/test_grammar.py; the real engine: tests/server/test_e2e.py)."""

from __future__ import annotations

import json

import pytest

from scheduler.types import Constraint, RequestValidationError
from tests.server.fakes import FakeEngine, client_for, make_app

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def schema(value, field: str) -> Constraint:
    return Constraint("json_schema", json.dumps(value), field)


CASES = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, schema({"type": "object"}, "response_format")),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, schema(SCHEMA, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     schema(SCHEMA, "response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     schema({}, "response_format.json_schema.schema")),
    ({"json_schema": SCHEMA}, schema(SCHEMA, "json_schema")),
    ({"grammar": 'root ::= "a" | "b"'}, Constraint("gbnf", 'root ::= "a" | "b"', "grammar")),
    ({"grammar": ""}, None),  # llama-server's clients send "" for none
    ({"structured_outputs": {"json": SCHEMA}}, schema(SCHEMA, "structured_outputs.json")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, schema(SCHEMA, "structured_outputs.json")),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Constraint("regex", "[0-9]+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     Constraint("choice", '["yes", "no"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": "start: /[a-z]+/"}},
     Constraint("gbnf", "start: /[a-z]+/", "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, schema({"type": "object"}, "structured_outputs.json_object")),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     Constraint("regex", "a", "structured_outputs.regex")),
    # vLLM's whitespace options go into a JSON schema's x-guidance, from whichever field it came
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}},
            "structured_outputs.json")),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": False}},
     schema({"type": "object"}, "response_format")),
    ({"json_schema": {**SCHEMA, "x-guidance": {"lenient": True}}, "guided_whitespace_pattern": "[ ]*"},
     schema({**SCHEMA, "x-guidance": {"lenient": True, "whitespace_pattern": "[ ]*"}}, "json_schema")),
    ({"structured_outputs": {"json": True, "whitespace_pattern": "\\n?"}},
     schema({"x-guidance": {"whitespace_pattern": "\\n?"}}, "structured_outputs.json")),
    ({"guided_json": SCHEMA}, schema(SCHEMA, "guided_json")),
    ({"guided_regex": "a+"}, Constraint("regex", "a+", "guided_regex")),
    ({"guided_choice": ["x"]}, Constraint("choice", '["x"]', "guided_choice")),
]


@pytest.mark.anyio
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("extra, constraint", CASES)
async def test_each_field_becomes_the_engines_constraint(endpoint: str, extra: dict, constraint) -> None:
    engine = FakeEngine()
    body = {"messages": HI} if endpoint == "chat" else {"prompt": "hi"}
    async with client_for(make_app(engine)) as c:
        r = await c.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json={**body, **extra})
    assert r.status_code == 200, r.text
    assert engine.requests[0].constraint == constraint


@pytest.mark.anyio
@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"json_schema": "{oops"}, "json_schema"),
    ({"grammar": 7}, "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"json_schema": SCHEMA, "grammar": "root ::= \"a\""}, "grammar"),
    ({"json_schema": SCHEMA, "structured_outputs": {"disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace"),
    ({"json_schema": SCHEMA, "guided_whitespace_pattern": ""}, "guided_whitespace_pattern"),
    ({"json_schema": SCHEMA, "structured_outputs": {"disable_any_whitespace": True, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"json_schema": {**SCHEMA, "x-guidance": "compact"}, "guided_whitespace_pattern": " "}, "json_schema"),
])
async def test_malformed_or_doubled_constraints_are_refused(extra: dict, param: str) -> None:
    engine = FakeEngine()
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.requests == []


@pytest.mark.anyio
async def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_its_field() -> None:
    engine = FakeEngine()
    engine.submit_error = RequestValidationError("invalid regular expression: unclosed", "guided_regex")
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "guided_regex": "["})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "guided_regex" and "unclosed" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_constrained_chat_reply_is_read_as_it_is() -> None:
    """With a constraint the reply is what its grammar allows: no tool calls or thoughts are read
    out of it, even where the template has tools and thoughts."""
    engine = FakeEngine(max_context=512)
    engine.reply = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<tool_call></think>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": tools, "guided_regex": ".*"})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == engine.reply and not message.get("tool_calls")
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_grammars_compile_off_the_event_loop_before_the_submit() -> None:
    """The server has the engine compile a grammar on a worker thread first (a large schema
    would stall every stream on the loop); one that does not compile is a 400, nothing submitted."""
    import threading

    engine = FakeEngine()
    threads = []

    def compile_constraint(constraint):
        threads.append(threading.current_thread())
        if constraint.source == "[":
            raise RequestValidationError("invalid regular expression: unclosed", constraint.field)

    engine.compile_constraint = compile_constraint
    async with client_for(make_app(engine)) as c:
        bad = await c.post("/v1/completions", json={"prompt": "hi", "guided_regex": "["})
        good = await c.post("/v1/completions", json={"prompt": "hi", "guided_regex": "a+"})
        free = await c.post("/v1/completions", json={"prompt": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
    assert good.status_code == 200 and free.status_code == 200
    assert [r.constraint.source if r.constraint else None for r in engine.requests] == ["a+", None]
    assert len(threads) == 2 and threading.main_thread() not in threads
