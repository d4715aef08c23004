"""model/tokenizer.py against llama.cpp's token ids (fixtures recorded by
tests/fixtures/record_tokenizer.py), plus round trips and incremental detokenization.

SmolLM2 (byte-level BPE) is built from the default model's GGUF. Gemma 3 (SentencePiece, 262k
vocab) is not on CI: its tokenizer is built from the vocab extract in its fixture; when
/work/models/gemma3.gguf exists the full file is checked too.
"""

from __future__ import annotations

import json
import pathlib
import random
import time
from typing import Any

import pytest

from model.gguf_file import GGUFFile
from model.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNUSED,
    IncrementalDetokenizer,
    Tokenizer,
)

FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures"
GEMMA3_PATH = pathlib.Path("/work/models/gemma3.gguf")


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"tokenizer_{name}.json").read_text(encoding="utf-8"))


SMOLLM2 = _load("smollm2")
GEMMA3 = _load("gemma3")


def _case_id(case: dict[str, Any]) -> str:
    return repr(case["text"][:24])


def _from_extract(extract: dict[str, Any]) -> Tokenizer:
    """The Gemma tokenizer from the fixture's vocab extract; ids not in it become unused
    placeholders, which no text can reach."""
    size = extract["vocab_size"]
    tokens = [f"<extract-gap-{i}>" for i in range(size)]
    scores = [0.0] * size
    types = [TOKEN_TYPE_UNUSED] * size
    for i, text, score, kind in zip(extract["ids"], extract["tokens"], extract["scores"], extract["token_type"]):
        tokens[i], scores[i], types[i] = text, score, kind
    meta = dict(extract["metadata"])
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.scores"] = scores
    meta["tokenizer.ggml.token_type"] = types
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path).metadata)


@pytest.fixture(scope="session")
def gemma3() -> Tokenizer:
    return _from_extract(GEMMA3["vocab_extract"])


@pytest.fixture(scope="session")
def gemma3_full() -> Tokenizer:
    if not GEMMA3_PATH.exists():
        pytest.skip(f"{GEMMA3_PATH} not present (the fixture's vocab extract covers CI)")
    return Tokenizer.from_gguf_metadata(GGUFFile(GEMMA3_PATH).metadata)


# ---- ids equal llama.cpp's ------------------------------------------------------------


@pytest.mark.parametrize("case", SMOLLM2["cases"], ids=_case_id)
def test_smollm2_ids_match_llama_cpp(smollm2: Tokenizer, case: dict[str, Any]) -> None:
    assert smollm2.encode(case["text"]) == case["ids"]
    assert smollm2.encode(case["text"], parse_special=True) == case["ids_special"]


@pytest.mark.parametrize("case", GEMMA3["cases"], ids=_case_id)
def test_gemma3_ids_match_llama_cpp(gemma3: Tokenizer, case: dict[str, Any]) -> None:
    assert gemma3.encode(case["text"]) == case["ids"]
    assert gemma3.encode(case["text"], parse_special=True) == case["ids_special"]


def test_gemma3_full_file_matches_llama_cpp(gemma3_full: Tokenizer) -> None:
    for case in GEMMA3["cases"]:
        assert gemma3_full.encode(case["text"]) == case["ids"], case["text"]
        assert gemma3_full.encode(case["text"], parse_special=True) == case["ids_special"], case["text"]
    extract = GEMMA3["vocab_extract"]
    assert gemma3_full.vocab_size == extract["vocab_size"]
    for i, text in zip(extract["ids"], extract["tokens"]):
        assert gemma3_full.token_to_piece(i) == text


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_special_ids_match_llama_cpp(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    fixture = SMOLLM2 if name == "smollm2" else GEMMA3
    assert tok.bos_id == fixture["bos_id"]
    assert tok.eos_id == fixture["eos_id"]
    assert tok.add_bos == fixture["add_bos"]
    assert tok.eog_ids == frozenset(fixture["eog_ids"])


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_pieces_match_llama_cpp(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    fixture = SMOLLM2 if name == "smollm2" else GEMMA3
    for token_id, (plain_hex, special_hex) in fixture["pieces"].items():
        token_id = int(token_id)
        assert tok.piece_bytes(token_id, skip_special=True) == bytes.fromhex(plain_hex), token_id
        assert tok.piece_bytes(token_id, skip_special=False) == bytes.fromhex(special_hex), token_id
        assert tok.token_bytes(token_id) == bytes.fromhex(special_hex), token_id
        assert tok.is_special(token_id) == (plain_hex != special_hex), token_id


def test_known_eog_tokens(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert {smollm2.token_to_piece(i) for i in smollm2.eog_ids} >= {"<|im_end|>", "<|endoftext|>"}
    assert {gemma3.token_to_piece(i) for i in gemma3.eog_ids} >= {"<eos>", "<end_of_turn>"}


# ---- API behaviour --------------------------------------------------------------------


def test_parse_special_only_when_asked(smollm2: Tokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>"
    start, end = smollm2.token_to_id("<|im_start|>"), smollm2.token_to_id("<|im_end|>")
    plain = smollm2.encode(text)
    assert start not in plain and end not in plain
    parsed = smollm2.encode(text, parse_special=True)
    assert parsed[0] == start and parsed[-1] == end
    assert smollm2.decode(parsed) == "user\nHi"
    assert smollm2.decode(parsed, skip_special=False) == text


def test_add_bos_override(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert smollm2.encode("Hi")[0] != smollm2.bos_id
    assert smollm2.encode("Hi", add_bos=True)[0] == smollm2.bos_id
    assert gemma3.encode("Hi")[0] == gemma3.bos_id
    assert gemma3.encode("Hi", add_bos=False)[0] != gemma3.bos_id
    assert gemma3.encode("") == [gemma3.bos_id]
    assert smollm2.encode("") == []


def test_properties(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152 and gemma3.vocab_size == 262144
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert gemma3.chat_template is None
    assert smollm2.token_to_piece(smollm2.encode(" world")[0]) == "Ġworld"
    assert gemma3.token_to_piece(gemma3.encode(" world", add_bos=False)[0]) == "▁world"
    assert smollm2.is_special(smollm2.token_to_id("<|im_end|>"))
    assert not smollm2.is_special(smollm2.encode("Hi")[0])
    # gemma's newline token is user-defined: split out of the text and always rendered
    newline = gemma3.token_to_id("\n")
    assert not gemma3.is_special(newline) and newline in gemma3.encode("a\nb")


def test_token_bytes(smollm2: Tokenizer, gemma3: Tokenizer) -> None:
    assert smollm2.token_bytes(smollm2.token_to_id("Ġworld")) == b" world"
    assert smollm2.token_bytes(smollm2.token_to_id("Ċ")) == b"\n"
    assert gemma3.token_bytes(gemma3.token_to_id("▁world")) == b" world"
    assert gemma3.token_bytes(gemma3.token_to_id("<0xE2>")) == b"\xe2"
    assert gemma3.token_bytes(gemma3.bos_id) == b"<bos>"


def test_out_of_range_id(smollm2: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2.decode([smollm2.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2.token_bytes(-1)


def test_lone_surrogates_become_replacement_characters(smollm2: Tokenizer) -> None:
    assert smollm2.decode(smollm2.encode("a\ud800b")) == "a\ufffd\ufffd\ufffdb"


# ---- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_round_trip(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    fixture = SMOLLM2 if name == "smollm2" else GEMMA3
    for case in fixture["cases"]:
        text = case["text"]
        assert tok.decode(tok.encode(text)) == text
        ids = tok.encode(text, add_bos=False, parse_special=True)
        assert tok.decode(ids, skip_special=False) == text


def test_round_trip_random_text(smollm2: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = "ab Z09 \n\t'.,!éß你好🎉👨‍👩‍👧\u00a0\u200d<|>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert smollm2.decode(smollm2.encode(text)) == text


# ---- incremental detokenization --------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    return [detok.add(i) for i in ids] + [detok.flush()]


def _random_ids(tok: Tokenizer, rng: random.Random, pool: list[int]) -> list[int]:
    return [rng.choice(pool) for _ in range(rng.randint(0, 40))]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_incremental_matches_decode_on_random_ids(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    fixture = SMOLLM2 if name == "smollm2" else GEMMA3
    rng = random.Random(1)
    # ids the fixtures use (CJK, emoji pieces, byte tokens, control tokens) and random ones
    pool = sorted(int(i) for i in fixture["pieces"])
    if name == "smollm2":
        pool += rng.sample(range(tok.vocab_size), 500)
    for _ in range(500):
        ids = _random_ids(tok, rng, pool)
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_incremental_on_split_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    fixture = SMOLLM2 if name == "smollm2" else GEMMA3
    for case in fixture["cases"]:
        ids = case["ids"]
        detok = IncrementalDetokenizer(tok)
        so_far = ""
        for i in ids:
            # after every token, what has come out is a prefix of the text: no broken character
            so_far += detok.add(i)
            assert case["text"].startswith(so_far), case["text"]
        so_far += detok.flush()
        assert so_far == tok.decode(ids) == case["text"]


def test_incremental_holds_back_incomplete_utf8(gemma3: Tokenizer) -> None:
    euro = [gemma3.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(gemma3)
    assert [detok.add(i) for i in euro] == ["", "", "€"]
    detok = IncrementalDetokenizer(gemma3)
    assert detok.add(euro[0]) == "" and detok.add(euro[1]) == ""
    assert detok.flush() == "\ufffd" == gemma3.decode(euro[:2])
    # an invalid continuation: given up at once, as decode does
    ids = [euro[0], gemma3.token_to_id("<0x41>")]
    assert "".join(_stream(gemma3, ids)) == gemma3.decode(ids) == "\ufffdA"


def test_incremental_byte_level_emoji(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🎉")
    assert len(ids) > 1  # byte-level pieces of one character
    pieces = _stream(smollm2, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🎉"


# ---- add_space_prefix (a SentencePiece vocab built here) -------------------------------


def _tiny_spm(add_space_prefix: bool = True) -> Tokenizer:
    # merges: ▁h (best), ll, ▁he, ▁hell, ▁hello; "he" loses to "▁h"
    pieces = ["<unk>", "<s>", "</s>", "▁h", "ll", "▁he", "▁hell", "▁hello", "he"]
    pieces += ["▁", "h", "e", "l", "o", "w", "▁w"]
    types = [2, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_NORMAL] * (len(pieces) - 3)
    scores = [0.0, 0.0, 0.0] + [-float(i) for i in range(len(pieces) - 3)]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [TOKEN_TYPE_BYTE] * 256
    scores += [0.0] * 256
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
    return Tokenizer.from_gguf_metadata(meta)


def test_spm_space_prefix_is_added_and_removed_again() -> None:
    tok = _tiny_spm()
    hello = tok.token_to_id("▁hello")
    assert tok.add_bos and tok.add_space_prefix
    assert tok.encode("hello") == [1, hello]
    assert tok.decode([1, hello]) == "hello"
    assert "".join(_stream(tok, [1, hello])) == "hello"
    # without BOS the ids are a continuation (generated text): the space stays
    assert tok.decode([hello]) == " hello"
    assert "".join(_stream(tok, [hello])) == " hello"
    # BOS rendered: the space stays, as in llama.cpp and Hugging Face
    assert tok.decode([1, hello], skip_special=False) == "<s> hello"
    # a space prefix again after a special token
    assert tok.encode("hello</s>hello", parse_special=True) == [1, hello, 2, hello]
    # unknown characters fall back to byte tokens
    e_acute = [tok.token_to_id(f"<0x{b:02X}>") for b in "é".encode()]
    assert tok.encode("hé", add_bos=False) == [tok.token_to_id("▁h")] + e_acute
    for text in ["hello", " hello", "  hé w", "", "ollehw"]:
        assert tok.decode(tok.encode(text)) == text


def test_spm_space_prefix_random_streams() -> None:
    tok = _tiny_spm()
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            ids = [1] + ids
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids


# ---- BPE pre-tokenizers and errors -----------------------------------------------------


def _tiny_bpe(pre: str, **extra: Any) -> Tokenizer:
    from model.tokenizer import _BYTE_TO_CHAR

    pieces = [_BYTE_TO_CHAR[b] for b in range(256)] + ["123", "456", "<|begin_of_text|>"]
    types = [TOKEN_TYPE_NORMAL] * (len(pieces) - 1) + [TOKEN_TYPE_CONTROL]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [],
        **{f"tokenizer.ggml.{k}": v for k, v in extra.items()},
    })


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "gpt2", "gpt-2", "default"])
def test_pre_tokenizers_build_and_round_trip(pre: str) -> None:
    tok = _tiny_bpe(pre, add_bos_token=False)
    text = "I'M 1234567 x\n\n  y 你好 🎉"
    assert tok.decode(tok.encode(text)) == text


def test_llama3_ignore_merges_and_digit_groups() -> None:
    # llama-bpe: digits in groups of three; a whole word found in the vocab is taken as is
    tok = _tiny_bpe("llama-bpe", bos_token_id=258)
    assert tok.add_bos  # llama.cpp's default for llama-bpe when the file does not say
    assert tok.encode("1234567") == [258, 256, 257, ord("7")]
    assert _tiny_bpe("llama-bpe", add_bos_token=False).encode("1234567") == [256, 257, ord("7")]


def test_unknown_pre_tokenizer_is_an_error() -> None:
    with pytest.raises(ValueError, match="'no-such-pre'"):
        _tiny_bpe("no-such-pre")


def test_unknown_tokenizer_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ---- speed -----------------------------------------------------------------------------


def test_encode_speed(gemma3: Tokenizer, smollm2: Tokenizer) -> None:
    text = GEMMA3["cases"][-1]["text"]
    assert len(text) >= 3000
    for tok in (gemma3, smollm2):
        start = time.perf_counter()
        tok.encode(text, parse_special=True)
        assert time.perf_counter() - start < 1.0


def test_add_eos_token_is_read_where_the_file_has_an_eos() -> None:
    """tokenizer.ggml.add_eos_token (an embedding model's, say Qwen3-Embedding's): the
    embeddings endpoint appends EOS to its text inputs; absent, or without an EOS id, it is off."""
    assert _tiny_bpe("qwen2", eos_token_id=258, add_eos_token=True).add_eos
    assert not _tiny_bpe("qwen2", eos_token_id=258).add_eos
    assert not _tiny_bpe("qwen2", add_eos_token=True).add_eos


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_tokens_containing_holds_every_token_with_the_text(name: str, request: pytest.FixtureRequest) -> None:
    """DRY's breakers: the tokens whose bytes contain a text, the same as testing each token,
    with a text split over two tokens matching neither."""
    tok: Tokenizer = request.getfixturevalue(name)
    texts = ("\n", ":", '"', "*")
    got = tok.tokens_containing(texts)
    want = tuple(i for i in range(tok.vocab_size) if any(t.encode() in tok.token_bytes(i) for t in texts))
    assert got == want and len(got) > 50
    assert tok.tokens_containing(()) == () and tok.tokens_containing([""]) == ()
    # a text that spans the joint of two neighbouring tokens' bytes matches only where a token holds it
    for i in range(1, tok.vocab_size - 1):
        a, b = tok.token_bytes(i), tok.token_bytes(i + 1)
        text = (a[-2:] + b[:2]).decode("ascii", "ignore")
        if len(a) >= 2 and len(b) >= 2 and len(text) == 4:
            break
    assert tok.tokens_containing([text]) == tuple(j for j in range(tok.vocab_size) if text.encode() in tok.token_bytes(j))
    assert i not in tok.tokens_containing([text]) or text.encode() in tok.token_bytes(i)


def test_fim_tokens_are_found_by_text_or_named_by_the_file(smollm2: Tokenizer) -> None:
    """/infill's tokens: Qwen2.5-Coder's texts found in the vocabulary (and made control, so that
    decoding skips them), an id the file names winning over the text; SmolLM2 has a repository
    name's token alone (no prefix, suffix or middle: no /infill)."""
    from model.tokenizer import _BYTE_TO_CHAR

    fim = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>", "<|fim_pad|>"]
    pieces = [_BYTE_TO_CHAR[b] for b in range(256)] + fim + ["<PRE>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.token_type": [TOKEN_TYPE_NORMAL] * len(pieces), "tokenizer.ggml.merges": []}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.fim_ids == {"fim_pre": 256, "fim_suf": 257, "fim_mid": 258, "fim_rep": 259, "fim_sep": 260,
                           "fim_pad": 261}
    assert tok.decode([ord("a"), 256, 257, 258]) == "a" and tok.is_special(260)
    assert {259, 260, 261} <= tok.eog_ids  # llama.cpp's: a repo, file or pad token ends a generation
    named = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.fim_pre_token_id": 262})
    assert named.fim_ids["fim_pre"] == 262 and named.fim_ids["fim_suf"] == 257
    assert smollm2.fim_ids == {"fim_rep": smollm2.token_to_id("<reponame>")}
