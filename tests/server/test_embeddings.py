"""POST /v1/embeddings against the fake engine, whose embedding requests (GenerationRequest.pooling)
end with `fake_embedding` of their prompt: the inputs' tokens, the pooling, normalization,
dimensions, base64, the window of requests in the engine, a full queue and a failed input."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import pytest

from scheduler.types import QueueFullError, RequestValidationError, StreamEvent
from server import embeddings_api
from tests.server.fakes import BOS, EOS, FakeEngine, client_for, embedding_event, fake_embedding, make_app, tok

pytestmark = pytest.mark.anyio


def _unit(v) -> list[float]:
    v = np.asarray(v, np.float64)
    return list(v / np.linalg.norm(v))


async def test_one_text_is_one_unit_vector_of_its_prompts_last_token(client: httpx.AsyncClient,
                                                                      engine: FakeEngine) -> None:
    r = await client.post("/v1/embeddings", json={"model": "m", "input": "Hi there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("embd-")
    prompt = (BOS, *tok("Hi there"))
    assert body["usage"] == {"prompt_tokens": len(prompt), "total_tokens": len(prompt)}
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    np.testing.assert_allclose(item["embedding"], _unit(fake_embedding(prompt, "last")), rtol=1e-6)
    (request,) = engine.requests
    assert request.prompt_tokens == prompt and request.max_tokens == 0 and request.pooling == "last"


async def test_a_batch_keeps_its_order_and_at_most_a_slot_each_in_the_engine(engine: FakeEngine) -> None:
    """Eleven inputs (text, and token ids as given) through two slots: each answer at its index;
    the engine never held more than two of them unfinished."""
    in_engine: list[int] = []
    submit = engine.submit

    def counting(request):
        in_engine.append(1 + sum(not s._is_done for s in engine.streams))
        return submit(request)

    engine.submit = counting  # type: ignore[method-assign]
    texts = [f"text number {i}" for i in range(10)]
    async with client_for(make_app(engine)) as client:
        r = await client.post("/v1/embeddings", json={"input": texts, "embd_normalize": -1})
        ids = await client.post("/v1/embeddings", json={"input": [[5, 6, 7]], "embd_normalize": -1})
    assert r.status_code == 200, r.text
    got = r.json()["data"]
    assert [d["index"] for d in got] == list(range(10))
    for d, text in zip(got, texts):
        np.testing.assert_allclose(d["embedding"], fake_embedding((BOS, *tok(text)), "last"))
    assert max(in_engine) == 2 and len(in_engine) == 11
    np.testing.assert_allclose(ids.json()["data"][0]["embedding"], fake_embedding((5, 6, 7), "last"))
    assert engine.requests[-1].prompt_tokens == (5, 6, 7)


async def test_base64_dimensions_and_normalizations(client: httpx.AsyncClient) -> None:
    prompt = (BOS, *tok("abc"))
    raw = fake_embedding(prompt, "last").astype(np.float64)

    async def vector(**fields):
        r = await client.post("/v1/embeddings", json={"input": "abc", **fields})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    floats = await vector()
    packed = await vector(encoding_format="base64")
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), "<f4"), np.asarray(floats, np.float32))
    np.testing.assert_allclose(await vector(dimensions=2), _unit(raw[:2]), rtol=1e-6)
    np.testing.assert_allclose(await vector(embd_normalize=-1), raw)
    np.testing.assert_allclose(await vector(normalize=False), raw)
    np.testing.assert_allclose(await vector(embd_normalize=1), raw / np.abs(raw).sum(), rtol=1e-6)
    np.testing.assert_allclose(await vector(embd_normalize=0), raw * 32760 / np.abs(raw).max(), rtol=1e-6)
    np.testing.assert_allclose(await vector(embd_normalize=3), raw / (np.abs(raw) ** 3).sum() ** (1 / 3), rtol=1e-6)


async def test_special_tokens_truncation_and_the_servers_pooling(engine: FakeEngine) -> None:
    engine.tokenizer.add_eos = True  # type: ignore[attr-defined]  (an embedding model's file asks for EOS)
    async with client_for(make_app(engine, pooling="mean")) as client:
        await client.post("/v1/embeddings", json={"input": "ab"})
        await client.post("/v1/embeddings", json={"input": "ab", "add_special_tokens": False})
        await client.post("/v1/embeddings", json={"input": "abcdef", "truncate_prompt_tokens": 3})
        r = await client.post("/v1/embeddings", json={"input": "x" * 100, "truncate_prompt_tokens": -1})
        await client.post("/v1/embeddings", json={"input": "ab</s>"})  # ends in EOS already: not twice
        counted = await client.post("/tokenize", json={"content": "ab", "add_special": True})
    assert r.status_code == 200, r.text
    prompts = [r.prompt_tokens for r in engine.requests]
    # truncation keeps the special tokens, counted in the three (vLLM's)
    assert prompts[:3] == [(BOS, *tok("ab"), EOS), tuple(tok("ab")), (BOS, *tok("f"), EOS)]
    assert len(prompts[3]) == engine.max_context - 1 and prompts[3][:2] == (BOS, *tok("x")) and prompts[3][-1] == EOS
    assert prompts[4] == (BOS, *tok("ab"), EOS)
    assert counted.json()["tokens"] == list(prompts[0])  # /tokenize counts as the embeddings do
    assert {r.pooling for r in engine.requests} == {"mean"}


@pytest.mark.parametrize("body, field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [-1]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": ["fine", "x" * 100]}, "input[1]"),
    ({"input": "", "add_special_tokens": False}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": "a", "embd_normalize": 10**400}, "embd_normalize"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 5}, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "a", "embd_normalize": -2}, "embd_normalize"),
])
async def test_bad_input_is_a_400_naming_the_field(client: httpx.AsyncClient, engine: FakeEngine, body, field) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert not engine.requests


async def test_a_full_queue_at_the_first_input_is_a_429_and_later_waits_for_room(engine: FakeEngine,
                                                                                  monkeypatch) -> None:
    engine.queue_full_after = 0
    async with client_for(make_app(engine)) as client:
        r = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        # full for two tries after the first input (the others' requests), then room again
        calls = {"n": 0}
        submit = FakeEngine.submit

        def flaky(request):
            calls["n"] += 1
            if calls["n"] in (2, 3):
                raise QueueFullError(1.0)
            return submit(engine, request)

        engine.queue_full_after = None
        engine.submit = flaky  # type: ignore[method-assign]
        monkeypatch.setattr(embeddings_api, "POLL_S", 0.01)
        r = await client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert r.status_code == 200, r.text
        assert [d["index"] for d in r.json()["data"]] == [0, 1, 2]
        # full for good after the first: a 429 once QUEUE_WAIT_S has passed
        monkeypatch.setattr(embeddings_api, "QUEUE_WAIT_S", 0.05)
        calls["n"] = 0

        def full_after_one(request):
            calls["n"] += 1
            if calls["n"] > 1:
                raise QueueFullError(1.0)
            return submit(engine, request)

        engine.submit = full_after_one  # type: ignore[method-assign]
        r = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert r.status_code == 429 and calls["n"] > 2


async def test_a_failed_input_fails_the_request_and_cancels_the_rest(engine: FakeEngine) -> None:
    def script(request):
        if request.prompt_tokens[-1] == tok("!")[0]:
            return [StreamEvent(finish_reason="error", error="device lost")]
        return [StreamEvent(), StreamEvent(finish_reason="length", embedding=np.ones(4, np.float32))]

    engine.script = script
    engine.hold = True  # an event, then nothing until cancelled: "fine" is still running
    async with client_for(make_app(engine)) as client:
        r = await client.post("/v1/embeddings", json={"input": ["fine", "bad!", "never"]})
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    assert len(engine.requests) == 2 and engine.streams[0].is_cancelled  # the window held "never" back


async def test_the_wait_for_room_starts_when_none_of_the_batch_is_left(engine: FakeEngine, monkeypatch) -> None:
    """The queue is full for the second input while the first runs longer than QUEUE_WAIT_S:
    the batch waits for its own first, then for the others' only as long as QUEUE_WAIT_S."""
    monkeypatch.setattr(embeddings_api, "QUEUE_WAIT_S", 0.2)
    monkeypatch.setattr(embeddings_api, "POLL_S", 0.01)
    engine.hold = True  # the first's first event, a blank one, then nothing until the test sends its end
    engine.script = lambda request: [StreamEvent(), embedding_event(request)]
    submit, full = FakeEngine.submit, {"until": None}

    def slow_first(request):
        if not engine.requests:
            return submit(engine, request)  # held: runs until the test ends it
        if full["until"] is None or time.monotonic() < full["until"]:
            raise QueueFullError(1.0)
        engine.hold = False
        return submit(engine, request)

    engine.submit = slow_first  # type: ignore[method-assign]
    async with client_for(make_app(engine)) as client:
        task = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["a", "b"]}))
        await asyncio.sleep(0.4)  # twice QUEUE_WAIT_S with the first still running
        full["until"] = time.monotonic() + 0.1  # the others' requests leave room in 0.1 s
        engine.streams[0]._queue.put_nowait(embedding_event(engine.requests[0]))
        r = await task
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 2


async def test_an_engine_error_at_an_input_names_it_and_a_nan_vector_is_a_500(engine: FakeEngine) -> None:
    async with client_for(make_app(engine)) as client:
        engine.submit_error = RequestValidationError("prompt token ids must be in [0, 9)", "prompt")
        r = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
        engine.submit_error = None
        engine.script = lambda request: [StreamEvent(finish_reason="length", embedding=np.full(4, np.nan, np.float32))]
        r = await client.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 500 and "NaN" in r.json()["error"]["message"]
