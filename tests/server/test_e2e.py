"""End to end: `python -m server` as a subprocess on a free port with the real SmolLM2,
driven by the official `openai` client and raw HTTP (with `--numerics native`, the fast path;
test_default_numerics_e2e.py runs the default, llama.cpp's arithmetic), with the speculative
decode on (`--draft-max 3`): the greedy requests below take their tokens from it."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import running_server


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server")
    args = ["--model", str(smollm2_path), "--max-context", "1024", "--slots", "4", "--max-queue", "4",
            "--numerics", "native", "--draft-max", "3", "--slot-save-path", str(logs / "slots")]
    with running_server(args, logs / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_health_reports_model_and_kernels(server):
    body = httpx.get(server + "/health").json()
    assert body["status"] == "ok"
    assert body["slots"] == 4
    assert {"embed", "attention_decode", "attention_prefill"} <= set(body["kernels"])
    assert {k for k in body["kernels"] if k.startswith("matmul")} == {
        "matmul[q4_1]", "matmul[q8_0]", "matmul_decode[q4_1]", "matmul_decode[q8_0]"}
    # the reference matmul reads x as it is: no values stored in another order
    assert body["engine"]["ordered_values"] == []
    assert body["engine"]["gated_ffn"] == []  # nor a gated activation in the matmul


def test_completion_streamed_equals_unstreamed(client):
    kwargs = dict(model="m", prompt="The capital of France is", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text


def test_chat_streamed_equals_unstreamed(client):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == text


def test_seeded_choices(client):
    kwargs = dict(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, n=2)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "x " * 2000, "max_tokens": 4}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "speculative.n_max": -1}, "speculative.n_max"),
    ],
)
def test_bad_input_is_400(server, body, field):
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_malformed_json_is_400(server):
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_disconnect_frees_the_slot(server):
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert httpx.get(server + "/health").json()["slots_busy"] == 1
        # llama-server's /slots shows it, from the engine's process, with its prompt and limit
        slots = httpx.get(server + "/slots").json()
        busy = [s for s in slots if s["is_processing"]]
        assert len(slots) == 4 and len(busy) == 1 and all(s["n_ctx"] == 1024 and s["speculative"] for s in slots)
        assert busy[0]["n_prompt_tokens"] == busy[0]["n_prompt_tokens_processed"] + busy[0]["n_prompt_tokens_cache"] > 0
        assert busy[0]["params"]["n_predict"] == 400 and busy[0]["next_token"][0]["n_decoded"] > 0
    deadline = time.monotonic() + 60
    while httpx.get(server + "/health").json()["slots_busy"] != 0:
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.1)


def test_a_chats_next_turn_reuses_its_history_with_the_same_answer(client):
    """The prompt cache: the second turn of a chat whose first turn filled a whole chunk (512
    tokens) reuses that chunk (usage.prompt_tokens_details.cached_tokens) and answers as the same
    prompt prefilled whole does (llama-server's `cache_prompt: false`)."""
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    kwargs = dict(model="m", max_tokens=8, temperature=0)
    first = client.chat.completions.create(messages=turn1, **kwargs)
    assert first.usage.prompt_tokens > 512
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a fruit?"}]
    cold = client.chat.completions.create(messages=turn2, extra_body={"cache_prompt": False}, **kwargs)
    warm = client.chat.completions.create(messages=turn2, **kwargs)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 512
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens


def test_a_saved_slot_restored_into_another_serves_the_same_answer(server, client):
    """llama-server's slot actions: the slot holding a chat's first 512 prompt tokens is saved,
    every slot erased (nothing cached is left), the file restored into another slot; the chat's
    next turn then reuses those 512 tokens and answers as the whole prompt prefilled cold does."""
    def post(slot: int, action: str, **body) -> dict:
        r = httpx.post(f"{server}/slots/{slot}?action={action}", json=body or None, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def cached() -> dict[int, int]:  # (as of the last answer: a slot action's carries the engine's stats)
        return {s["id"]: s["n_cached"] for s in httpx.get(server + "/slots").json() if s["n_cached"]}

    system = "You are a terse librarian. " + " ".join(f"Shelf {i} holds books on topic {i * 7}." for i in range(70))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Where are the maps?"}]
    kwargs = dict(model="m", max_tokens=8, temperature=0)
    for slot in range(4):  # earlier tests' prompts: only this chat's chunk is held after it
        post(slot, "erase")
    assert cached() == {}
    first = client.chat.completions.create(messages=turn1, **kwargs)
    assert first.usage.prompt_tokens > 512
    (held,) = cached()
    assert cached()[held] == 512
    saved = post(held, "save", filename="librarian.bin")
    assert saved["n_saved"] == 512 and saved["n_written"] > 0
    for slot in range(4):
        post(slot, "erase")
    assert cached() == {}
    into = (held + 1) % 4
    assert post(into, "restore", filename="librarian.bin")["n_restored"] == 512
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the atlases?"}]
    warm = client.chat.completions.create(messages=turn2, **kwargs)  # first: only the restored slot holds it
    cold = client.chat.completions.create(messages=turn2, extra_body={"cache_prompt": False}, **kwargs)
    assert warm.usage.prompt_tokens_details.cached_tokens == 512
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    missing = httpx.post(f"{server}/slots/0?action=restore", json={"filename": "nothing.bin"}, timeout=60)
    assert missing.status_code == 404


def _metric(server: str, name: str) -> float:
    """The counter once the engine has settled: a step dispatched ahead of a request's end is
    counted when the engine reads it, after the response, and the engine process sends its
    counts to the server's after each step."""
    def read() -> float:
        for line in httpx.get(server + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    deadline, last = time.monotonic() + 30, read()
    while True:
        time.sleep(0.5)
        now = read()
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def test_speculative_decode_gives_the_plain_decodes_text(server, client):
    """With --draft-max 3 a greedy request checks up to 3 drafts a step (`speculative.n_max`: 0
    turns that off for one request): the same text either way, the drafts counted in /metrics
    and in the response's llama-server `timings`, those of the steps past its end left out."""
    assert httpx.get(server + "/health").json()["engine"]["draft_max"] == 3
    kwargs = dict(model="m", prompt="Repeat exactly: red, green, blue, yellow, red, green, blue, yellow, red,",
                  max_tokens=24, temperature=0)
    names = ("pallas_draft_tokens_total", "pallas_draft_tokens_accepted_total")
    first = [_metric(server, name) for name in names]
    start = time.monotonic()
    spec = client.completions.create(**kwargs)
    elapsed_ms = (time.monotonic() - start) * 1e3
    second = [_metric(server, name) for name in names]
    plain = client.completions.create(extra_body={"speculative.n_max": 0}, **kwargs)
    assert [_metric(server, name) for name in names] == second  # no drafts for that request
    assert second[1] > first[1]
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    timings = spec.model_extra["timings"]
    assert [timings["draft_n"], timings["draft_n_accepted"]] == [b - a for a, b in zip(first, second)]
    assert timings["predicted_n"] == spec.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == spec.usage.prompt_tokens
    assert 0 < timings["prompt_ms"] and 0 < timings["predicted_ms"]  # 24 tokens: several steps
    assert timings["prompt_ms"] + timings["predicted_ms"] < elapsed_ms  # measured inside the request's time
    assert "draft_n" not in plain.model_extra["timings"]


def test_constrained_replies_follow_their_grammars_beside_a_free_request(client):
    """A JSON schema (response_format) and a choice (vLLM's structured_outputs) on the real model,
    run beside a free greedy request, which still gets the text it gets alone (the engine runs
    constrained steps one at a time and without the speculative decode, whose drafts the free
    request then does not get: its tokens stay the plain decode's)."""
    import concurrent.futures
    import json

    person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    free = dict(model="m", prompt="The capital of France is", max_tokens=16, temperature=0)
    alone = client.completions.create(**free).choices[0].text
    ask = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        beside = pool.submit(client.completions.create, **free)
        as_json = pool.submit(client.chat.completions.create, model="m", messages=ask, max_tokens=80, temperature=0,
                              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
        chosen = pool.submit(client.chat.completions.create, model="m", max_tokens=8, temperature=1.0, seed=3,
                             messages=[{"role": "user", "content": "Is the sky blue?"}],
                             extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert beside.result().choices[0].text == alone
        reply = as_json.result().choices[0]
        data = json.loads(reply.message.content)
        assert reply.finish_reason == "stop"
        assert set(data) == {"name", "age"} and isinstance(data["name"], str) and len(data["name"]) <= 16
        assert isinstance(data["age"], int) and 0 <= data["age"] <= 150
        answer = chosen.result().choices[0]
        assert answer.message.content in ("yes", "no", "maybe") and answer.finish_reason == "stop"


def test_a_response_equals_the_chat_reply_and_continues_it(client):
    """The Responses API on the real model: the same greedy tokens as the chat request it becomes,
    streamed or not, and a follow-up through previous_response_id whose prompt holds the first turn."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    first = client.responses.create(model="m", instructions="Answer briefly.", input="Name a fruit.",
                                    max_output_tokens=12, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(model="m", instructions="Answer briefly.", input="Name a fruit.",
                                 max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == first.output_text
    follow = client.responses.create(model="m", previous_response_id=first.id, input="And a vegetable?",
                                     max_output_tokens=8, temperature=0)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_message_equals_the_chat_reply(server):
    """Anthropic's Messages API on the real model: the chat request's greedy reply, streamed or not."""
    import anthropic

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}]
    chat = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="m", messages=messages, max_tokens=12, temperature=0)
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=300)
    kwargs = dict(model="m", system="Answer briefly.", messages=[{"role": "user", "content": "Name a fruit."}],
                  max_tokens=12, extra_body={"temperature": 0})  # (the SDK no longer takes it as an argument)
    message = client.messages.create(**kwargs)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
    assert client.messages.count_tokens(model="m", system="Answer briefly.",
                                        messages=[{"role": "user", "content": "Name a fruit."}]).input_tokens == chat.usage.prompt_tokens


def test_a_native_completion_equals_the_openai_completion(server, client):
    """llama-server's `/completion` on the real model: the greedy text and logprobs of the same
    prompt's OpenAI completion, streamed or not, and a stop string reported as llama-server does."""
    prompt = "The three primary colors are"
    openai_choice = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                              logprobs=2).choices[0]
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "n_probs": 2, "return_tokens": True}
    native = _post(server, "/completion", body)
    assert native["content"] == openai_choice.text and len(native["tokens"]) == native["tokens_predicted"]
    assert native["stop_type"] == ("limit" if openai_choice.finish_reason == "length" else "eos")
    assert [p["logprob"] for p in native["completion_probabilities"]] == pytest.approx(
        openai_choice.logprobs.token_logprobs, abs=1e-6)
    with httpx.stream("POST", server + "/completion", json={**body, "stream": True}, timeout=300) as r:
        frames = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(f["content"] for f in frames) == native["content"] and frames[-1]["stop"] is True
    assert [t for f in frames[:-1] for t in f["tokens"]] == native["tokens"]
    # a stop string inside that text ends it there, and is named
    content = native["content"]
    assert len(content) >= 6, content
    word = content[len(content) // 2:len(content) // 2 + 3]
    stopped = _post(server, "/completion", {**body, "stop": [word]})
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert stopped["content"] == content[:content.index(word)]
    assert stopped["has_new_line"] == ("\n" in stopped["content"])
    # its probabilities stop where its text does, as llama-server's: none for the stop string's tokens
    ids = [p["id"] for p in stopped["completion_probabilities"]]
    assert ids == [p["id"] for p in native["completion_probabilities"]][:len(ids)]
    covered = "".join(p["token"] for p in stopped["completion_probabilities"])
    assert covered.startswith(stopped["content"]) and len(ids) < len(native["completion_probabilities"])


def test_infill_on_a_model_without_fim_tokens_is_not_supported(server):
    """SmolLM2's vocabulary has a repository token but no prefix, suffix or middle: /infill and
    a completion's suffix are refused before the engine sees them, which serves on."""
    r = httpx.post(server + "/infill", json={"input_prefix": "def f(", "input_suffix": "):"}, timeout=60)
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", r.text
    r = httpx.post(server + "/v1/completions", json={"prompt": "def f(", "suffix": "):"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert _post(server, "/completion", {"prompt": "def f(", "n_predict": 2})["tokens_predicted"] == 2


def test_a_line_indented_less_than_n_indent_ends_a_native_completion(server):
    """llama-server's n_indent on the real engine: a grammar holds the reply to three lines, the
    third indented less than asked; the reply ends before its text, as llama-server ends it."""
    body = {"prompt": "def f():", "n_predict": 24, "temperature": 0, "grammar": 'root ::= "x = 1\\n  y\\nz = 2\\n"'}
    whole = _post(server, "/completion", body)
    assert (whole["content"], whole["stop_type"]) == ("x = 1\n  y\nz = 2\n", "eos")
    cut = _post(server, "/completion", {**body, "n_indent": 2})
    assert (cut["content"], cut["stop_type"]) == ("x = 1\n  y\n", "limit")
    assert cut["tokens_predicted"] < whole["tokens_predicted"]


def _post(server: str, route: str, body: dict) -> dict:
    r = httpx.post(server + route, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_a_prompt_as_the_model_generated_it(server):
    """lm-eval's loglikelihood request (a batch of token-id prompts, echo, logprobs 1, max_tokens
    1): a greedy continuation appended to its prompt scores, token by token, the logprob it was
    generated with and is the most likely token at each place (lm-eval's is_greedy); vLLM's
    prompt_logprobs give the same values with ids and rank 1; a shorter prompt in the same
    request scores the positions it shares alike."""
    prompt = _post(server, "/tokenize", {"content": "The capital of France is"})["tokens"]
    gen = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
                                            "ignore_eos": True, "return_token_ids": True})["choices"][0]
    assert gen["prompt_token_ids"] == prompt and len(gen["token_ids"]) == 6
    full = prompt + gen["token_ids"]
    body = {"prompt": [full, prompt], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "prompt_logprobs": 2}
    a, b = sorted(_post(server, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    lp, n = a["logprobs"], len(prompt)
    assert len(lp["tokens"]) == len(full) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == sorted(lp["text_offset"]) and a["text"].startswith("The capital of France is")
    scored = lp["token_logprobs"][n:len(full)]
    assert scored == pytest.approx(gen["logprobs"]["token_logprobs"], abs=2e-2)
    for value, top in zip(scored, lp["top_logprobs"][n:len(full)]):
        assert value == max(top.values()) and 1 <= len(top) <= 2
    vllm = a["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(full)
    for position in range(1, len(full)):
        mine = vllm[position][str(full[position])]
        assert mine["logprob"] == pytest.approx(lp["token_logprobs"][position], abs=1e-6)
        assert mine["rank"] >= 1 and (mine["rank"] == 1) == (position >= n or mine["logprob"] == max(
            e["logprob"] for e in vllm[position].values()))
        assert len(vllm[position]) in (2, 3) and sorted(e["rank"] for e in vllm[position].values())[:2] == [1, 2]
    assert all(vllm[p][str(full[p])]["rank"] == 1 for p in range(n, len(full)))
    shared = b["logprobs"]["token_logprobs"][1:n]
    assert shared == pytest.approx(lp["token_logprobs"][1:n], abs=1e-4)


def test_max_tokens_zero_with_echo_returns_the_scored_prompt_alone(server):
    prompt = _post(server, "/tokenize", {"content": "Paris is the capital of France."})["tokens"]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    out = _post(server, "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert choice["text"] == "Paris is the capital of France."
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and all(
        len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    # streamed: the echoed prompt's chunk carries the same logprobs
    with httpx.stream("POST", server + "/v1/completions", json={**body, "max_tokens": 3, "stream": True},
                      timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == choice["text"] and first["logprobs"] == choice["logprobs"]
    offsets = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert len(offsets) == len(prompt) + 3 and offsets[len(prompt)] == len(choice["text"])


def test_chat_prompt_logprobs_and_token_ids_come_beside_the_choices(server):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 0, "return_token_ids": True}
    out = _post(server, "/v1/chat/completions", body)
    ids, scores = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(ids) == out["usage"]["prompt_tokens"] == len(scores) and scores[0] is None
    assert all(list(entry)[0] == str(token) for entry, token in zip(scores[1:], ids[1:]))
    assert len(out["choices"][0]["token_ids"]) == out["usage"]["completion_tokens"]
    assert httpx.post(server + "/v1/chat/completions", json={**body, "stream": True}).status_code == 400


def test_min_tokens_holds_the_end_back(client):
    """vLLM's min_tokens: a greedy reply that ends early runs on past its end-of-turn token to
    min_tokens, the same tokens up to there."""
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=40)
    short = client.chat.completions.create(**kwargs)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    longer = client.chat.completions.create(**kwargs, extra_body={"min_tokens": 30})
    assert longer.usage.completion_tokens >= 30
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(**{**kwargs, "max_tokens": 5}, extra_body={"min_tokens": 6})


def test_embeddings_are_the_same_alone_and_in_a_batch_and_follow_the_pooling(server, client):
    """OpenAI's SDK (base64 by default) against the real model: unit vectors of the model's
    576 values, each input's the same alone and beside the others (more inputs than slots: the
    batch waits for its own), the prompt tokens counted as /tokenize counts them; with
    normalization off, the raw pooled vector in the same direction (model/test_runner.py checks
    its values against a whole prefill)."""
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by five percent.", "Paris is in France.",
             "A list:", "x " * 300, "Hello", "def f(x): return x", "Once upon a time"]
    batch = client.embeddings.create(model="m", input=texts)
    assert [d.index for d in batch.data] == list(range(len(texts)))
    vectors = np.asarray([d.embedding for d in batch.data])
    assert vectors.shape == (len(texts), 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    alone = client.embeddings.create(model="m", input=texts[2]).data[0].embedding
    np.testing.assert_array_equal(np.asarray(alone, np.float32), vectors[2].astype(np.float32))
    counts = [len(_post(server, "/tokenize", {"content": t, "add_special": True})["tokens"]) for t in texts]
    assert batch.usage.prompt_tokens == sum(counts)
    raw = _post(server, "/v1/embeddings", {"input": texts[:2], "embd_normalize": -1})["data"]
    assert all(np.linalg.norm(d["embedding"]) > 1 for d in raw)
    np.testing.assert_allclose(raw[0]["embedding"] / np.linalg.norm(raw[0]["embedding"]), vectors[0], rtol=1e-5,
                               atol=1e-6)
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-2


def test_dry_breaks_a_repeat_over_http(server, client):
    """llama.cpp's DRY through the server (the engine finds the breakers' tokens): a greedy
    completion that goes on repeating its prompt's sentence without it stops doing so with it,
    and /completion with the same fields gives the same text."""
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
    kwargs = dict(model="m", prompt=prompt, max_tokens=8, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert plain.startswith(" sat on the mat")
    dry = client.completions.create(**kwargs, extra_body={"dry_multiplier": 1000.0}).choices[0].text
    assert dry and not dry.startswith(" sat on")
    native = httpx.post(server + "/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                      "dry_multiplier": 1000.0}, timeout=120).json()
    assert native["content"] == dry
    assert native["generation_settings"]["dry_multiplier"] == 1000.0
    assert native["generation_settings"]["dry_sequence_breakers"] == ["\n", ":", '"', "*"]
