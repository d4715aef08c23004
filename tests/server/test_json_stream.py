"""server/json_stream.py's ObjectReader: random JSON objects, written in varied spellings and fed
in random pieces, give back the chosen member's value exactly as `json.dumps(json.loads(...),
ensure_ascii=False)` writes it; text that `json.loads` (or `json.dumps(..., allow_nan=False)`)
refuses is an error at its first bad character."""

from __future__ import annotations

import json
import random

import pytest

from server.json_stream import ObjectReader

# characters that need care: quotes, backslashes, controls, non-ASCII, an astral one, a lone
# surrogate, DEL, U+2028
CHARS = ["a", "é", '"', "\\", "\n", "\x01", "\x1f", "😀", "\ud83d", "/", " ", "\u2028", "\x7f", "z"]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-10**20, 10**20)
    if kind == 1:
        return rng.uniform(-1e10, 1e10) * rng.choice([1, 1e-30, 1e30])
    if kind == 2:
        return _string(rng)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice([0, -0.0, 0.5, []])
    if kind in (5, 6):
        return {_string(rng) + str(i): _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(0, 6)))


def _spelled(rng: random.Random, v) -> str:
    """v as some JSON text a model might write: other whitespace, escapes or number forms."""
    if isinstance(v, dict):
        ws = rng.choice(["", " ", "\n  ", "\t", "\r\n"])
        items = (f"{_spelled(rng, k)}{ws}:{ws}{_spelled(rng, x)}" for k, x in v.items())
        return "{" + ws + ("," + ws).join(items) + ws + "}"
    if isinstance(v, list):
        return "[" + rng.choice([",", ", ", " ,\n"]).join(_spelled(rng, x) for x in v) + "]"
    if isinstance(v, str):
        text = json.dumps(v, ensure_ascii=rng.random() < 0.5)
        return text.replace("/", "\\/") if rng.random() < 0.3 else text
    if isinstance(v, float):
        return rng.choice([repr(v), f"{v:.17e}", f"{v:.17E}"])
    return json.dumps(v)


def _read(text: str, rng: random.Random, key: tuple[str, ...] = ("arguments",)) -> tuple[ObjectReader, str]:
    reader, out, i = ObjectReader(key), [], 0
    while i < len(text):
        j = i + rng.randint(1, 8)
        out.append(reader.feed(text[i:j]))
        i = j
    return reader, "".join(out) + reader.end()


def test_echo_is_what_a_whole_parse_writes() -> None:
    rng = random.Random(1234)
    for _ in range(1500):
        name, args = _string(rng) or "f", {_string(rng) + str(i): _value(rng) for i in range(rng.randint(0, 4))}
        text = rng.choice([" ", "\n", ""]) + "{" + f'"name": {_spelled(rng, name)}, "arguments": {_spelled(rng, args)}' \
            + rng.choice(["", ', "id": [1, {"a": "b"}]']) + "}" + rng.choice(["", "\n "])
        reader, echoed = _read(text, rng)
        assert not reader.error and reader.done and reader.echo_done, text
        assert echoed == json.dumps(json.loads(text)["arguments"], ensure_ascii=False), text
        assert reader.members["name"] == name


@pytest.mark.parametrize("text", [
    '{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e400}', '{"a": "x\x01"}', '{"a": [1,]}',
    '{"a": 01}', '{"a": tru}', '{"a": 1} x', '{"a" 1}', '{"a": "\\x"}', '{,}', '{"a": -}', '{"a": 1.}',
    '{"a": "\\u12"}', '{"a": 1,}', '{"a": {"b": 1]}', "{'a': 1}",
])
def test_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        json.dumps(json.loads(text), allow_nan=False)
    reader = ObjectReader(("a",))
    reader.feed(text)
    reader.end()
    assert reader.error and 0 <= reader.error_at < len(text)


def test_echo_starts_at_an_object_only() -> None:
    reader = ObjectReader(("arguments",))
    assert reader.feed('{"name": "f", "arguments": "{}"') == ""
    assert reader.echo_open is False and not reader.echoing
    reader = ObjectReader(("arguments",))
    assert reader.feed('{"name": "f", "arguments": ') == "" and reader.echo_open is None
    assert reader.feed("{ ") == "{" and reader.echoing and not reader.echo_done
    assert reader.feed('"x":1 }') == '"x": 1}' and reader.echo_done and not reader.done
    assert reader.feed("}") == "" and reader.done
    reader = ObjectReader(("arguments",))
    reader.feed("[1]")  # JSON, but no object
    assert reader.error and reader.error_at == 0


def test_a_number_at_the_end_is_read_by_end() -> None:
    reader = ObjectReader(("a",))
    assert reader.feed('{"a": {"b": 12') == '{"b": '
    assert reader.end() == "12" and not reader.error and not reader.done


@pytest.mark.parametrize("text, written, rest", [
    ('{"a": {"b": tru}}', '{"b": ', 'tru}}'), ('{"a": {"b": [1, +2]}}', '{"b": [1', ', +2]}}'),
    ('{"a": {"b": "x\\q"}}', '{"b": "x', '\\q"}}'), ('{"a": {"b": "\\ud83d\\u12G"}}', '{"b": "', '\\ud83d\\u12G"}}'),
    ('{"a": {"b": 1e400}}', '{"b": ', '1e400}}'), ('{"a": {"b": -Infinity}}', '{"b": ', '-Infinity}}'),
    ('{"a": {"b": 1} x}', '{"b": 1}', 'x}'), ('{"a": {"b": 1, c}}', '{"b": 1', ', c}}'),
])
def test_the_error_is_where_the_text_not_written_began(text: str, written: str, rest: str) -> None:
    """What was echoed, then the text from `error_at` on: a number, literal or escape that broke
    is not lost (nor written twice), however the text was cut."""
    for size in (1, 3, len(text)):
        reader, echoed = ObjectReader(("a",)), ""
        for i in range(0, len(text), size):
            echoed += reader.feed(text[i:i + size])
        echoed += reader.end()
        assert reader.error and (echoed, text[reader.error_at:]) == (written, rest), size
