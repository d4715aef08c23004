"""OpenAI's Responses API (server/responses_api.py) on the fake engine: the request as the chat
request it becomes, the response object and its streamed events (also as OpenAI's SDK reads
them), tool calls, thoughts, the stored conversation, and the 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest

from scheduler.types import StreamEvent
from server import responses_api
from server.responses_api import ResponseStore, to_chat
from tests.server.fakes import BOS, FakeEngine, client_for, make_app, parse_typed_sse
from tests.server.test_reasoning import THINKING_TEMPLATE
from tests.server.test_tool_calls import CALL, HERMES_TEMPLATE

pytestmark = pytest.mark.anyio

TOOLS = [{"type": "function", "name": "get_weather", "description": "d",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def prompt_text(engine: FakeEngine, i: int = -1) -> str:
    tokens = engine.requests[i].prompt_tokens
    assert tokens[0] == BOS
    return engine.tokenizer.decode(tokens[1:])


def parse_events(body: str) -> list[dict[str, Any]]:
    """A Responses SSE body, its events numbered in order."""
    out = parse_typed_sse(body)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def engine_with(reply: str, template: str | None = None) -> FakeEngine:
    engine = FakeEngine(max_context=512)
    if template is not None:
        engine.tokenizer.chat_template = template
    engine.reply = reply
    return engine


def without_ids(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: without_ids(v) for k, v in obj.items() if k not in ("id", "item_id", "call_id", "created_at")}
    if isinstance(obj, list):
        return [without_ids(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- the chat request


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                          {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    r = to_chat({"input": items, "instructions": "Be brief.", "max_output_tokens": 7, "tools": TOOLS,
                 "tool_choice": {"type": "function", "name": "get_weather"}, "top_k": 5, "min_tokens": 2,
                 "dry_multiplier": 0.8, "mirostat": 2, "typical_p": 0.9}, ResponseStore())
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in ((1, '{"city": "Paris"}'), (2, '{"city": "Lyon"}'))]
    assert r.chat_body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    assert r.history == tuple(r.chat_body["messages"][1:])  # instructions are not part of the conversation
    assert r.chat_body["max_completion_tokens"] == 7 and r.chat_body["top_k"] == 5 and r.chat_body["min_tokens"] == 2
    # llama.cpp's samplers pass on as the chat endpoint takes them
    assert (r.chat_body["dry_multiplier"], r.chat_body["mirostat"], r.chat_body["typical_p"]) == (0.8, 2, 0.9)
    assert r.chat_body["tools"] == [{"type": "function", "function": {k: TOOLS[0][k] for k in ("name", "description", "parameters")}}]
    assert r.chat_body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert r.echo["tools"] == TOOLS and r.echo["instructions"] == "Be brief." and r.store


def test_text_format_becomes_the_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = to_chat({"input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}},
                ResponseStore())
    assert r.chat_body["response_format"] == {"type": "json_schema",
                                              "json_schema": {"name": "A", "strict": True, "schema": schema}}
    assert r.echo["text"]["format"]["name"] == "A"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": [{"text": 1}]}]}, "input[0].summary"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "A"}}}, "text.format.schema"),
])
def test_requests_it_cannot_serve_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(responses_api.ApiError) as e:
        to_chat(body, ResponseStore())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body, param", [({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                                         ({"input": "x", "temperature": 3}, "temperature"),
                                         ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type")])
async def test_the_chat_checks_name_the_responses_fields(body: dict, param: str) -> None:
    async with client_for(make_app(FakeEngine())) as c:
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "max_completion_tokens" not in r.text and "response_format" not in r.text


async def test_a_number_beyond_a_double_is_a_400_not_an_echo_that_cannot_be_written() -> None:
    engine = FakeEngine()
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", content=b'{"input": "x", "tools": [{"type": "function", "name": "f", '
                                                  b'"parameters": {"maximum": 1e400}}]}',
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"] and not engine.requests


async def test_null_fields_take_their_defaults() -> None:
    async with client_for(make_app(FakeEngine())) as c:
        r = await c.post("/v1/responses", json={"input": "Hi", "store": None, "tool_choice": None, "temperature": None,
                                                "parallel_tool_calls": None, "top_p": None, "top_logprobs": None})
        got = await c.get(f"/responses/{r.json()['id']}")
    body = r.json()
    assert (body["store"], body["tool_choice"], body["temperature"], body["parallel_tool_calls"], body["top_p"]) == (
        True, "auto", 1.0, True, 1.0)
    assert got.status_code == 200 and got.json() == body


# ----------------------------------------------------------------------------- the response


async def test_a_response_object() -> None:
    engine = engine_with("Hello world")
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"model": "m", "input": "Hi", "instructions": "Be brief.",
                                                "metadata": {"k": "v"}, "temperature": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    assert body["model"] == "m" and body["metadata"] == {"k": "v"} and body["temperature"] == 0.5
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": []}]
    prompt = prompt_text(engine)
    assert prompt == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert body["usage"] == {"input_tokens": len(prompt) + 1, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 11, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": len(prompt) + 12}
    assert engine.requests[0].sampling.temperature == 0.5


async def test_max_output_tokens_leaves_it_incomplete() -> None:
    async with client_for(make_app(engine_with("Hello world"))) as c:
        r = await c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 5})
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "Hello" and body["output"][0]["status"] == "incomplete"


async def test_logprobs_come_with_the_text() -> None:
    async with client_for(make_app(engine_with("Hi!"))) as c:
        r = await c.post("/v1/responses", json={"input": "x", "top_logprobs": 2,
                                                "include": ["message.output_text.logprobs"]})
        s = await c.post("/v1/responses", json={"input": "x", "top_logprobs": 2, "stream": True})
    logprobs = r.json()["output"][0]["content"][0]["logprobs"]
    assert [e["token"] for e in logprobs] == list("Hi!") and all(len(e["top_logprobs"]) == 2 for e in logprobs)
    events = parse_events(s.text)
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    assert streamed == logprobs
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == logprobs


async def test_the_streamed_events_build_the_response_they_end_with() -> None:
    engine = engine_with("Hello world")
    async with client_for(make_app(engine)) as c:
        s = await c.post("/v1/responses", json={"input": "Hi", "stream": True})
        whole = await c.post("/v1/responses", json={"input": "Hi"})
    assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
    events = parse_events(s.text)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 11 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    assert without_ids(events[-1]["response"]) == without_ids(whole.json())


async def test_tool_calls_are_function_call_items() -> None:
    engine = engine_with("Checking." + CALL, HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS})
        s = await c.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS, "stream": True})
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Checking."
    call = out[1]
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert prompt_text(engine, 0).startswith("<tools>get_weather;</tools>")
    events = parse_events(s.text)
    kinds = [e["type"] for e in events]
    i = kinds.index("response.function_call_arguments.delta")
    done = kinds.index("response.function_call_arguments.done")
    # the item added with empty arguments, then the arguments in pieces as they are generated
    assert kinds[i - 1] == "response.output_item.added" and kinds[done + 1] == "response.output_item.done"
    assert set(kinds[i:done]) == {"response.function_call_arguments.delta"} and done - i > 1
    assert events[i - 1]["item"]["arguments"] == "" and events[i - 1]["output_index"] == 1
    assert "".join(e["delta"] for e in events[i:done]) == events[done]["arguments"] == call["arguments"]
    assert events[done]["name"] == "get_weather" and {e["output_index"] for e in events[i:done + 2]} == {1}
    assert without_ids(events[-1]["response"]["output"]) == without_ids(out)


async def test_a_streamed_call_cut_short_is_an_incomplete_item() -> None:
    cut = len('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')  # one token a byte
    engine = engine_with("Checking." + CALL, HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        s = await c.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS, "stream": True,
                                                "max_output_tokens": cut})
    events = parse_events(s.text)
    [done] = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert done["item"]["status"] == "incomplete" and done["item"]["arguments"] == '{"city": "Pa'
    assert events[-1]["type"] == "response.incomplete"


async def test_a_thought_is_a_reasoning_item() -> None:
    engine = engine_with("<think>Four.</think>It is 4.", THINKING_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"input": "2+2?"})
        s = await c.post("/v1/responses", json={"input": "2+2?", "stream": True})
        again = await c.post("/v1/responses", json={"input": "And 3+3?", "previous_response_id": r.json()["id"]})
    body = r.json()
    assert [o["type"] for o in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Four."}]
    assert body["output"][1]["content"][0]["text"] == "It is 4."
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Four.")  # one token a byte here
    events = parse_events(s.text)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Four."
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["content"]) for i in added] == [("reasoning", []), ("message", [])]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    # the stored reply reaches the template with its thought, as a chat request's would
    assert again.status_code == 200
    assert prompt_text(engine).startswith("<|user|>2+2?\n<|assistant|><think>Four.</think>It is 4.\n<|user|>And 3+3?")


# ----------------------------------------------------------------------------- the store


async def test_previous_response_id_continues_the_conversation() -> None:
    engine = engine_with("Hello world")
    app = make_app(engine)
    async with client_for(app) as c:
        first = (await c.post("/v1/responses", json={"input": "Hi", "instructions": "Be brief."})).json()
        second = await c.post("/v1/responses", json={"input": "More", "previous_response_id": first["id"],
                                                     "stream": True})
        second_id = parse_events(second.text)[-1]["response"]["id"]
        third = await c.post("/v1/responses", json={"input": [{"role": "user", "content": "Again"}],
                                                    "previous_response_id": second_id, "store": False})
        got = await c.get(f"/v1/responses/{first['id']}")
        gone = await c.get(f"/v1/responses/{third.json()['id']}")
        deleted = await c.delete(f"/v1/responses/{first['id']}")
        after = await c.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert prompt_text(engine, 1) == "<|user|>Hi\n<|assistant|>Hello world\n<|user|>More\n<|assistant|>"
    assert prompt_text(engine, 2) == ("<|user|>Hi\n<|assistant|>Hello world\n<|user|>More\n<|assistant|>Hello world\n"
                                      "<|user|>Again\n<|assistant|>")
    assert got.status_code == 200 and got.json() == first
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"  # store: false
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert after.status_code == 400 and after.json()["error"]["param"] == "previous_response_id"


async def test_a_call_and_its_output_continue_a_stored_response() -> None:
    engine = engine_with(CALL, HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        first = (await c.post("/v1/responses", json={"input": "Weather?", "tools": TOOLS})).json()
        [call] = first["output"]
        engine.reply = "Sunny."
        r = await c.post("/v1/responses", json={
            "previous_response_id": first["id"], "tools": TOOLS,
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]})
    assert r.json()["output"][0]["content"][0]["text"] == "Sunny."
    assert prompt_text(engine).endswith('<|user|>Weather?<|assistant|><tool_call>{"name": "get_weather", '
                                        '"arguments": {"city": "Paris"}}</tool_call><|tool|>sunny<|assistant|>')


def test_the_store_keeps_the_newest_within_its_count_and_bytes() -> None:
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"r{i}", responses_api.StoredResponse({"id": f"r{i}"}, ()))
    assert len(store) == 2 and store.get("r0") is None and store.get("r2") is not None
    assert store.delete("r1") and not store.delete("r1") and len(store) == 1
    small = ResponseStore(max_entries=100, max_bytes=1000)
    for i in range(10):
        small.put(f"r{i}", responses_api.StoredResponse({"text": "x" * 300}, ()))
    assert len(small) == 3 and small.get("r9") and small.get("r7") and not small.get("r6")
    assert small.num_bytes <= 1000
    small.put("big", responses_api.StoredResponse({"text": "x" * 2000}, ()))
    assert small.get("big") is None and len(small) == 3  # larger than the whole store: not kept
    for i in (7, 8, 9):
        assert small.delete(f"r{i}")
    assert small.num_bytes == 0


# ----------------------------------------------------------------------------- failures


async def test_an_engine_error_mid_stream_fails_the_response() -> None:
    engine = FakeEngine()

    def script(request: Any) -> list[StreamEvent]:
        return [StreamEvent(text="He", token_ids=(1, 2)), StreamEvent(finish_reason="error", error="device lost")]

    engine.script = script
    async with client_for(make_app(engine)) as c:
        s = await c.post("/v1/responses", json={"input": "Hi", "stream": True})
        r = await c.post("/v1/responses", json={"input": "Hi"})
    events = parse_events(s.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_error" and "device lost" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "engine_error"
    assert r.status_code == 500


async def test_a_full_queue_is_a_429() -> None:
    engine = FakeEngine()
    engine.queue_full_after = 0
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"input": "Hi"})
    assert r.status_code == 429 and "retry-after" in r.headers


# ----------------------------------------------------------------------------- OpenAI's SDK


@pytest.fixture
async def sdk_for():
    clients = []

    def make(engine: FakeEngine) -> openai.AsyncOpenAI:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make_app(engine)))
        clients.append(openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


async def test_the_sdk_reads_responses(sdk_for) -> None:
    engine = engine_with("Checking." + CALL, HERMES_TEMPLATE)
    sdk = sdk_for(engine)
    out = await sdk.responses.create(model="m", input="Weather?", instructions="Be brief.", tools=TOOLS)  # type: ignore[arg-type]
    assert out.output_text == "Checking." and out.status == "completed"
    calls = [o for o in out.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    async with sdk.responses.stream(model="m", input="Weather?", tools=TOOLS) as stream:  # type: ignore[arg-type]
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == "Checking." == final.output_text
    assert [o.type for o in final.output] == ["message", "function_call"]
    follow = await sdk.responses.create(model="m", previous_response_id=out.id, tools=TOOLS, input=[  # type: ignore[arg-type]
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.output_text == "Checking." and follow.previous_response_id == out.id
    assert prompt_text(engine).endswith("</tool_call><|tool|>sunny<|assistant|>")
    fetched = await sdk.responses.retrieve(out.id)
    assert fetched.id == out.id and fetched.output_text == "Checking."


async def test_the_sdk_raises_a_400() -> None:
    engine = FakeEngine()
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make_app(engine)))
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.responses.create(model="m", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert "function tools only" in str(e.value)


def test_the_passed_fields_are_chat_fields() -> None:
    """Every field passed through is one the chat parser reads (a typo would pass nothing)."""
    from server import openai_api, constraints, samplers
    import inspect

    source = inspect.getsource(openai_api) + inspect.getsource(constraints)
    read: set[str] = set()  # the fields the samplers' parser reads

    class Seen(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

    samplers.parse_llama_samplers(openai_api.Fields(Seen()))
    for name in responses_api.PASSED_THROUGH:
        guided = name.removeprefix("guided_")
        assert (f'"{name}"' in source or name in read or guided in constraints._VLLM_KINDS
                or guided == "whitespace_pattern"), name
    assert set(read) == set(samplers.FIELDS)


async def test_output_items_sent_back_as_input_continue_the_conversation() -> None:
    """Managing the conversation on the client: the reply's items, as they came, in the next input."""
    engine = engine_with("<think>Look.</think>" + CALL, THINKING_TEMPLATE + HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        first = (await c.post("/v1/responses", json={"input": "Weather?", "tools": TOOLS, "store": False})).json()
        assert [o["type"] for o in first["output"]] == ["reasoning", "function_call"]
        call = first["output"][1]
        engine.reply = "Sunny."
        r = await c.post("/v1/responses", json={"tools": TOOLS, "input": [
            {"role": "user", "content": "Weather?"}, *first["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]})
    assert r.status_code == 200, r.text
    wanted = to_chat({"input": [{"role": "user", "content": "Weather?"}, *first["output"],
                                {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]},
                     ResponseStore()).chat_body["messages"]
    assert wanted[1] == {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [
        {"id": call["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]}
    assert wanted[2] == {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}


async def test_text_beside_a_call_makes_the_same_items_streamed_or_not() -> None:
    engine = engine_with("A" + CALL + "B", HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"input": "x", "tools": TOOLS, "include": ["message.output_text.logprobs"]})
        s = await c.post("/v1/responses", json={"input": "x", "tools": TOOLS, "stream": True, "top_logprobs": 0,
                                                "include": ["message.output_text.logprobs"]})
    out = r.json()["output"]
    assert [(o["type"], o.get("content", [{}])[0].get("text")) for o in out] == [
        ("message", "A"), ("function_call", None), ("message", "B")]
    assert [e["token"] for e in out[0]["content"][0]["logprobs"]] == ["A"]  # not the call's tokens
    assert without_ids(parse_events(s.text)[-1]["response"]["output"]) == without_ids(out)


async def test_a_thoughts_tokens_carry_no_logprobs_of_the_text() -> None:
    engine = engine_with("<think>Four.</think>It is 4.", THINKING_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/responses", json={"input": "x", "include": ["message.output_text.logprobs"]})
    tokens = "".join(e["token"] for e in r.json()["output"][1]["content"][0]["logprobs"])
    assert tokens.endswith("It is 4.") and "Four" not in tokens


async def test_streamed_incomplete_and_unstored() -> None:
    async with client_for(make_app(engine_with("Hello world"))) as c:
        s = await c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "stream": True, "store": False})
        last = parse_events(s.text)[-1]
        got = await c.get(f"/v1/responses/{last['response']['id']}")
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["content"][0]["text"] == "Hel" and got.status_code == 404


def test_a_reasoning_item_opens_the_turn_it_precedes() -> None:
    items = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A1"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "T2"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "T3"}]},
             {"role": "assistant", "content": "A2"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "unused"}]},
             {"role": "user", "content": "b"}, {"role": "assistant", "content": "A3"}]
    assert to_chat({"input": items}, ResponseStore()).chat_body["messages"] == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "A1"},
        {"role": "assistant", "content": "A2", "reasoning_content": "T2\nT3"},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "A3"}]
