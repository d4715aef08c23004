"""Fill-in-the-middle (FIM) prompts: llama-server's `POST /infill`, and `suffix` on `/v1/completions`.

A code editor (llama.vim, llama.vscode, Continue, Tabby) sends the text before the cursor
(`input_prefix`), the text after it (`input_suffix`), optionally the start of the middle
(`prompt`: text or token ids) and other files as context (`input_extra`: `[{"filename", "text"}]`,
the most relevant last). The prompt is laid out in the model's FIM tokens (`Tokenizer.fim_ids`)
as llama-server lays it out:

    [BOS] [extra] <FIM_PRE> prefix prompt <FIM_SUF> suffix <FIM_MID>

or, with `--spm-infill` (the order some models were trained in), `<FIM_SUF> suffix <FIM_PRE>
prefix prompt <FIM_MID>`. The extra context is, where the vocabulary has the tokens (Qwen2.5-Coder's
repository format), `<FIM_REP>myproject\\n`, then `<FIM_SEP>{filename}\\n{text}` per chunk and
`<FIM_SEP>filename\\n` for the edited file; else each chunk after a `--- snippet ---` line.
(llama-server puts the extra context before the BOS; here the BOS comes first, as in any prompt.)

What is kept of long inputs: as llama-server keeps it, of a window (here min(2,048, context / 2)
tokens) the prefix keeps its last three quarters at most, the suffix its first quarter less the
prompt and two; the extra context keeps its end (the chunks sent last) in what the context has
left beside the rest and the generation's reserve (`n_predict`, else a quarter window), where
llama-server keeps the context less the window and twice `n_predict`.

The rest of an `/infill` request is `/completion`'s (server/llama_api.py), as is its response.
A model without prefix, suffix and middle tokens answers 501 (llama-server's "not supported").
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from server.errors import ApiError, invalid
from server.llama_api import predict_field

FIM_WINDOW = 2048  # llama-server's default batch: the most tokens of prefix and suffix together
REPO_NAME = "myproject"  # llama-server's name for the repository of the extra files
FILE_NAME = "filename"  # and for the file being edited
SNIPPET = "\n\n--- snippet ---\n\n"  # a chunk's header where the vocabulary has no file separator
NEEDED = ("fim_pre", "fim_suf", "fim_mid")
_FIELDS = ("input_prefix", "input_suffix", "input_extra")


class FimTokenizer(Protocol):
    fim_ids: dict[str, int]
    bos_id: int | None
    add_bos: bool

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]: ...


def _encode(tokenizer: FimTokenizer, text: str, field: str | None) -> list[int]:
    try:
        return tokenizer.encode(text, False, False)
    except ValueError as e:  # e.g. a byte the vocabulary cannot represent
        raise invalid(f"cannot tokenize the {field or 'text'}: {e}", field) from None


def fim_prompt(tokenizer: FimTokenizer, prefix: str, suffix: str, *, start: Sequence[int] = (),
               extra: Sequence[tuple[str, str]] = (), max_context: int, reserve: int | None,
               spm: bool = False, fields: tuple[str, str] = ("input_prefix", "input_suffix")) -> list[int]:
    """The token ids of a FIM prompt (the module's layout): `start` the middle's first tokens,
    `extra` (filename, text) pairs, `reserve` the tokens kept for the generation (None: a
    quarter window), `fields` the prefix's and suffix's names in a 400. The caller checks that
    the model has the tokens (`missing`)."""
    fim = tokenizer.fim_ids

    def enc(text: str) -> list[int]:
        return _encode(tokenizer, text, "input_extra")

    window = max(4, min(FIM_WINDOW, max_context // 2))
    pre, suf = _encode(tokenizer, prefix, fields[0]), _encode(tokenizer, suffix, fields[1])
    pre = pre[len(pre) - min(len(pre), 3 * (window // 4)):]
    suf = suf[:max(0, window // 4 - (2 + len(start)))]
    head = [fim["fim_pre"], *pre, *start]
    tail = [fim["fim_suf"], *suf]
    core = (tail + head if spm else head + tail) + [fim["fim_mid"]]
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    context = [fim["fim_rep"], *enc(REPO_NAME + "\n")] if "fim_rep" in fim else []
    for filename, text in extra:
        context += [fim["fim_sep"], *enc(filename + "\n")] if "fim_sep" in fim else enc(SNIPPET)
        context += enc(text)
    if "fim_sep" in fim:
        context += [fim["fim_sep"], *enc(FILE_NAME + "\n")]
    reserve = window // 4 if reserve is None else reserve
    room = max(0, max_context - len(bos) - len(core) - max(reserve, 1))
    return bos + context[len(context) - min(len(context), room):] + core


def missing(tokenizer: FimTokenizer) -> list[str]:
    """The FIM tokens a prompt needs that the vocabulary lacks (none: the model can infill)."""
    fim = tokenizer.fim_ids
    return [name for name in NEEDED if name not in fim]


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string", name)
    return value


def _extra(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, list):
        raise invalid("'input_extra' must be an array of {\"filename\": string, \"text\": string} objects",
                      "input_extra")
    out = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                or not isinstance(chunk.get("filename", "tmp"), str):
            raise invalid(f"'input_extra[{i}]' must be an object whose 'text' and 'filename' are strings",
                          "input_extra")
        out.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
    return out


def _reserve(body: dict[str, Any]) -> int | None:
    """The generation's tokens as the request limits them (as /completion reads them): None
    where it does not (or -1: up to the context; a bad value is /completion's 400), else at
    least 0."""
    _, value = predict_field(body) or (None, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def to_completion_body(body: Any, tokenizer: FimTokenizer, max_context: int, spm: bool) -> dict[str, Any]:
    """An `/infill` request as the `/completion` request it is served as (its prompt the FIM
    prompt's token ids), or a 400 naming the field, or 501 for a model without FIM tokens."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    lacking = missing(tokenizer)
    if lacking:
        raise ApiError(501, f"infill is not supported by this model: its vocabulary has no {', '.join(lacking)} token",
                       type="not_supported_error")
    body = {k: v for k, v in body.items() if v is not None}
    start = body.get("prompt", "")
    if isinstance(start, str):
        start = _encode(tokenizer, start, "prompt") if start else []
    elif not (isinstance(start, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in start)):
        raise invalid("an infill's 'prompt' (the middle's start) must be a string or an array of token ids", "prompt")
    # (ids outside the vocabulary: the completion path's 400, as for any token-id prompt)
    ids = fim_prompt(tokenizer, _text(body, "input_prefix"), _text(body, "input_suffix"), start=start,
                     extra=_extra(body.get("input_extra", [])), max_context=max_context, reserve=_reserve(body),
                     spm=spm)
    return {**{k: v for k, v in body.items() if k not in _FIELDS}, "prompt": ids}


def completion_with_suffix(body: Any, tokenizer: FimTokenizer, max_context: int, spm: bool) -> Any:
    """A `/v1/completions` request with a `suffix` (OpenAI's insert mode) as one whose prompts are
    FIM prompts (prefix: the prompt; the generation's reserve: max_tokens); as it is without one."""
    if not isinstance(body, dict) or body.get("suffix") is None:
        return body
    suffix = body["suffix"]
    if not isinstance(suffix, str):
        raise invalid("'suffix' must be a string", "suffix")
    if not suffix:
        return {k: v for k, v in body.items() if k != "suffix"}
    if missing(tokenizer):
        raise invalid("'suffix' needs a model with fill-in-the-middle tokens (prefix, suffix, middle); this one "
                      "has none", "suffix")
    if body.get("echo"):
        raise invalid("'echo' cannot be used with 'suffix'", "echo")
    prompts = body.get("prompt")
    one = isinstance(prompts, str)
    if not one and not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise invalid("'suffix' needs a text prompt (a string or an array of strings)", "prompt")
    ids = [fim_prompt(tokenizer, p, suffix, max_context=max_context, reserve=_reserve(body), spm=spm,
                      fields=("prompt", "suffix")) for p in ([prompts] if one else prompts)]
    rest = {k: v for k, v in body.items() if k != "suffix"}
    return {**rest, "prompt": ids[0] if one else ids}
