"""A reasoning model's thoughts, `<think>...</think>`, split out of its chat reply into
`reasoning_content` (llama-server's `--reasoning-format deepseek`, vLLM's reasoning parsers).

DeepSeek-R1 and its Qwen2/Llama distills, Qwen3 and QwQ think between `<think>` and `</think>`
before answering; templates that open the thought themselves (the prompt ends with `<think>`)
leave only `</think>` in the reply. `ReasoningStream` reads a choice's text as it streams:
everything inside the thought is reasoning, the rest content (then read for tool calls,
server/tool_calls.py). A thought the reply never closes (cut by max_tokens) is all reasoning, as
llama-server has it. Whitespace at the thought's edges and before the answer is dropped.
"""

from __future__ import annotations

from server.tool_calls import marker_start

OPEN, CLOSE = "<think>", "</think>"
CHOICES = ("auto", "deepseek", "none")  # --reasoning-format (llama-server's names)


def detect(template: str | None) -> bool:
    """Whether a chat template knows of thoughts: it names `</think>` (DeepSeek-R1 distills'
    first templates only cut earlier turns' thoughts off at it; later ones and Qwen3's write
    both tags)."""
    return bool(template) and CLOSE in template  # type: ignore[operator]


def resolve(flag: str, template: str | None) -> bool:
    """Whether replies are split: "deepseek" always, "none" never, "auto" where the template
    knows of thoughts (`detect`)."""
    if flag not in CHOICES:
        raise ValueError(f"reasoning format must be one of {', '.join(CHOICES)}, got {flag!r}")
    return flag == "deepseek" or (flag == "auto" and detect(template))


def opens_thought(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a thought the template opened."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningStream:
    """One choice's text in; ("reasoning" | "content", text) pieces out, in order."""

    def __init__(self, opened: bool) -> None:
        self._state = "thinking" if opened else "start"  # "start", "thinking", "answer", "content"
        self._held = ""
        self._space = ""  # the thought's trailing whitespace, sent only if more thought follows
        self._at_edge = True  # the thought's (or answer's) leading whitespace is dropped

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        if self._state == "start":
            stripped = self._held.lstrip()
            if stripped.startswith(OPEN):
                self._held, self._state = stripped[len(OPEN) :], "thinking"
            elif not stripped or OPEN.startswith(stripped):
                return out  # may yet open a thought
            else:
                self._state = "content"
        if self._state == "thinking":
            end = self._held.find(CLOSE)
            if end < 0:
                cut = len(self._held) - marker_start(self._held, CLOSE)
                self._think(self._held[:cut], out)
                self._held = self._held[cut:]
                return out
            self._think(self._held[:end], out)
            self._held, self._state, self._space, self._at_edge = self._held[end + len(CLOSE) :], "answer", "", True
        if self._state == "answer":
            self._held = self._held.lstrip()
            if not self._held:
                return out
            self._state = "content"
        if self._held:
            out.append(("content", self._held))
            self._held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if self._state == "thinking":  # never closed: all of it thought
            out: list[tuple[str, str]] = []
            self._think(held, out)
            return out
        if self._state in ("start", "content") and held:
            return [("content", held)]
        return []

    def _think(self, text: str, out: list[tuple[str, str]]) -> None:
        if self._at_edge:
            text = text.lstrip()
            if not text:
                return
            self._at_edge = False
        body = text.rstrip()
        if body:
            out.append(("reasoning", self._space + body))
            self._space = ""
        self._space += text[len(body) :]
