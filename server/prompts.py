"""Token ids for a parsed request, and the checks that need the model.

Completion prompts are tokenized as given, special tokens parsed (as llama-server does); token
id prompts pass through. Chat messages are rendered with the GGUF chat template
(`model.chat_template.render_chat`; `--chat-template` replaces the GGUF's) and then tokenized. Checked
here: token ids within the vocabulary, the prompt within the context (400 naming `prompt` or
`messages`), logprobs within the engine's limit. `max_tokens` is clamped to what the context has
left, so a long request ends with finish_reason "length" rather than an error (llama-server's
behaviour, friendlier to clients that always send a large max_tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Protocol

from server import reasoning
from server.errors import invalid
from server.openai_api import ParsedRequest

log = logging.getLogger(__name__)

RenderChat = Callable[..., str]  # render_chat(template, messages, add_generation_prompt, bos_token, eos_token, **extra)
# Ends the final message's content in a prompt rendered to be continued (`render`); cut away
# before tokenizing. Private-use characters, which no template writes of itself.
CONTINUE_MARKER = "\ue000continue\ue001"


class TokenizerLike(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]: ...

    def decode(self, ids: Any, skip_special: bool = True) -> str: ...

    def token_to_piece(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the engine reported once ready (`Engine.info()`), plus the tokenizer's vocabulary."""

    max_context: int
    vocab_size: int
    max_top_logprobs: int = 20
    max_logit_bias: int | None = None  # None: the engine checks


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    tokens: tuple[int, ...]
    max_tokens: int  # clamped to the context left after the prompt
    echo_text: str = ""  # the prompt as text, only when `echo` asked for it
    opens_thought: bool = False  # chat: the template ended the prompt inside a <think> (server/reasoning.py)


def prepare(
    parsed: ParsedRequest,
    tokenizer: TokenizerLike,
    limits: ModelLimits,
    chat_template: str | None,
    render_chat: RenderChat,
) -> list[PreparedPrompt]:
    _check_against_model(parsed, limits)
    if parsed.is_chat:
        text = render(parsed, tokenizer, chat_template, render_chat)
        prompt = _fit(_encode(tokenizer, text, "messages"), parsed, limits, "messages", "")
        opens = reasoning.opens_thought(text)
        if parsed.continue_final_message:  # a prefill that opened a thought and has not closed it
            prefill = parsed.messages[-1]["content"]
            opens = opens or prefill.rfind(reasoning.OPEN) > prefill.rfind(reasoning.CLOSE)
        return [dataclasses.replace(prompt, opens_thought=opens)]
    out = []
    for i, prompt in enumerate(parsed.prompts):
        field = "prompt" if len(parsed.prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            tokens = _encode(tokenizer, prompt, field)
            echo = prompt
        else:
            if max(prompt) >= limits.vocab_size:
                raise invalid(f"token id {max(prompt)} is outside the vocabulary (size {limits.vocab_size})", field)
            tokens = prompt
            echo = tokenizer.decode(list(prompt), skip_special=False) if parsed.echo else ""
        out.append(_fit(tokens, parsed, limits, field, echo if parsed.echo else ""))
    return out


def bos_eos_text(tokenizer: TokenizerLike) -> tuple[str, str]:
    bos = tokenizer.token_to_piece(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_to_piece(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return bos, eos


def render(parsed: ParsedRequest, tokenizer: TokenizerLike, template: str | None, render_chat: RenderChat) -> str:
    """A chat request's messages (and tools, template kwargs) through the chat template."""
    bos, eos = bos_eos_text(tokenizer)
    messages = [dict(m) for m in parsed.messages]
    if parsed.continue_final_message:
        # The prompt is cut where the final message's content ends: a marker after it shows where
        # (finding the content itself can match inside the turn's closing tags or an earlier message)
        if messages[-1].get("tool_calls"):
            raise invalid("a final message with tool calls cannot be continued", "messages")
        messages[-1]["content"] += CONTINUE_MARKER
    try:
        text = render_chat(
            template,
            messages,
            add_generation_prompt=parsed.add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **parsed.template_kwargs,
        )
    except ValueError as e:  # ChatTemplateError: no template, or it refused these messages
        raise invalid(str(e), "messages") from None
    if parsed.continue_final_message:
        if text.count(CONTINUE_MARKER) != 1:
            raise invalid("the final message cannot be continued: the chat template does not write its "
                          "content once, as given", "messages")
        text = text[: text.index(CONTINUE_MARKER)]
    return text


def count(parsed: ParsedRequest, tokenizer: TokenizerLike, template: str | None, render_chat: RenderChat) -> int:
    """A chat request's prompt tokens, whatever the model's context (Anthropic's count_tokens)."""
    return len(_encode(tokenizer, render(parsed, tokenizer, template, render_chat), "messages"))


def _encode(tokenizer: TokenizerLike, text: str, field: str) -> tuple[int, ...]:
    bos, _ = bos_eos_text(tokenizer)
    # Templates usually write bos_token themselves; adding another would double it.
    add_bos = False if bos and text.startswith(bos) else None
    try:
        return tuple(tokenizer.encode(text, add_bos=add_bos, parse_special=True))
    except ValueError as e:  # e.g. a byte the vocabulary cannot represent
        raise invalid(f"cannot tokenize the {field}: {e}", field) from None


def _fit(tokens: tuple[int, ...], parsed: ParsedRequest, limits: ModelLimits, field: str, echo: str) -> PreparedPrompt:
    if not tokens:
        raise invalid("the prompt is empty", field)
    room = limits.max_context - len(tokens)
    if room < 1:
        raise invalid(
            f"the prompt is {len(tokens)} tokens; this server's context is {limits.max_context} tokens "
            f"(at most {limits.max_context - 1} for the prompt)",
            field,
        )
    max_tokens = room if parsed.max_tokens is None else min(parsed.max_tokens, room)
    return PreparedPrompt(tokens=tokens, max_tokens=max_tokens, echo_text=echo)


def _check_against_model(parsed: ParsedRequest, limits: ModelLimits) -> None:
    if parsed.logprobs is not None and parsed.logprobs > limits.max_top_logprobs:
        raise invalid(f"at most {limits.max_top_logprobs} top logprobs are supported", parsed.logprobs_field)
    bias = parsed.sampling.logit_bias
    if bias and bias[-1][0] >= limits.vocab_size:  # sorted by token id
        raise invalid(f"logit_bias token {bias[-1][0]} is outside the vocabulary", "logit_bias")
    if limits.max_logit_bias is not None and len(bias) > limits.max_logit_bias:
        raise invalid(f"at most {limits.max_logit_bias} logit_bias entries are supported", "logit_bias")
    if any(t >= limits.vocab_size for t in parsed.stop_token_ids):
        raise invalid("a stop token id is outside the vocabulary", "stop_token_ids")
