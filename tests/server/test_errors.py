"""Every bad input gets an OpenAI-shaped 4xx naming the field; engine failures map to 429/500/503/504."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import httpx
import pytest

from scheduler.types import RequestValidationError, StreamEvent
from tests.server.fakes import FakeEngine, client_for, make_app, parse_sse, tok

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
LONG = "x" * 80  # the fake engine's context is 64

# (route, body: JSON value or raw bytes, the param the error must name)
BAD_INPUTS: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"not json", None),
    ("/v1/completions", b"", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None),
    ("/v1/completions", b'{"prompt": "\\ud800"}', None),
    ("/v1/completions", b"\xff\xfe{", None),
    ("/v1/completions", b"[" * 100_000, None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [999]}, "prompt"),
    ("/v1/completions", {"prompt": [[5], [999]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": ["a", LONG]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "model": 5}, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 10**400}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "typical_p": 0}, "typical_p"),
    ("/v1/completions", {"prompt": "x", "typical_p": 1.5}, "typical_p"),
    ("/v1/completions", {"prompt": "x", "xtc_probability": -0.1}, "xtc_probability"),
    ("/v1/completions", {"prompt": "x", "xtc_threshold": 2}, "xtc_threshold"),
    ("/v1/completions", {"prompt": "x", "top_n_sigma": "wide"}, "top_n_sigma"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "dynatemp_range": -1}, "dynatemp_range"),
    ("/v1/completions", {"prompt": "x", "dynatemp_exponent": -1}, "dynatemp_exponent"),
    ("/v1/completions", {"prompt": "x", "dry_multiplier": -1}, "dry_multiplier"),
    ("/v1/completions", {"prompt": "x", "dry_base": 0.5}, "dry_base"),
    ("/v1/completions", {"prompt": "x", "dry_allowed_length": 1.5}, "dry_allowed_length"),
    ("/v1/completions", {"prompt": "x", "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ("/v1/completions", {"prompt": "x", "dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ("/v1/completions", {"prompt": "x", "dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ("/v1/completions", {"prompt": "x", "dry_sequence_breakers": ["a"] * 33}, "dry_sequence_breakers"),
    ("/v1/completions", {"prompt": "x", "mirostat": 3}, "mirostat"),
    ("/v1/completions", {"prompt": "x", "repeat_last_n": -2}, "repeat_last_n"),
    ("/completion", {"prompt": "x", "repeat_last_n": False}, "repeat_last_n"),
    ("/v1/completions", {"prompt": "x", "dry_allowed_length": 3000000000}, "dry_allowed_length"),
    ("/v1/completions", {"prompt": "x", "top_k": 3000000000}, "top_k"),
    ("/v1/completions", {"prompt": "x", "dynatemp_range": 1e39}, "dynatemp_range"),
    ("/v1/completions", {"prompt": "x", "mirostat_tau": 1e39}, "mirostat_tau"),
    ("/v1/completions", {"prompt": "x", "mirostat_tau": -1}, "mirostat_tau"),
    ("/v1/completions", {"prompt": "x", "mirostat_eta": "fast"}, "mirostat_eta"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 10**400}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": ["x"] * 5, "n": 16}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": []}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),  # over the engine's 5
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -2}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": 1}, "stream_options"),
    (
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}},
        "stream_options.include_usage",
    ),
    ("/v1/completions", {"prompt": "x", "user": 5}, "user"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "cache_prompt": "no"}, "cache_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, "cache_salt"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [1]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": HI, "tools": "x"}, "tools"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HI, "n": 17}, "n"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", b"[]", None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "x"}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [999]}, "tokens"),
]


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(("route", "body", "param"), BAD_INPUTS, ids=[f"{r}:{p}:{i}" for i, (r, _, p) in enumerate(BAD_INPUTS)])
async def test_bad_input_is_400_naming_the_field(
    client: httpx.AsyncClient, engine: FakeEngine, route: str, body: Any, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = await client.post(route, content=body)
    else:
        r = await client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = _error(r)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert engine.requests == []  # nothing reached the engine


async def test_unknown_route_and_wrong_method(client: httpx.AsyncClient) -> None:
    r = await client.get("/nope")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]


async def test_body_too_large(engine: FakeEngine) -> None:
    async with client_for(make_app(engine, max_body_bytes=2048)) as c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 4096})
        assert r.status_code == 413 and _error(r)["code"] == "request_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(8):
                yield b"x" * 1024
            yield b'"}'

        r = await c.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    assert len(engine.requests) == 1


async def test_api_key(engine: FakeEngine) -> None:
    async with client_for(make_app(engine, api_key="sekret")) as c:
        body = {"prompt": "x", "max_tokens": 1}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "sekret"})
        assert r.status_code == 401
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
    assert len(engine.requests) == 1


async def test_queue_full_is_429_with_retry_after(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.queue_full_after = 0
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3"  # ceil(2.5)
    assert _error(r)["type"] == "rate_limit_error"


async def test_partial_admission_is_rolled_back(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.hold = True
    engine.queue_full_after = 1  # the first of n=3 gets in, the second is refused
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 3})
    assert r.status_code == 429
    assert len(engine.streams) == 1 and engine.streams[0].is_cancelled


async def test_loading_and_failed_engine_are_503(engine: FakeEngine) -> None:
    async with client_for(make_app(None)) as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and _error(r)["code"] == "model_loading"
        assert (await c.post("/tokenize", json={"content": "x"})).status_code == 503
    engine.state = "failed"
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 503 and _error(r)["type"] == "unavailable_error"


async def test_engine_validation_error_is_400(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.submit_error = RequestValidationError("too many biases", "logit_bias")
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and _error(r)["param"] == "logit_bias"


async def test_a_bug_is_an_openai_shaped_500(
    client: httpx.AsyncClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engine.submit_error = RuntimeError("boom")
    with caplog.at_level(logging.ERROR):
        r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    assert _error(r) == {"message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}
    assert any(rec.exc_info and "boom" in str(rec.exc_info[1]) for rec in caplog.records)


def _failing(reason: str, error: str) -> Any:
    def script(request: Any) -> list[StreamEvent]:
        return [
            StreamEvent(text="H", token_ids=tuple(tok("H"))),
            StreamEvent(finish_reason=reason, error=error, completion_tokens=1),
        ]

    return script


@pytest.mark.parametrize(
    ("reason", "status", "type_"),
    [("error", 500, "server_error"), ("timeout", 504, "timeout_error"), ("cancelled", 503, "unavailable_error")],
)
async def test_abnormal_finish_non_streaming(
    client: httpx.AsyncClient, engine: FakeEngine, reason: str, status: int, type_: str
) -> None:
    engine.script = _failing(reason, "device lost")
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == status
    error = _error(r)
    assert error["type"] == type_ and "device lost" in error["message"]


@pytest.mark.parametrize(("reason", "type_"), [("error", "server_error"), ("timeout", "timeout_error")])
async def test_abnormal_finish_streaming(client: httpx.AsyncClient, engine: FakeEngine, reason: str, type_: str) -> None:
    engine.script = _failing(reason, "device lost")
    r = await client.post("/v1/chat/completions", json={"messages": HI, "stream": True})
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert [c["choices"][0]["delta"] for c in events[:2]] == [{"role": "assistant", "content": ""}, {"content": "H"}]
    assert events[2]["error"]["type"] == type_ and "device lost" in events[2]["error"]["message"]
    assert events[3:] == ["[DONE]"]


async def test_one_failing_choice_cancels_the_others(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    calls = []

    def script(request: Any) -> list[StreamEvent]:
        calls.append(request)
        if len(calls) == 2:
            return [StreamEvent(finish_reason="error", error="device lost")]
        return [StreamEvent(text="H", token_ids=tuple(tok("H")))]  # then nothing: still running

    engine.script = script
    engine.hold = True
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 3})
    assert r.status_code == 500
    assert [s.is_cancelled for s in engine.streams] == [True, False, True]  # #2 had already ended


async def test_engine_stopping_mid_request_is_503(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    def script(request: Any) -> list[StreamEvent]:
        engine.state = "stopped"  # a shutdown ends every stream with finish "error"
        return [StreamEvent(finish_reason="error", error="the engine is shutting down")]

    engine.script = script
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "shutting down" in _error(r)["message"]
