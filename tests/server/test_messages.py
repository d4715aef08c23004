"""Anthropic's Messages API (server/messages_api.py) on the fake engine: the chat request it
becomes, the message and its stream (also as Anthropic's SDK reads them), tool use, thinking,
stop reasons, token counts, and errors in Anthropic's shape."""

from __future__ import annotations


import anthropic
import httpx2
import pytest

from scheduler.types import StreamEvent
from server.messages_api import to_chat
from server.errors import ApiError
from tests.server.fakes import EOS, FakeEngine, client_for, make_app, parse_typed_sse, tok
from tests.server.test_reasoning import THINKING_TEMPLATE
from tests.server.test_responses import engine_with, prompt_text
from tests.server.test_tool_calls import CALL, HERMES_TEMPLATE

pytestmark = pytest.mark.anyio

TOOLS = [{"name": "get_weather", "description": "d",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HI = [{"role": "user", "content": "Weather?"}]


def test_blocks_become_chat_messages() -> None:
    chat = to_chat({"max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n\n"],
                    "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "thinking": {"type": "enabled", "budget_tokens": 1024}, "top_k": 4, "xtc_probability": 0.5,
                    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "no such city"}]},
                                     {"type": "text", "text": "Thanks."}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks."}]
    assert chat["max_completion_tokens"] == 9 and chat["stop"] == ["\n\n"] and chat["top_k"] == 4
    assert chat["xtc_probability"] == 0.5  # llama.cpp's samplers pass on
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                               "parameters": TOOLS[0]["input_schema"]}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("body, param", [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": HI, "thinking": {"type": "on"}}, "thinking"),
])
def test_requests_it_cannot_serve_are_400s(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and e.value.param == param


async def test_a_message_with_tool_use() -> None:
    engine = engine_with("Checking." + CALL, HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "system": "Be brief.", "messages": HI,
                                               "tools": TOOLS})
        s = await c.post("/v1/messages", json={"model": "m", "max_tokens": 200, "system": "Be brief.", "messages": HI,
                                               "tools": TOOLS, "stream": True})
    body = r.json()
    assert body["type"] == "message" and body["id"].startswith("msg_") and body["stop_reason"] == "tool_use"
    assert body["content"][0] == {"type": "text", "text": "Checking."}
    call = body["content"][1]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["input"] == {"city": "Paris"}
    assert prompt_text(engine, 0).startswith("<tools>get_weather;</tools><|system|>Be brief.<|user|>Weather?")
    assert body["usage"]["output_tokens"] == len(("Checking." + CALL).encode())
    events = parse_typed_sse(s.text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    # the tool_use block opens with an empty input, gets its input's JSON in pieces as it is
    # generated, and closes
    start = max(i for i, e in enumerate(events) if e["type"] == "content_block_start")
    assert events[start]["content_block"]["type"] == "tool_use" and events[start]["content_block"]["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events[start + 1:-3]]
    assert len(pieces) > 1 and "".join(pieces) == '{"city": "Paris"}'
    assert all(e["index"] == 1 and e["delta"]["type"] == "input_json_delta" for e in events[start + 1:-3])
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_a_streamed_call_nested_too_deep_for_json_ends_its_block() -> None:
    """Arguments deeper than Python's json reads stream whole and the block closes (its input,
    which the stream does not send, left empty), rather than the stream failing."""
    deep = "[" * 3000 + "]" * 3000
    engine = engine_with('<tool_call>{"name": "get_weather", "arguments": {"a": ' + deep + "}}</tool_call>",
                         HERMES_TEMPLATE)
    engine.max_context = 8192
    async with client_for(make_app(engine)) as c:
        s = await c.post("/v1/messages", json={"model": "m", "max_tokens": 10000, "messages": HI, "tools": TOOLS,
                                               "stream": True})
    events = parse_typed_sse(s.text)
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    pieces = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert pieces == '{"a": ' + deep + "}"


def engine_stopping_at(text: str, ids: tuple[int, ...]) -> FakeEngine:
    """The engine's way with a stop: the text cut before it, the tokens generated whole."""
    engine = FakeEngine()
    engine.script = lambda request: [StreamEvent(text=text, token_ids=ids, finish_reason="stop", completion_tokens=len(ids))]
    return engine


@pytest.mark.parametrize("engine, extra, reason, sequence, text", [
    (engine_with("Hello world"), {}, "end_turn", None, "Hello world"),
    (engine_with("Hello world"), {"max_tokens": 5}, "max_tokens", None, "Hello"),
    (engine_stopping_at("Hell", tuple(tok("Hello w"))), {"stop_sequences": ["xyz", " wor", "o w"]}, "stop_sequence",
     "o w", "Hell"),
    # the stop string that ended in the last token, not an earlier one (min_tokens passed over it)
    (engine_stopping_at("llo Hell", tuple(tok("llo Hello w"))), {"stop_sequences": ["llo", "o w"]}, "stop_sequence",
     "o w", "llo Hell"),
    (engine_stopping_at("Hello", (*tok("Hello"), EOS)), {"stop_sequences": ["lo"]}, "end_turn", None, "Hello"),
])
async def test_stop_reasons(engine: FakeEngine, extra: dict, reason: str, sequence: str | None, text: str) -> None:
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": HI, **extra})
    body = r.json()
    assert (body["stop_reason"], body["stop_sequence"], body["content"][0]["text"]) == (reason, sequence, text)


async def test_a_thought_is_a_thinking_block() -> None:
    engine = engine_with("<think>Four.</think>It is 4.", THINKING_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": HI})
        s = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": HI, "stream": True})
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in r.json()["content"]] == [
        ("thinking", "Four."), ("text", "It is 4.")]
    deltas = [e["delta"] for e in parse_typed_sse(s.text) if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Four."
    assert "".join(d.get("text", "") for d in deltas) == "It is 4."


async def test_errors_are_anthropics_shape() -> None:
    engine = FakeEngine()
    async with client_for(make_app(engine)) as c:
        bad = await c.post("/v1/messages", json={"model": "m", "messages": HI})
        long = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x" * 500}]})
        engine.queue_full_after = 0
        full = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI})
    assert bad.status_code == 400 and bad.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required"}}
    assert long.status_code == 400 and long.json()["error"]["type"] == "invalid_request_error"
    assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error" and "retry-after" in full.headers


async def test_an_engine_error_mid_stream_is_an_error_event() -> None:
    engine = FakeEngine()
    engine.script = lambda request: [StreamEvent(text="He", token_ids=(1, 2)),
                                     StreamEvent(finish_reason="error", error="device lost")]
    async with client_for(make_app(engine)) as c:
        s = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI, "stream": True})
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI})
    last = parse_typed_sse(s.text)[-1]
    assert last["type"] == "error" and "device lost" in last["error"]["message"]
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"


async def test_count_tokens_is_the_prompts() -> None:
    engine = engine_with("Hello")
    async with client_for(make_app(engine)) as c:
        n = (await c.post("/v1/messages/count_tokens", json={"model": "m", "system": "Be brief.", "messages": HI})).json()
        await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "system": "Be brief.", "messages": HI})
    assert n == {"input_tokens": len(engine.requests[0].prompt_tokens)}


async def test_the_sdk_reads_messages() -> None:
    engine = engine_with("Checking." + CALL, HERMES_TEMPLATE)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make_app(engine, api_key="sekret")))
    async with anthropic.AsyncAnthropic(base_url="http://test", api_key="sekret", http_client=http, max_retries=0) as sdk:
        out = await sdk.messages.create(model="m", max_tokens=200, messages=HI, tools=TOOLS)  # type: ignore[arg-type]
        async with sdk.messages.stream(model="m", max_tokens=200, messages=HI, tools=TOOLS) as stream:  # type: ignore[arg-type]
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        count = await sdk.messages.count_tokens(model="m", messages=HI, tools=TOOLS)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError):
            await sdk.messages.create(model="m", max_tokens=0, messages=HI)  # type: ignore[arg-type]
    assert out.stop_reason == "tool_use" and out.content[0].text == "Checking."  # type: ignore[union-attr]
    assert out.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert "".join(texts) == "Checking." and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert count.input_tokens == len(engine.requests[0].prompt_tokens)


async def test_the_api_key_may_come_as_x_api_key() -> None:
    async with client_for(make_app(engine_with("Hi"), api_key="sekret")) as c:
        ok = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI}, headers={"x-api-key": "sekret"})
        wrong = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI}, headers={"x-api-key": "nope"})
        bearer = await c.post("/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "sekret"})
    assert ok.status_code == 200 and wrong.status_code == 401 and bearer.status_code == 200
    # the middleware's refusal in Anthropic's shape on its route, OpenAI's elsewhere
    assert wrong.json()["type"] == "error" and wrong.json()["error"]["type"] == "authentication_error"
    async with client_for(make_app(engine_with("Hi"), api_key="sekret")) as c:
        openai_shaped = await c.post("/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "nope"})
        too_large = await c.post("/v1/messages", content=b"x" * (9 << 20), headers={"x-api-key": "sekret"})
        not_allowed = await c.get("/v1/messages", headers={"x-api-key": "sekret"})
    assert openai_shaped.status_code == 401 and openai_shaped.json()["error"]["type"] == "authentication_error"
    assert "type" not in openai_shaped.json()
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    assert not_allowed.status_code == 405 and not_allowed.json()["type"] == "error"


async def test_a_final_assistant_message_is_continued() -> None:
    engine = engine_with('"a": 1}')
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": [
            {"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]})
        chat = await c.post("/v1/chat/completions", json={"continue_final_message": True, "messages": [
            {"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]})
        bad = await c.post("/v1/chat/completions", json={"continue_final_message": True, "messages": HI})
    assert r.json()["content"][0]["text"] == '"a": 1}' and chat.status_code == 200
    assert prompt_text(engine, 0) == prompt_text(engine, 1) == "<|user|>JSON please\n<|assistant|>{"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


async def test_count_tokens_counts_past_the_context_and_ignores_max_tokens() -> None:
    engine = FakeEngine(max_context=64)
    long = [{"role": "user", "content": "x" * 100}]
    async with client_for(make_app(engine)) as c:
        n = await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": long, "max_tokens": None})
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": long})
        zero = await c.post("/v1/messages", json={"model": "m", "max_tokens": 0, "messages": HI})
    assert n.json() == {"input_tokens": 1 + len("<|user|>" + "x" * 100 + "\n<|assistant|>")}
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert zero.status_code == 400 and "'max_tokens'" in zero.json()["error"]["message"]
    assert "max_completion_tokens" not in zero.text


async def test_a_stop_token_is_no_stop_sequence() -> None:
    engine = engine_stopping_at("Hel", tuple(tok("Hello")))
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": HI, "stop_sequences": ["lo"],
                                               "stop_token_ids": tok("o")})
    assert (r.json()["stop_reason"], r.json()["stop_sequence"]) == ("end_turn", None)


@pytest.mark.parametrize("prefill", ["<", "\n", "im", "Sure "])
async def test_a_prefill_is_cut_where_its_content_ends_whatever_it_holds(prefill: str) -> None:
    """The end of the final message is found by a marker, not by searching for its text, which can
    stand in the turn's closing tags (ChatML's `<|im_end|>`) or in an earlier message; a template
    that trims its content (Llama 3's) trims the prefill too."""
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    trimming = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "user", "content": "Sure thing, answer in JSON please."}, {"role": "assistant", "content": prefill}]
    # (the trimming template strips the prefill's leading whitespace, as it would the message's;
    # its trailing whitespace, before the marker, is the prefill's own and stays)
    for template, expected in ((chatml, f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n{prefill}"),
                               (trimming, f"<|user|>{messages[0]['content']}<|end|><|assistant|>{prefill.lstrip()}")):
        engine = engine_with("x", template)
        async with client_for(make_app(engine)) as c:
            r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": messages})
        assert r.status_code == 200, r.text
        assert prompt_text(engine) == expected


async def test_a_final_message_with_tool_calls_is_not_continued() -> None:
    async with client_for(make_app(engine_with("x"))) as c:
        r = await c.post("/v1/chat/completions", json={"continue_final_message": True, "messages": [
            HI[0], {"role": "assistant", "content": "a", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    assert r.status_code == 400 and "tool calls" in r.json()["error"]["message"]


async def test_a_prefill_inside_a_thought_is_continued_as_the_thought() -> None:
    engine = engine_with(" it through.</think>It is 4.", THINKING_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": [
            HI[0], {"role": "assistant", "content": "<think>\nLet me think"}]})
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in r.json()["content"]] == [
        ("thinking", "it through."), ("text", "It is 4.")]
