"""POST /v1/chat/completions: template rendering, response and chunk shapes, logprobs."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tests.server.fakes import BOS, FakeEngine, client_for, make_app, parse_sse, script_reply, tok

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]


async def test_chat_completion(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    rendered = "<|system|>S\n<|user|>Hi\n<|assistant|>"
    # The template writes bos_token itself: exactly one BOS.
    assert engine.requests[0].prompt_tokens == (BOS, *tok(rendered))
    n_prompt = 1 + len(rendered)
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 11, "total_tokens": n_prompt + 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_message_forms(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    rendered = "<|system|>D\n<|user|>a\nb\n<|assistant|>\n<|tool|>42\n<|assistant|>"
    assert engine.requests[0].prompt_tokens == (BOS, *tok(rendered))


async def test_max_completion_tokens_wins(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {"messages": HI, "max_tokens": 9, "max_completion_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == "He"
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_chat_streaming(client: httpx.AsyncClient) -> None:
    body = {"messages": HI, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse((await client.post("/v1/chat/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "H"},
        {"content": "e"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2


async def test_chat_n(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": HI, "n": 2, "max_tokens": 1, "seed": 7})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert [q.sampling.seed for q in engine.requests] == [7, 8]
    # vLLM's prompt_logprobs come once, beside the choices: the first choice alone scores the prompt
    r = await client.post("/v1/chat/completions", json={"messages": HI, "n": 3, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert [q.prompt_logprobs for q in engine.requests[2:]] == [2, None, None]


async def test_timings_as_llama_server_reports_them(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    """llama-server's `timings`: top-level with one choice, on each choice's last chunk when
    streamed, in each choice with several; draft fields only where drafts were checked."""
    r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
    n_prompt = len(engine.requests[0].prompt_tokens)
    assert r.json()["timings"] == {  # the fake: the prompt in 20 ms, then 5 ms a token
        "cache_n": 0, "prompt_n": n_prompt, "prompt_ms": 20.0, "prompt_per_token_ms": 20.0 / n_prompt,
        "prompt_per_second": n_prompt * 50.0, "predicted_n": 3, "predicted_ms": 10.0,
        "predicted_per_token_ms": 5.0, "predicted_per_second": 200.0,
    }
    body = {"messages": HI, "max_tokens": 2, "stream": True}
    chunks = parse_sse((await client.post("/v1/chat/completions", json=body)).text)[:-1]
    assert ["timings" in c for c in chunks] == [False, False, False, True]
    assert chunks[-1]["timings"]["predicted_n"] == 2 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = await client.post("/v1/chat/completions", json={"messages": HI, "n": 2, "max_tokens": 1})
    assert "timings" not in r.json()
    timings = [c["timings"] for c in r.json()["choices"]]
    assert [t["predicted_n"] for t in timings] == [1, 1]
    assert timings[0]["predicted_per_second"] is None  # one token: no decode time to divide by

    def with_drafts(request):
        *events, last = script_reply(request, engine.reply)
        return [*events, dataclasses.replace(last, timings=dataclasses.replace(last.timings, draft_n=6,
                                                                               draft_n_accepted=4))]

    engine.script = with_drafts
    t = (await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})).json()["timings"]
    assert (t["draft_n"], t["draft_n_accepted"]) == (6, 4)


async def test_chat_logprobs(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    r = await client.post("/v1/chat/completions", json=body)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["refusal"] is None
    first = lp["content"][0]
    assert first["token"] == "H" and first["logprob"] == -0.1 and first["bytes"] == [72]
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("H", -0.1), ("I", pytest.approx(-1.1))]
    assert [e["token"] for e in lp["content"]] == ["H", "e"]
    # logprobs without top_logprobs: chosen tokens only.
    r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "logprobs": True})
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert engine.requests[-1].logprobs and engine.requests[-1].sampling.top_logprobs == 0


async def test_chat_streaming_logprobs(client: httpx.AsyncClient) -> None:
    body = {"messages": HI, "max_tokens": 1, "logprobs": True, "stream": True}
    chunks = parse_sse((await client.post("/v1/chat/completions", json=body)).text)[:-1]
    assert chunks[1]["choices"][0]["logprobs"] == {
        "content": [{"token": "H", "logprob": -0.1, "bytes": [72], "top_logprobs": []}],
        "refusal": None,
    }


async def test_template_kwargs_and_tools() -> None:
    engine = FakeEngine()
    engine.tokenizer.chat_template = "{{ tools | length }}{{ flavour }}{{ messages[0]['content'] }}"
    async with client_for(make_app(engine)) as c:
        body = {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                "chat_template_kwargs": {"flavour": "x"}}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.requests[0].prompt_tokens == (BOS, *tok("1xHi"))


async def test_template_refusal_is_400() -> None:
    engine = FakeEngine()
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "roles must alternate" in r.json()["error"]["message"]


async def test_model_without_template_is_400() -> None:
    engine = FakeEngine()
    engine.tokenizer.chat_template = None
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "--chat-template" in r.json()["error"]["message"]
    # An override from --chat-template (ServerConfig.chat_template) serves it.
    async with client_for(make_app(engine, chat_template="[{{ messages[0]['content'] }}]")) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_tokens == (BOS, *tok("[Hi]"))


async def test_logprobs_of_partial_utf8_tokens(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.reply = "é"  # two byte tokens, one character of text
    r = await client.post("/v1/chat/completions", json={"messages": HI, "logprobs": True})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "é"
    content = choice["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[0xC3], [0xA9]]
    assert [e["token"] for e in content] == ["\ufffd", "\ufffd"]
    assert r.json()["usage"]["completion_tokens"] == 2
