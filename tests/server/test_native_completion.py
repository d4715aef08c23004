"""llama-server's native completion API (server/llama_api.py) on the fake engine: the completion
request it becomes, its response and stream, stop types, probabilities, several prompts,
`response_fields`, and its 400s named by llama.cpp's fields."""

from __future__ import annotations

import pytest

from scheduler.types import StreamEvent, TokenLogprob
from server.errors import ApiError
from server.llama_api import to_completion
from tests.server.fakes import BOS, EOS, FakeEngine, FakeTokenizer, client_for, make_app, parse_sse, tok
from tests.server.test_messages import engine_stopping_at
from tests.server.test_responses import engine_with

pytestmark = pytest.mark.anyio

ENCODE = FakeTokenizer().encode


def test_fields_become_a_completion_request() -> None:
    native = to_completion({"prompt": "Hi", "n_predict": 7, "n_probs": 3, "repeat_penalty": 1.1, "temperature": 0.5,
                            "top_k": 40, "min_p": 0.05, "stop": "\n", "n_cmpl": 2, "seed": 4, "cache_prompt": False,
                            "samplers": ["top_k", "temperature"], "id_slot": 1, "n_keep": -1, "typical_p": 1.0,
                            "mirostat": 0, "tfs_z": 1.0, "return_tokens": True}, ENCODE)
    assert native.body == {"prompt": "Hi", "max_tokens": 7, "logprobs": 3, "repetition_penalty": 1.1,
                           "temperature": 0.5, "top_k": 40, "min_p": 0.05, "stop": ["\n"], "n": 2, "seed": 4,
                           "cache_prompt": False, "typical_p": 1.0, "mirostat": 0, "repeat_last_n": 64}
    assert native.n_probs == 3 and native.return_tokens


@pytest.mark.parametrize("body, expected", [
    ({"prompt": "x", "n_predict": -1}, {}),  # up to the context
    ({"prompt": "x", "max_tokens": 0}, {"max_tokens": 0}),
    ({"prompt": "x", "temperature": -1}, {"temperature": 0.0}),  # llama.cpp's greedy
    ({"prompt": "x", "logprobs": 2}, {"logprobs": 2}),
    ({"prompt": "x", "stop": ["", "a"]}, {"stop": ["a"]}),
    # llama.cpp's penalties: over the last repeat_last_n tokens, 64 unless given (0: none)
    ({"prompt": "x", "repeat_penalty": 1.2, "presence_penalty": 0.5, "repeat_last_n": 0},
     {"repetition_penalty": 1.2, "presence_penalty": 0.5, "repeat_last_n": 0}),
    ({"prompt": "x", "repeat_penalty": 1.2}, {"repetition_penalty": 1.2, "repeat_last_n": 64}),
    ({"prompt": "x", "frequency_penalty": 0.2, "repeat_last_n": -1}, {"frequency_penalty": 0.2, "repeat_last_n": -1}),
    ({"prompt": "x", "repeat_last_n": 32}, {"repeat_last_n": 32}),
    ({"prompt": "x", "seed": 4294967295}, {}),  # llama-server's -1 as it reports it back
    ({"prompt": "x", "seed": 4294967294}, {"seed": 4294967294}),
    ({"prompt": "x", "n_probs": 50}, {"logprobs": 20}),  # held to the most the engine gives
    ({"prompt": "x", "post_sampling_probs": False}, {}),
    # llama.cpp's samplers pass on, what it reads as off or saturated folded into this server's ranges
    ({"prompt": "x", "typical_p": 1.5, "dynatemp_range": -1, "xtc_probability": 2, "xtc_threshold": 0.9,
      "top_n_sigma": -1, "dynatemp_exponent": 2},
     {"typical_p": 1.0, "dynatemp_range": 0.0, "xtc_probability": 1.0, "xtc_threshold": 0.9, "top_n_sigma": -1,
      "dynatemp_exponent": 2}),
    ({"prompt": "x", "dry_multiplier": 0.8, "dry_base": 2, "dry_allowed_length": 3, "dry_penalty_last_n": 64,
      "dry_sequence_breakers": ["\n"]},
     {"dry_multiplier": 0.8, "dry_base": 2, "dry_allowed_length": 3, "dry_penalty_last_n": 64,
      "dry_sequence_breakers": ["\n"]}),
    ({"prompt": "x", "dry_multiplier": -1}, {"dry_multiplier": 0.0}),
    ({"prompt": "x", "dry_multiplier": 0.8, "dry_base": 0.5}, {"dry_multiplier": 0.8}),  # llama-server's: the default base
    ({"prompt": "x", "mirostat": 2, "mirostat_tau": 4, "mirostat_eta": 0.2},
     {"mirostat": 2, "mirostat_tau": 4, "mirostat_eta": 0.2}),
])
def test_llama_cpp_forms(body: dict, expected: dict) -> None:
    assert to_completion(body, ENCODE).body == {"prompt": "x", "stop": [], **expected}


def test_a_mixed_prompt_is_token_ids_with_bos_where_a_string_starts_it() -> None:
    assert to_completion({"prompt": ["ab", 7, "c"]}, ENCODE).body["prompt"] == [BOS, *tok("ab"), 7, *tok("c")]
    assert to_completion({"prompt": [7, "<s>c"]}, ENCODE).body["prompt"] == [7, BOS, *tok("c")]  # specials read
    # a string that starts with the BOS gets no other
    assert to_completion({"prompt": ["<s>a", 7]}, ENCODE, "<s>").body["prompt"] == [BOS, *tok("a"), 7]
    # an array of prompts of several forms: token ids each
    assert to_completion({"prompt": ["ab", [5, 6], [7, "c"]]}, ENCODE).body["prompt"] == [
        [BOS, *tok("ab")], [5, 6], [7, *tok("c")]]
    # the forms the completion parser takes pass as they are
    assert to_completion({"prompt": ["ab", "c"]}, ENCODE).body["prompt"] == ["ab", "c"]
    assert to_completion({"prompt": [[5, 6], [7]]}, ENCODE).body["prompt"] == [[5, 6], [7]]


def test_logit_bias_keys_that_only_look_like_numbers_are_text() -> None:
    assert to_completion({"prompt": "x", "logit_bias": [["²", 1], ["--5", 2]]}, ENCODE).body["logit_bias"] == {
        **{str(t): 1.0 for t in tok("²")}, str(tok("-")[0]): 2.0, str(tok("5")[0]): 2.0}


def test_logit_bias_forms() -> None:
    pairs = to_completion({"prompt": "x", "logit_bias": [[5, 1.5], ["ab", False], ["7", -200]]}, ENCODE)
    assert pairs.body["logit_bias"] == {"5": 1.5, str(tok("a")[0]): -100.0, str(tok("b")[0]): -100.0, "7": -100.0}
    assert to_completion({"prompt": "x", "logit_bias": {"9": 2, "c": 3}}, ENCODE).body["logit_bias"] == {
        "9": 2.0, str(tok("c")[0]): 3.0}


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "x", "n_predict": -2}, "n_predict"),
    ({"prompt": "x", "n_probs": -1}, "n_probs"),
    ({"prompt": "x", "n_probs": "3"}, "n_probs"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "tfs_z": 0.9}, "tfs_z"),
    ({"prompt": "x", "t_max_predict_ms": "100"}, "t_max_predict_ms"),
    ({"prompt": "x", "n_indent": -1}, "n_indent"),
    ({"prompt": "x", "n_indent": 1.5}, "n_indent"),
    ({"prompt": "x", "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ({"prompt": "x", "logit_bias": [[5, "a"]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": 5}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[-3, 1]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[5, 10 ** 400]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[5, True]]}, "logit_bias"),
    ({"prompt": "x", "post_sampling_probs": 0}, "post_sampling_probs"),
    ({"prompt": "x", "return_tokens": 1}, "return_tokens"),
    ({"prompt": "x", "logprobs": -2}, "logprobs"),
    ({"prompt": [5, "a", None]}, "prompt"),
    ({"prompt": "x", "response_fields": "content"}, "response_fields"),
])
def test_refusals_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        to_completion(body, ENCODE)
    assert (e.value.status, e.value.param) == (400, param)


async def test_the_response() -> None:
    async with client_for(make_app(engine_with("Hello\nworld"))) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "n_predict": 64, "return_tokens": True, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["content"] == "Hello\nworld" and body["tokens"] == tok("Hello\nworld")
    assert body["stop"] is True and body["stop_type"] == "eos" and body["stopping_word"] == ""
    assert (body["tokens_predicted"], body["tokens_evaluated"], body["tokens_cached"]) == (11, 3, 0)
    assert body["prompt"] == "<s>Hi" and body["has_new_line"] and body["truncated"] is False
    assert body["model"] == "fake.gguf" and body["id_slot"] == -1 and body["index"] == 0
    assert body["generation_settings"]["n_predict"] == 64 and body["generation_settings"]["temperature"] == 0
    assert body["timings"]["predicted_n"] == 11 and body["timings"]["prompt_n"] == 3
    assert "completion_probabilities" not in body


@pytest.mark.parametrize("engine, extra, stop_type, word, content", [
    (engine_with("Hello world"), {"n_predict": 5}, "limit", "", "Hello"),
    (engine_stopping_at("Hell", tuple(tok("Hello w"))), {"stop": ["xyz", "o w"]}, "word", "o w", "Hell"),
    (engine_stopping_at("Hello", (*tok("Hello"), EOS)), {"stop": ["lo"]}, "eos", "", "Hello"),
    (engine_stopping_at("Hi", tuple(tok("Hi\n"))), {"stop": ["\n"]}, "word", "\n", "Hi"),
])
async def test_stop_types(engine: FakeEngine, extra: dict, stop_type: str, word: str, content: str) -> None:
    async with client_for(make_app(engine)) as c:
        r = await c.post("/completion", json={"prompt": "Hi", **extra})
    body = r.json()
    assert (body["stop_type"], body["stopping_word"], body["content"]) == (stop_type, word, content)
    assert body["has_new_line"] == ("\n" in content)  # of the text sent, without the stop string


async def test_probabilities() -> None:
    async with client_for(make_app(engine_with("ab"))) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "n_probs": 2})
    probs = r.json()["completion_probabilities"]
    assert [p["id"] for p in probs] == tok("ab") and [p["token"] for p in probs] == ["a", "b"]
    assert probs[0]["bytes"] == [ord("a")] and probs[0]["logprob"] == pytest.approx(-0.1)
    assert [(t["id"], t["logprob"]) for t in probs[1]["top_logprobs"]] == [
        (tok("b")[0], pytest.approx(-0.2)), (tok("b")[0] + 1, pytest.approx(-1.2))]


async def test_no_probabilities_for_the_stop_strings_tokens() -> None:
    engine = FakeEngine()
    ids = tuple(tok("Hello w"))
    engine.script = lambda request: [StreamEvent(
        text="Hell", token_ids=ids, logprobs=tuple(TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids),
        finish_reason="stop", completion_tokens=len(ids))]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "n_probs": 1, "stop": ["o w"]})
    body = r.json()
    assert body["content"] == "Hell" and body["stop_type"] == "word"
    assert [p["token"] for p in body["completion_probabilities"]] == ["H", "e", "l", "l"]


async def test_no_probabilities_for_the_stop_strings_tokens_after_a_character_of_several_tokens() -> None:
    engine = FakeEngine()
    ids = tuple(tok("a\U0001F600!?"))  # the emoji is 4 byte tokens; the stop string "!?"
    engine.script = lambda request: [StreamEvent(
        text="a\U0001F600", token_ids=ids, logprobs=tuple(TokenLogprob(t, -0.5, ()) for t in ids),
        finish_reason="stop", completion_tokens=len(ids))]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "n_probs": 1, "stop": ["!?"]})
    assert [p["id"] for p in r.json()["completion_probabilities"]] == tok("a\U0001F600")


async def test_the_stream() -> None:
    async with client_for(make_app(engine_with("abc"))) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "stream": True, "n_probs": 1})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert "[DONE]" not in frames
    steps, last = frames[:-1], frames[-1]
    assert "".join(f["content"] for f in steps) == "abc" and all(f["stop"] is False for f in steps)
    assert [f["tokens"] for f in steps] == [tok("a"), tok("b"), tok("c")]
    assert [f["tokens_predicted"] for f in steps] == [1, 2, 3]
    assert [[p["id"] for p in f["completion_probabilities"]] for f in steps] == [tok("a"), tok("b"), tok("c")]
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert last["stop_type"] == "eos" and last["tokens_predicted"] == 3 and "completion_probabilities" not in last


async def test_several_streamed_prompts_and_choices_end_each_with_their_object() -> None:
    async with client_for(make_app(engine_with("ok"))) as c:
        r = await c.post("/completion", json={"prompt": ["a", [5, "bc"]], "n_cmpl": 2, "stream": True})
    frames = parse_sse(r.text)
    for index in range(4):
        mine = [f for f in frames if f["index"] == index]
        assert "".join(f["content"] for f in mine) == "ok" and [f["stop"] for f in mine] == [False, False, True]
        assert mine[-1]["tokens_evaluated"] == (2 if index < 2 else 3)


async def test_several_prompts_are_an_array() -> None:
    async with client_for(make_app(engine_with("ok"))) as c:
        r = await c.post("/completion", json={"prompt": ["a", "bb"], "n_predict": 8})
    body = r.json()
    assert isinstance(body, list) and [(b["index"], b["content"], b["tokens_evaluated"]) for b in body] == [
        (0, "ok", 2), (1, "ok", 3)]


async def test_response_fields() -> None:
    async with client_for(make_app(engine_with("ok"))) as c:
        r = await c.post("/completion", json={"prompt": "a", "response_fields": ["content", "generation_settings/n_predict",
                                                                                  "nothing"]})
    assert r.json() == {"content": "ok", "generation_settings/n_predict": -1}


async def test_errors_name_llama_cpp_fields() -> None:
    engine = engine_with("ok")
    async with client_for(make_app(engine)) as c:
        bad = await c.post("/completion", json={"prompt": "a", "n_predict": "many"})
        penalty = await c.post("/completion", json={"prompt": "a", "repeat_penalty": 0})
        sampler = await c.post("/completion", json={"prompt": "a", "typical_p": 0})
        no_json = await c.post("/completion", content=b"{", headers={"content-type": "application/json"})
        alias = await c.post("/completion", json={"prompt": "a", "max_tokens": "many"})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "n_predict")
    assert "'n_predict'" in bad.json()["error"]["message"]
    assert (penalty.status_code, penalty.json()["error"]["param"]) == (400, "repeat_penalty")
    assert (sampler.status_code, sampler.json()["error"]["param"]) == (400, "typical_p")
    assert no_json.status_code == 400
    assert (alias.status_code, alias.json()["error"]["param"]) == (400, "max_tokens")  # the field given
    for body, param in (({"max_tokens": -5}, "max_tokens"), ({"logprobs": -1}, "logprobs")):  # refused before parsing
        r = await client_for(make_app(engine)).post("/completion", json={"prompt": "a", **body})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param)
    assert engine.requests == []  # nothing reached the engine


async def test_a_failure_after_the_headers_is_an_error_frame() -> None:
    engine = FakeEngine()
    engine.script = lambda request: [StreamEvent(text="a", token_ids=tuple(tok("a"))),
                                     StreamEvent(finish_reason="error", error="boom")]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/completion", json={"prompt": "Hi", "stream": True})
    frames = parse_sse(r.text)
    assert frames[0]["content"] == "a" and frames[-1]["error"]["type"] == "server_error"
    assert "boom" in frames[-1]["error"]["message"]
