"""model/chat_template.py: SmolLM2's own template, content parts, errors and the sandbox."""

from __future__ import annotations

import json
import pathlib

import pytest

from model.chat_template import ChatTemplateError, load_template, render_chat
from model.gguf_file import GGUFFile
from model.tokenizer import Tokenizer

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="session")
def smollm2_template(smollm2_path: pathlib.Path) -> str:
    template = GGUFFile(smollm2_path).metadata["tokenizer.chat_template"]
    assert isinstance(template, str)
    return template


def _render(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra: object) -> str:
    return render_chat(
        template, messages, add_generation_prompt, bos_token="<|im_start|>", eos_token="<|im_end|>", **extra
    )


def test_smollm2_default_system_prompt(smollm2_template: str) -> None:
    text = _render(smollm2_template, [{"role": "user", "content": "Hi"}])
    assert text == SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_conversation(smollm2_template: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )
    assert _render(smollm2_template, messages, add_generation_prompt=False) == expected
    assert _render(smollm2_template, messages) == expected + "<|im_start|>assistant\n"


def test_smollm2_prompt_tokenizes_with_special_tokens(smollm2_path: pathlib.Path, smollm2_template: str) -> None:
    tok = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path).metadata)
    ids = tok.encode(_render(smollm2_template, [{"role": "user", "content": "Hi"}]), parse_special=True)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2


def test_content_parts_are_joined(smollm2_template: str) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    text = _render(smollm2_template, [{"role": "user", "content": parts}])
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>\n" in text


def test_non_text_part_is_an_error(smollm2_template: str) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        _render(smollm2_template, [{"role": "user", "content": parts}])


def test_none_content_renders_empty(smollm2_template: str) -> None:
    text = _render(smollm2_template, [{"role": "system", "content": None}], add_generation_prompt=False)
    assert text == "<|im_start|>system\n<|im_end|>\n"


@pytest.mark.parametrize("template", [None, ""])
def test_missing_template(template: str | None) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _render(template, [{"role": "user", "content": "Hi"}])  # type: ignore[arg-type]


def test_template_that_does_not_compile() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _render("{% for m in messages %}{{ m.content }}", [{"role": "user", "content": "Hi"}])


def test_raise_exception_reaches_the_caller() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    )
    assert _render(template, [{"role": "user", "content": "Hi"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        _render(template, [{"role": "assistant", "content": "Hi"}])


def test_render_failure_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="failed to render"):
        _render("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "Hi"}])


def test_message_without_role() -> None:
    with pytest.raises(ChatTemplateError, match="no role"):
        _render("{{ messages }}", [{"content": "Hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = messages.append({'role': 'x'}) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_blocks_unsafe_access(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        _render(template, [{"role": "user", "content": "Hi"}])


def test_trim_and_lstrip_blocks_and_extras() -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% generation %}{{ bos_token }}{{ eos_token }}{% endgeneration %}"
        "{{ tools | tojson }}{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    text = _render(template, [{"role": "user", "content": "é"}], tools=[{"name": "ü"}])
    assert text == '[é]\n<|im_start|><|im_end|>[{"name": "ü"}]0'


def test_load_template_files(tmp_path: pathlib.Path, smollm2_template: str) -> None:
    jinja = tmp_path / "chat.jinja"
    jinja.write_text(smollm2_template, encoding="utf-8")
    assert load_template(jinja) == smollm2_template
    config = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert load_template(config) == "y"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_template(broken)
    with pytest.raises(ChatTemplateError, match="cannot read"):
        load_template(tmp_path / "missing.jinja")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ChatTemplateError, match="empty"):
        load_template(empty)
