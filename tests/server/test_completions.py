"""POST /v1/completions against the fake engine (reply "Hello world", one char per token)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from scheduler.types import TokenLogprob
from server.openai_api import ChoiceResult, CompletionRenderer
from tests.server.fakes import BOS, FakeEngine, parse_sse, script_reply, tok

pytestmark = pytest.mark.anyio

REPLY = "Hello world"


async def test_plain_completion(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"model": "anything", "prompt": "Hi"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "anything"  # echoed, whatever it is
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 0}}
    (request,) = engine.requests
    assert request.prompt_tokens == (BOS, *tok("Hi"))
    assert request.max_tokens == 64 - 3  # default: the rest of the context
    assert request.sampling.temperature == 1.0


async def test_model_defaults_to_served_name(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.json()["model"] == "fake.gguf"


async def test_length_and_stop_finish_reasons(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
    assert r.json()["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}
    assert r.json()["usage"]["completion_tokens"] == 5
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stop": ["o w", "zz"]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hell", "stop")
    assert engine.requests[-1].stop == ("o w", "zz")
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stop": "wor"})
    assert r.json()["choices"][0]["text"] == "Hello "


async def test_max_tokens_is_clamped_to_the_context(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10_000})
    assert r.status_code == 200
    assert engine.requests[-1].max_tokens == 61


async def test_sampling_fields_reach_the_engine(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {
        "prompt": "Hi",
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "seed": 5,
        "logit_bias": {"10": -100, "4": 2.5},
        "ignore_eos": True,
        "stop_token_ids": [7],
        "user": "u1",
        "cache_prompt": False,
        "cache_salt": "team-a",
        # llama.cpp's samplers, as llama-server takes them on its OpenAI endpoints
        "typical_p": 0.9,
        "top_n_sigma": 1.5,
        "xtc_probability": 0.25,
        "xtc_threshold": 0.2,
        "dynatemp_range": 0.3,
        "dynatemp_exponent": 1.5,
        "dry_multiplier": 0.8,
        "dry_base": 2,
        "dry_allowed_length": 3,
        "dry_penalty_last_n": 256,
        "dry_sequence_breakers": ["\n", "###"],
        "mirostat": 2,
        "repeat_last_n": 128,
        "mirostat_tau": 4.0,
        "mirostat_eta": 0.2,
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    request = engine.requests[-1]
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 0.5, 7, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.seed) == (0.5, -0.5, 1.1, 5)
    assert s.logit_bias == ((4, 2.5), (10, -100.0))
    assert (s.typical_p, s.top_n_sigma, s.xtc_probability, s.xtc_threshold) == (0.9, 1.5, 0.25, 0.2)
    assert (s.dynatemp_range, s.dynatemp_exponent) == (0.3, 1.5)
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.8, 2.0, 3, 256)
    assert s.dry_sequence_breakers == ("\n", "###") and s.uses_dry
    assert (s.mirostat, s.mirostat_tau, s.mirostat_eta) == (2, 4.0, 0.2)
    assert s.penalty_last_n == 128 and s.uses_penalty_window
    assert request.ignore_eos and request.stop_token_ids == (7,)
    assert not request.cache_prompt and request.cache_salt == "team-a"


async def test_usage_reports_the_prompt_tokens_the_engine_reused(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    """usage.prompt_tokens_details.cached_tokens: per prompt the most any of its choices reused
    (a prompt's tokens count once, whatever n is), summed over the prompts; streamed too."""
    reused = {"a": [3, 1], "bc": [0, 2]}

    def script(request):
        events = script_reply(request, "Hi")
        text = "a" if tuple(request.prompt_tokens) == (BOS, *tok("a")) else "bc"
        return events[:-1] + [dataclasses.replace(events[-1], cached_tokens=reused[text].pop(0))]

    engine.script = script
    r = await client.post("/v1/completions", json={"prompt": ["a", "bc"], "n": 2, "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 + 2}
    assert all(r.cache_prompt for r in engine.requests)  # the default
    reused = {"a": [4]}
    r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    usage = [f["usage"] for f in parse_sse(r.text) if isinstance(f, dict) and f.get("usage")]
    assert usage == [{"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                      "prompt_tokens_details": {"cached_tokens": 4}}]


async def test_list_of_prompts_and_n(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["a", "bc"], "n": 2, "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hel" for c in body["choices"])
    assert [r.prompt_tokens for r in engine.requests] == [(BOS, *tok("a"))] * 2 + [(BOS, *tok("bc"))] * 2
    # Prompt tokens count once per prompt; completion tokens once per choice.
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 0}}


async def test_n_with_seed_derives_distinct_seeds(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "a", "n": 3, "seed": 42})
    assert [r.sampling.seed for r in engine.requests] == [42, 43, 44]
    assert len({r.request_id for r in engine.requests}) == 3


async def test_token_id_prompts(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_tokens == (5, 6, 7)  # as given: no BOS added
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = await client.post("/v1/completions", json={"prompt": [[5], [6, 7]], "max_tokens": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["He", "He"]
    assert [r.prompt_tokens for r in engine.requests[-2:]] == [(5,), (6, 7)]


async def test_special_tokens_in_prompts_are_parsed(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "<s>x</s>", "max_tokens": 1})
    assert engine.requests[-1].prompt_tokens == (BOS, *tok("x"), 2)  # no second BOS


async def test_logprobs(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert engine.requests[-1].logprobs and engine.requests[-1].sampling.top_logprobs == 2
    assert lp["tokens"] == ["H", "e", "l"]
    assert lp["token_logprobs"] == [-0.1, -0.2, -0.3]
    assert lp["top_logprobs"][0] == {"H": -0.1, "I": pytest.approx(-1.1)}
    assert lp["text_offset"] == [0, 1, 2]


async def test_logprobs_zero_lists_the_sampled_token(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"H": -0.1}]


async def test_echo(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi ", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "Hi He"
    r = await client.post("/v1/completions", json={"prompt": "Hi ", "max_tokens": 2, "echo": True, "stream": True})
    chunks = parse_sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hi He"


async def test_streaming_framing(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == ["H", "e", "l", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_streaming_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse((await client.post("/v1/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in events[:-2])


async def test_streaming_n_and_prompts(client: httpx.AsyncClient) -> None:
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True}
    chunks = parse_sse((await client.post("/v1/completions", json=body)).text)[:-1]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "He", 1: "He", 2: "He", 3: "He"}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}


async def test_streaming_logprobs(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "logprobs": 1}
    chunks = parse_sse((await client.post("/v1/completions", json=body)).text)[:-1]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["text"]]
    assert lps == [
        {"tokens": ["H"], "token_logprobs": [-0.1], "top_logprobs": [{"H": -0.1}], "text_offset": [0]},
        {"tokens": ["e"], "token_logprobs": [-0.2], "top_logprobs": [{"e": -0.2}], "text_offset": [1]},
    ]


async def test_short_alias_routes(client: httpx.AsyncClient) -> None:
    r = await client.post("/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "H"


def test_echoed_prompt_logprobs_offsets_run_over_every_tokens_text() -> None:
    """Echo with logprobs: the prompt's tokens first (the first null), at most `logprobs`
    alternatives beside each token, and text_offset over every token's text, prompt then output,
    even where the echoed text lacks a token's (a BOS) and so is shorter."""
    pieces = {1: b"<s>", 10: b"He", 11: b"llo", 12: b"!", 13: b"?"}
    renderer = CompletionRenderer("cmpl-x", 0, "m", pieces.__getitem__, logprobs=True, echo_logprobs=1,
                                  prompt_logprobs=1)
    prompt = (TokenLogprob(10, -1.0, ((12, -0.5), (13, -0.7)), 2), TokenLogprob(11, -0.1, ((11, -0.1),), 1))
    choice = ChoiceResult(index=0, text="Hello!", finish_reason="length", prompt_tokens=(1, 10, 11),
                          prompt_logprobs=prompt, logprobs=[TokenLogprob(12, -0.2, ((12, -0.2),))])
    out = renderer.response([choice], 3, 1)["choices"][0]
    lp = out["logprobs"]
    assert lp["tokens"] == ["<s>", "He", "llo", "!"] and lp["token_logprobs"] == [None, -1.0, -0.1, -0.2]
    assert lp["top_logprobs"] == [None, {"!": -0.5, "He": -1.0}, {"llo": -0.1}, {"!": -0.2}]
    assert lp["text_offset"] == [0, 3, 5, 8]
    assert out["prompt_logprobs"] == [None, {"10": {"logprob": -1.0, "rank": 2, "decoded_token": "He"},
                                             "12": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}},
                                      {"11": {"logprob": -0.1, "rank": 1, "decoded_token": "llo"}}]
    # streamed: the echo chunk holds the prompt's, and the output's offsets go on from there
    streamed = CompletionRenderer("cmpl-x", 0, "m", pieces.__getitem__, logprobs=True, echo_logprobs=1)
    (start,) = streamed.start_chunks(0, "Hello", (1, 10, 11), prompt)
    assert start["choices"][0]["logprobs"]["text_offset"] == [0, 3, 5]
    delta = streamed.delta_chunk(0, "!", (TokenLogprob(12, -0.2, ()),))
    assert delta["choices"][0]["logprobs"]["text_offset"] == [8]
