"""Renders a chat (a list of role/content messages) into the prompt text a model was trained on.

The template is the GGUF's `tokenizer.chat_template` (Jinja, as in Hugging Face's
tokenizer_config.json) or a file given with `--chat-template FILE` (`load_template`). It runs
in jinja2's immutable sandbox with the settings Hugging Face's `apply_chat_template` uses
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, a `tojson` that keeps non-ASCII). The text
it returns goes to `Tokenizer.encode(..., parse_special=True)`.

Message content may be a string or a list of `{"type": "text", "text": ...}` parts; parts are
joined with newlines, as llama.cpp's server does for templates that take plain strings.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import pathlib
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """No template, a template that does not compile or fails to render, or messages it rejects."""


class _TemplateRaised(Exception):
    """Raised by `raise_exception(...)` inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    # Hugging Face's variant: keeps non-ASCII characters and the caller's key order
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts Hugging Face's `{% generation %}...{% endgeneration %}` (it marks assistant
    text for training masks) and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, but an unsafe attribute (`__globals__`, `__class__`, ...)
    is an error at once rather than an undefined value that renders as nothing."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] is not an object")
    if not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"messages[{index}] has no role")
    out = dict(message)
    content = message.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"messages[{index}].content[{k}]: unsupported content part {kind!r}; only text parts are supported"
                )
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
    return out


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **extra: Any,
) -> str:
    """The prompt text for `messages`. `extra` reaches the template as further variables
    (e.g. `tools`, `enable_thinking`)."""
    if not template:
        raise ChatTemplateError("the model has no chat template; give one with --chat-template FILE")
    compiled = _compile(template)
    normalized = [_normalize_message(i, m) for i, m in enumerate(messages)]
    try:
        return compiled.render(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template rejected the messages: {e}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def load_template(path: str | os.PathLike[str]) -> str:
    """A template from a file: Jinja text, or a Hugging Face tokenizer_config.json (its
    `chat_template`, the one named "default" when it holds several). Compiled once here so a
    broken file fails at start-up."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read chat template {path}: {e}") from e
    if path.suffix == ".json":
        text = _template_from_json(path, text)
    if not text.strip():
        raise ChatTemplateError(f"chat template {path} is empty")
    _compile(text)
    log.info("chat template loaded from %s (%d characters)", path, len(text))
    return text


def _template_from_json(path: pathlib.Path, text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path}: not valid JSON: {e}") from e
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{path}: no chat_template string in it")
    return template
