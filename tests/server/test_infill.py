"""Fill-in-the-middle (server/infill.py): the prompt's layout in the model's FIM tokens, what long
inputs keep, llama-server's `/infill` and `/v1/completions`' `suffix` on the fake engine, and the
refusals (400 naming the field; 501 for a model without FIM tokens)."""

from __future__ import annotations

import pytest

from server import infill
from server.errors import ApiError
from tests.server.fakes import BOS, FakeEngine, FakeTokenizer, client_for, make_app, parse_sse, tok

pytestmark = pytest.mark.anyio

# byte tokens no test text holds, standing in for a code model's FIM tokens
PRE, SUF, MID, REP, SEP = (tok(chr(c))[0] for c in range(0x10, 0x15))
FIM = {"fim_pre": PRE, "fim_suf": SUF, "fim_mid": MID}
REPO = {**FIM, "fim_rep": REP, "fim_sep": SEP}


def tokenizer(fim: dict[str, int]) -> FakeTokenizer:
    t = FakeTokenizer()
    t.fim_ids = dict(fim)
    return t


def fim_engine(fim: dict[str, int] = FIM, max_context: int = 256) -> FakeEngine:
    engine = FakeEngine(max_context=max_context)
    engine.tokenizer.fim_ids = dict(fim)
    return engine


def test_the_prompt_is_prefix_then_suffix_then_middle_or_spm_order() -> None:
    t = tokenizer(FIM)
    ids = infill.fim_prompt(t, "def f(", "):\n", start=tok("x"), max_context=256, reserve=16)
    assert ids == [BOS, PRE, *tok("def f("), *tok("x"), SUF, *tok("):\n"), MID]
    spm = infill.fim_prompt(t, "def f(", "):\n", start=tok("x"), max_context=256, reserve=16, spm=True)
    assert spm == [BOS, SUF, *tok("):\n"), PRE, *tok("def f("), *tok("x"), MID]


def test_long_inputs_keep_the_prefix_end_and_the_suffix_start() -> None:
    """A window of min(2048, context / 2) = 32 tokens at a context of 64: the prefix keeps its
    last 24, the suffix its first 8 - (2 + the start's 1)."""
    t = tokenizer(FIM)
    prefix, suffix = "".join(chr(97 + i % 26) for i in range(40)), "0123456789"
    ids = infill.fim_prompt(t, prefix, suffix, start=tok("!"), max_context=64, reserve=8)
    assert ids == [BOS, PRE, *tok(prefix[-24:]), *tok("!"), SUF, *tok(suffix[:5]), MID]


def test_extra_context_in_repository_form_or_as_snippets_keeps_its_end() -> None:
    extra = [("a.py", "x = 1\n"), ("b.py", "y = 2\n")]
    ids = infill.fim_prompt(tokenizer(REPO), "p", "s", extra=extra, max_context=256, reserve=16)
    context = [REP, *tok("myproject\n"), SEP, *tok("a.py\n"), *tok("x = 1\n"), SEP, *tok("b.py\n"),
               *tok("y = 2\n"), SEP, *tok("filename\n")]
    assert ids == [BOS, *context, PRE, *tok("p"), SUF, *tok("s"), MID]
    plain = infill.fim_prompt(tokenizer(FIM), "p", "s", extra=extra, max_context=256, reserve=16)
    assert plain == [BOS, *tok(infill.SNIPPET + "x = 1\n" + infill.SNIPPET + "y = 2\n"), PRE, *tok("p"), SUF,
                     *tok("s"), MID]
    # a context that holds part of it: the end (nearest the file edited), the generation's reserve kept
    core = [PRE, *tok("p"), SUF, *tok("s"), MID]
    for reserve in (1, 10, 30):
        short = infill.fim_prompt(tokenizer(REPO), "p", "s", extra=extra, max_context=48, reserve=reserve)
        kept = 48 - 1 - len(core) - reserve
        assert short == [BOS, *context[len(context) - kept:], *core]
    assert infill.fim_prompt(tokenizer(REPO), "p", "s", extra=extra, max_context=48, reserve=60) == [BOS, *core]


async def test_infill_serves_the_fim_prompt_as_a_completion() -> None:
    engine = fim_engine(REPO)
    async with client_for(make_app(engine)) as client:
        r = await client.post("/infill", json={
            "input_prefix": "def f(", "input_suffix": "):\n", "prompt": "a", "n_predict": 5, "temperature": 0,
            "input_extra": [{"filename": "u.py", "text": "z"}], "cache_prompt": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == "Hello" and body["stop_type"] == "limit" and body["tokens_predicted"] == 5
    context = [REP, *tok("myproject\n"), SEP, *tok("u.py\n"), *tok("z"), SEP, *tok("filename\n")]
    want = [BOS, *context, PRE, *tok("def f("), *tok("a"), SUF, *tok("):\n"), MID]
    assert list(engine.requests[-1].prompt_tokens) == want and engine.requests[-1].max_tokens == 5


async def test_infill_takes_spm_order_and_token_ids_and_streams() -> None:
    engine = fim_engine()
    async with client_for(make_app(engine, spm_infill=True)) as client:
        r = await client.post("/infill", json={"input_prefix": "p", "input_suffix": "s", "prompt": tok("m"),
                                               "n_predict": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert list(engine.requests[-1].prompt_tokens) == [BOS, SUF, *tok("s"), PRE, *tok("p"), *tok("m"), MID]
    frames = parse_sse(r.text)
    assert "".join(f["content"] for f in frames) == "Hel" and [f["stop"] for f in frames][-2:] == [False, True]


async def test_infill_without_fim_tokens_is_not_supported() -> None:
    engine = FakeEngine()
    async with client_for(make_app(engine)) as client:
        r = await client.post("/infill", json={"input_prefix": "p", "input_suffix": "s"})
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "not_supported_error" and "fim_pre" in r.json()["error"]["message"]
    assert engine.requests == []


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": 1}, "input_prefix"),
    ({"input_suffix": ["x"]}, "input_suffix"),
    ({"input_extra": {"text": "x"}}, "input_extra"),
    ({"input_extra": [{"text": 3}]}, "input_extra"),
    ({"input_extra": [{"text": "x", "filename": None}]}, "input_extra"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10_000]}, "prompt"),
    ({"n_predict": -3}, "n_predict"),
    ({"temperature": "hot"}, "temperature"),
])
async def test_infill_refusals_name_the_field(body: dict, param: str) -> None:
    engine = fim_engine()
    async with client_for(make_app(engine)) as client:
        r = await client.post("/infill", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and engine.requests == []


async def test_a_completion_suffix_becomes_a_fim_prompt() -> None:
    engine = fim_engine()
    async with client_for(make_app(engine)) as client:
        r = await client.post("/v1/completions", json={"prompt": ["ab", "cd"], "suffix": "z", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == ["Hell", "Hell"]
        assert [list(q.prompt_tokens) for q in engine.requests] == [
            [BOS, PRE, *tok(p), SUF, *tok("z"), MID] for p in ("ab", "cd")]
        r = await client.post("/v1/completions", json={"prompt": "ab", "suffix": "", "max_tokens": 2})
        assert r.status_code == 200 and list(engine.requests[-1].prompt_tokens) == [BOS, *tok("ab")]
        for body, param in (({"prompt": "ab", "suffix": "z", "echo": True}, "echo"),
                            ({"prompt": [5, 6], "suffix": "z"}, "prompt"),
                            ({"prompt": "ab", "suffix": 3}, "suffix")):
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    async with client_for(make_app(FakeEngine())) as client:
        r = await client.post("/v1/completions", json={"prompt": "ab", "suffix": "z"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_to_completion_body_passes_the_rest_through() -> None:
    body = infill.to_completion_body({"input_prefix": "p", "n_predict": 2, "top_k": 5, "input_extra": []},
                                     tokenizer(FIM), 64, False)
    assert body == {"prompt": [BOS, PRE, *tok("p"), SUF, MID], "n_predict": 2, "top_k": 5}
    with pytest.raises(ApiError) as e:
        infill.to_completion_body([], tokenizer(FIM), 64, False)
    assert e.value.status == 400


async def test_an_editors_request_reaches_the_engine_with_its_line_stops() -> None:
    """llama.vim's /infill body: its n_indent and t_max_predict_ms become the engine request's
    min_indent and newline_limit_s (tests/scheduler/test_requests.py runs them), the fields it
    sends for llama.cpp alone are taken, and response_fields picks the reply's."""
    engine = fim_engine(REPO)
    body = {"input_prefix": "    x = ", "input_suffix": "\n", "input_extra": [], "prompt": "", "n_predict": 4,
            "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 250, "response_fields": ["content", "timings/prompt_n", "tokens_cached"]}
    async with client_for(make_app(engine)) as client:
        r = await client.post("/infill", json=body)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"content", "timings/prompt_n", "tokens_cached"} and r.json()["content"] == "Hell"
        sent = engine.requests[-1]
        assert (sent.min_indent, sent.newline_limit_s, sent.sampling.top_k) == (4, 0.25, 40)
        r = await client.post("/completion", json={"prompt": "a", "n_predict": 2, "t_max_predict_ms": 0})
        assert r.status_code == 200 and (engine.requests[-1].min_indent, engine.requests[-1].newline_limit_s) == (0, None)
        # limits beyond a float's range, or too small to count, are limits still
        for limit, seconds in ((10 ** 400, 1e9), (5e-324, 1e-9)):
            r = await client.post("/completion", json={"prompt": "a", "n_predict": 2, "t_max_predict_ms": limit})
            assert r.status_code == 200 and engine.requests[-1].newline_limit_s == seconds, r.text
        for limit in ("1", True, [1]):
            r = await client.post("/completion", json={"prompt": "a", "t_max_predict_ms": limit})
            assert r.status_code == 400 and r.json()["error"]["param"] == "t_max_predict_ms", r.text


def test_text_the_vocabulary_cannot_hold_is_a_400_naming_its_field() -> None:
    class NoBytes(FakeTokenizer):
        def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
            if "\u2603" in text:
                raise ValueError("no token for U+2603")
            return super().encode(text, add_bos, parse_special)

    t = NoBytes()
    t.fim_ids = dict(FIM)
    for body, param in (({"input_prefix": "\u2603"}, "input_prefix"), ({"input_suffix": "\u2603"}, "input_suffix"),
                        ({"prompt": "\u2603"}, "prompt"), ({"input_extra": [{"text": "\u2603"}]}, "input_extra")):
        with pytest.raises(ApiError) as e:
            infill.to_completion_body(body, t, 64, False)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(ApiError) as e:
        infill.completion_with_suffix({"prompt": "a", "suffix": "\u2603"}, t, 64, False)
    assert (e.value.status, e.value.param) == (400, "suffix")


def test_the_prompt_in_a_real_vocabularys_fim_tokens(tiny_tp_path) -> None:
    """The tokenizer of a GGUF with Qwen2.5-Coder's special tokens (bench/make_synthetic_gguf.py's
    tiny-tp): its FIM tokens found, and a prompt with extra files laid out in them, which
    decodes back to llama-server's text form."""
    from model.gguf_file import GGUFFile
    from model.tokenizer import Tokenizer

    t = Tokenizer.from_gguf_metadata(GGUFFile(str(tiny_tp_path)).metadata)
    assert set(t.fim_ids) == {"fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"}
    ids = infill.fim_prompt(t, "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n",
                            extra=[("util.py", "X = 1\n")], max_context=256, reserve=16)
    assert t.decode(ids, skip_special=False) == (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
        "<|fim_prefix|>def add(a, b):\n    return<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>")
    assert ids[-1] == t.fim_ids["fim_mid"] and not t.add_bos
