"""Thoughts split out of chat replies as `reasoning_content` (server/reasoning.py, read with the
tool calls by server/replies.py): the splitter on its own, streamed in pieces of every size
against the whole text, and through /v1/chat/completions on the fake engine."""

from __future__ import annotations

import json

import openai
import pytest

from server import reasoning, replies
from server.config import ServerConfig
from server.reasoning import ReasoningStream
from server.replies import ReplyFormat
from tests.server.fakes import FakeEngine, client_for, make_app, parse_sse
from tests.server.test_tool_calls import CALL, HERMES_TEMPLATE, TOOLS

HI = [{"role": "user", "content": "2+2?"}]
# Templates in the two forms: the reply opens its thought itself (DeepSeek-R1's first form, Qwen3),
# or the template opens it at the end of the prompt (later R1 distills); both name the tags.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('reasoning_content') %}<think>"
    "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}{# may write <think>...</think> #}"
)
OPENING_TEMPLATE = THINKING_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>\n{% endif %}")

CASES = [
    # (text, the prompt opened the thought, reasoning, content)
    ("<think>\nFour, since 2+2.\n\nSure.\n</think>\n\nIt is 4.", False, "Four, since 2+2.\n\nSure.", "It is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Four.\n</think>\n\n4", True, "Four.", "4"),
    ("<think>\na thought cut short by max_tokens", False, "a thought cut short by max_tokens", ""),
    ("It is 4. <think>not at the start</think>", False, None, "It is 4. <think>not at the start</think>"),
    ("<thinking>x</thinking>", False, None, "<thinking>x</thinking>"),
    ("<th", False, None, "<th"),
    ("\n\n", False, None, "\n\n"),
    ("</think>4", True, None, "4"),
    ("a </thin", True, "a </thin", ""),
]


@pytest.mark.parametrize("text, opened, thought, content", CASES)
def test_split_whole_and_in_pieces(text: str, opened: bool, thought: str | None, content: str) -> None:
    whole = replies.read(ReplyFormat(thoughts=True, opens_thought=opened), text)
    assert (whole.reasoning, whole.content, whole.tool_calls) == (thought, content, None)
    for size in (1, 2, 3, 5, len(text)):
        stream, parts = ReasoningStream(opened), []
        for i in range(0, len(text), size):
            parts += stream.feed(text[i : i + size])
        parts += stream.finish()
        got = "".join(t for kind, t in parts if kind == "reasoning") or None
        assert (got, "".join(t for kind, t in parts if kind == "content")) == (thought, content), size


def test_thought_streams_as_it_comes() -> None:
    stream = ReasoningStream(opened=False)
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nLet") == [("reasoning", "Let")]
    assert stream.feed(" me see. </th") == [("reasoning", " me see.")]  # trailing space waits for more
    assert stream.feed("ink>\n\nFour") == [("content", "Four")]


def test_resolve() -> None:
    assert reasoning.resolve("auto", THINKING_TEMPLATE) and not reasoning.resolve("auto", HERMES_TEMPLATE)
    assert reasoning.detect("{% set c = c.split('</think>')[-1] %}")  # R1 distills' first templates
    assert reasoning.resolve("deepseek", None) and not reasoning.resolve("none", THINKING_TEMPLATE)
    assert reasoning.opens_thought("<|assistant|><think>\n") and not reasoning.opens_thought("<think>a</think>\n")
    with pytest.raises(ValueError):
        reasoning.resolve("hidden", None)
    with pytest.raises(ValueError, match="reasoning format"):
        ServerConfig(model_name="m.gguf", reasoning_format="hidden")


def thinking_engine(reply: str, template: str = THINKING_TEMPLATE) -> FakeEngine:
    engine = FakeEngine(max_context=512)
    engine.tokenizer.chat_template = template
    engine.reply = reply
    return engine


@pytest.mark.anyio
@pytest.mark.parametrize("template, reply", [(THINKING_TEMPLATE, "<think>\nFour.\n</think>\n\nIt is 4."),
                                             (OPENING_TEMPLATE, "Four.\n</think>\n\nIt is 4.")])
async def test_chat_splits_the_thought(template: str, reply: str) -> None:
    engine = thinking_engine(reply, template)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI})
        s = await c.post("/v1/chat/completions", json={"messages": HI, "stream": True, "logprobs": True})
        health = (await c.get("/health")).json()
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 4.", "refusal": None,
                                                 "reasoning_content": "Four."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    chunks = [c for c in parse_sse(s.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Four."
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # the thought comes first
    sent = [e["token"] for c in chunks if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    assert "".join(sent) == reply  # every token's logprob once, in order
    assert health["reasoning_format"] == "deepseek"


@pytest.mark.anyio
async def test_reasoning_format_none_keeps_the_thought_in_content() -> None:
    reply = "<think>Four.</think>It is 4."
    engine = thinking_engine(reply)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "reasoning_format": "none"})
        bad = await c.post("/v1/chat/completions", json={"messages": HI, "reasoning_format": "hidden"})
    assert r.json()["choices"][0]["message"]["content"] == reply
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_format"
    async with client_for(make_app(thinking_engine(reply), reasoning_format="none")) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI})
        on = await c.post("/v1/chat/completions", json={"messages": HI, "reasoning_format": "deepseek"})
    assert "reasoning_content" not in r.json()["choices"][0]["message"]
    assert on.json()["choices"][0]["message"]["reasoning_content"] == "Four."


@pytest.mark.anyio
async def test_templates_without_thoughts_are_left_alone() -> None:
    engine = thinking_engine("<think>x</think>y", template=HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y", "refusal": None}


@pytest.mark.anyio
async def test_a_thought_then_tool_calls() -> None:
    """A thought, then a call: the call is read out of the content only (Qwen3's order)."""
    engine = thinking_engine("<think>Need the weather.</think>\n" + CALL, template=THINKING_TEMPLATE + HERMES_TEMPLATE)
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS})
        s = await c.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS, "stream": True})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the weather." and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]
    deltas = [c["choices"][0]["delta"] for c in parse_sse(s.text) if c != "[DONE]"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc] == ["get_weather"]


@pytest.mark.anyio
async def test_earlier_thoughts_reach_the_template() -> None:
    engine = thinking_engine("ok")
    messages = [*HI, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}, {"role": "user", "content": "x"}]
    async with client_for(make_app(engine)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": messages})
        bad = await c.post("/v1/chat/completions", json={"messages": [
            *HI, {"role": "assistant", "content": "4", "reasoning_content": 3}]})
    assert r.status_code == 200, r.text
    assert "<|assistant|><think>2+2</think>4" in engine.tokenizer.decode(engine.requests[0].prompt_tokens)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].reasoning_content"


@pytest.mark.anyio
async def test_openai_sdk_reads_the_thought() -> None:
    engine = thinking_engine("<think>Four.</think>It is 4.")
    http = client_for(make_app(engine))
    sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
    async with http:
        done = await sdk.chat.completions.create(model="m", messages=HI)
        stream = await sdk.chat.completions.create(model="m", messages=HI, stream=True)
        thought = "".join([getattr(c.choices[0].delta, "reasoning_content", None) or "" async for c in stream])
    assert done.choices[0].message.content == "It is 4."
    assert done.choices[0].message.reasoning_content == "Four."  # type: ignore[attr-defined]
    assert thought == "Four."
