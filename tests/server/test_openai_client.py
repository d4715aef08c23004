"""The official `openai` client, pointed at the app through an in-process ASGI transport."""

from __future__ import annotations

from typing import AsyncIterator

import httpx2
import openai
import pytest
from starlette.applications import Starlette

from tests.server.fakes import FakeEngine, make_app

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def sdk(engine: FakeEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    app: Starlette = make_app(engine, api_key="sekret")
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="sekret", http_client=http, max_retries=0) as client:
        yield client


async def test_completion(sdk: openai.AsyncOpenAI) -> None:
    out = await sdk.completions.create(model="m", prompt="Hi", max_tokens=5, logprobs=1)
    assert out.choices[0].text == "Hello" and out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.tokens == list("Hello")
    assert out.usage is not None and out.usage.completion_tokens == 5


async def test_completion_stream(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.completions.create(
        model="m", prompt="Hi", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert (text, finish) == ("Hello", "length")
    assert usage is not None and usage.total_tokens == 3 + 5


async def test_chat(sdk: openai.AsyncOpenAI) -> None:
    out = await sdk.chat.completions.create(model="m", messages=HI, n=2, logprobs=True, top_logprobs=1)  # type: ignore[arg-type]
    assert [c.message.content for c in out.choices] == ["Hello world"] * 2
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.content is not None
    assert out.choices[0].logprobs.content[0].token == "H"


async def test_chat_stream(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(model="m", messages=HI, stream=True, stop=[" "])  # type: ignore[arg-type]
    parts, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert ("".join(parts), finish) == ("Hello", "stop")


async def test_errors_reach_the_client_typed(sdk: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.completions.create(model="m", prompt="Hi", temperature=3)
    assert bad.value.param == "temperature"
    engine.queue_full_after = 0
    with pytest.raises(openai.RateLimitError):
        await sdk.chat.completions.create(model="m", messages=HI)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        await sdk.with_options(api_key="wrong").models.list()


async def test_stream_error_frame_raises_in_the_client(sdk: openai.AsyncOpenAI, engine: FakeEngine) -> None:
    from scheduler.types import StreamEvent

    engine.script = lambda request: [StreamEvent(finish_reason="error", error="device lost")]
    stream = await sdk.chat.completions.create(model="m", messages=HI, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.APIError, match="device lost"):
        async for _ in stream:
            pass


async def test_models(sdk: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in sdk.models.list()]
    assert models == ["fake.gguf"]
    assert (await sdk.models.retrieve("fake.gguf")).id == "fake.gguf"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await sdk.models.retrieve("gpt-4o")
