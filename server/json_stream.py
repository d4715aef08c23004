"""A JSON object read as its text streams, one member's value written back as it arrives:
what a streamed tool call's arguments need (server/tool_calls.py).

`ObjectReader` takes the text of one JSON object in pieces of any size and checks it as
`json.loads` would (strict: no control characters in strings; NaN and Infinity refused, as
`json.dumps(..., allow_nan=False)` refuses them). It hands back the string members of the
top-level object as they complete (a call's `name`) and, once a chosen member's value opens
as an object, that value's text as `json.dumps(json.loads(text), ensure_ascii=False)` writes
it, piece by piece: ", " and ": " between items, strings escaped as `json.dumps` escapes them
(escapes the model wrote, `\\u00e9` or a surrogate pair, decoded first), numbers as Python
reads and writes them (`1E2` is `100.0`). So a client that joins the pieces has the text a
whole parse gives, except where the object repeats a key: a whole parse keeps the last value
in the first one's place, while the pieces keep both, as written, and of a repeated top-level
member (`members`, the echoed one) the reader takes the first, which it met first.
"""

from __future__ import annotations

import json
import re

WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_VALUE_STARTS = frozenset('{["-0123456789tfn')


# How `json.dumps(..., ensure_ascii=False)` writes a string's characters: these escaped, every
# other one (non-ASCII, a lone surrogate, DEL) as it is.
_WRITTEN = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f",
            **{chr(i): f"\\u{i:04x}" for i in range(0x20) if chr(i) not in "\n\r\t\b\f"}}


class ObjectReader:
    """One JSON object's text in (`feed`, any pieces), checked as it comes.

    `members`: the top-level object's string members read so far (key -> decoded value).
    `feed` returns the text of `echo_key`'s value written as `json.dumps` would write it, from
    where the value opens as an object; `echoing` says whether that has begun (`echo_open`:
    whether it was an object, decided once its first character arrived). `done`: the object
    has closed; `error`: the text stopped being JSON (or went past the object) at `error_at`
    (characters fed before the first bad one); nothing is read after it."""

    def __init__(self, echo_key: tuple[str, ...]) -> None:
        self.echo_key = echo_key
        self.members: dict[str, str] = {}
        self.echoing = False
        self.echo_open: bool | None = None  # None: the member not reached yet
        self.done = False
        self.error = False
        self.error_at = 0
        self._fed = 0
        self._stack: list[str] = []  # "{" or "[" per open container
        self._expect = "start"  # start, value, key_or_close, key, colon, comma_or_close, value_or_close, end
        self._key: str | None = None  # the top-level member whose value is being read
        self._echo_depth = 0  # the stack depth of the echoed object (0: not echoing)
        self._first = True  # the container just opened has no item yet
        self._token = ""  # a number or literal read so far
        self._string: list[str] | None = None  # a string's characters read so far
        self._is_key = False
        self._escape: str | None = None  # an escape read so far (after the backslash)
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._out: list[str] = []
        self._pos = 0  # the character being read
        self._fail_at: int | None = None  # where the text a failing read had not written began
        # where each pending piece began: a token, an escape, a high surrogate, a comma
        self._token_at = self._escape_at = self._high_at = self._comma_at = 0

    @property
    def fed(self) -> int:
        """Characters fed so far."""
        return self._fed

    @property
    def echo_done(self) -> bool:
        """The echoed object has closed."""
        return self.echoing and not self._echo_depth

    def feed(self, text: str) -> str:
        for i, c in enumerate(text):
            if self.error:
                break
            self._pos, self._fail_at = self._fed + i, None
            if not self._char(c):
                # from the first character not written: a number, literal or escape that broke
                # is text that went nowhere yet
                self.error, self.error_at = True, self._pos if self._fail_at is None else self._fail_at
        self._fed += len(text)
        out, self._out = "".join(self._out), []
        return out

    def end(self) -> str:
        """The text has ended: a number or literal it ended in is read (it may have been the last
        of a cut-short object), and `feed`'s rest of the echo returned."""
        if self._token and not self.error and not self._end_token():
            self.error, self.error_at = True, self._token_at
        out, self._out = "".join(self._out), []
        return out

    # ---- the machine --------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        if self._echo_depth and len(self._stack) >= self._echo_depth:
            self._out.append(text)

    def _char(self, c: str) -> bool:
        if self._string is not None:
            return self._string_char(c)
        if self._token:
            if c in _NUMBER_CHARS or (self._token[0] in "tfn" and c.isalpha()):
                self._token += c
                return True
            if not self._end_token():
                return False
        if c in WHITESPACE:
            return True
        e = self._expect
        if e == "end":
            return False
        if e == "start":
            if c != "{":
                return False
            self._stack.append("{")
            self._expect, self._first = "key_or_close", True
            return True
        if e in ("key_or_close", "key"):
            if c == "}" and e == "key_or_close":
                return self._close("{")
            if c != '"':
                self._fail_at = None if self._first else self._comma_at  # the comma is not written yet
                return False
            if not self._first:
                self._write(", ")
            self._open_string(is_key=True)
            return True
        if e == "colon":
            if c != ":":
                return False
            self._write(": ")
            self._expect = "value"
            return True
        if e == "comma_or_close":
            if c == ",":
                self._first, self._comma_at = False, self._pos
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return True
            return c in "}]" and self._close(c.replace("}", "{").replace("]", "["))
        if e == "value_or_close" and c == "]":
            return self._close("[")
        return self._value_start(c)

    def _value_start(self, c: str) -> bool:
        if c not in _VALUE_STARTS:
            if self._stack[-1] == "[" and not self._first:
                self._fail_at = self._comma_at  # the comma is not written yet
            return False
        if self._stack[-1] == "[" and not self._first:
            self._write(", ")
        if len(self._stack) == 1 and self._key is not None and self._key in self.echo_key and self.echo_open is None:
            self.echo_open = c == "{"
            if self.echo_open:
                self._echo_depth, self.echoing = 2, True
        if c in "{[":
            self._stack.append(c)
            self._write(c)
            self._expect, self._first = ("key_or_close" if c == "{" else "value_or_close"), True
            return True
        if c == '"':
            self._open_string(is_key=False)
            return True
        self._token, self._token_at = c, self._pos
        return True

    def _after_value(self) -> None:
        self._first = False
        self._expect = "comma_or_close"

    def _close(self, opener: str) -> bool:
        if self._stack[-1] != opener:
            return False
        self._write("}" if opener == "{" else "]")
        self._stack.pop()
        if len(self._stack) + 1 == self._echo_depth:
            self._echo_depth = 0
        if not self._stack:
            self.done, self._expect = True, "end"
            return True
        if len(self._stack) == 1:
            self._key = None
        self._after_value()
        return True

    def _end_token(self) -> bool:
        token, self._token = self._token, ""
        self._fail_at = self._token_at
        if token[0] in "tfn":
            if token not in _LITERALS:
                return False
            text = token
        else:
            match = _NUMBER.fullmatch(token)
            if match is None:
                return False
            try:
                value = float(token) if match.group(1) or match.group(2) else int(token)
                text = json.dumps(value, allow_nan=False)
            except ValueError:  # beyond float's range, or an int past Python's digit limit
                return False
        self._fail_at = None
        self._write(text)
        self._member_done()
        return True

    def _member_done(self) -> None:
        if len(self._stack) == 1:
            self._key = None
        self._after_value()

    def _open_string(self, is_key: bool) -> None:
        self._string, self._is_key = [], is_key
        self._write('"')

    def _append(self, c: str) -> None:
        """One character of the string read (decoded), kept at the top level (a key, or a member
        read into `members`) and written where echoed."""
        if len(self._stack) == 1:
            self._string.append(c)  # type: ignore[union-attr]
        self._write(_WRITTEN.get(c, c))

    def _string_char(self, c: str) -> bool:
        if self._escape is not None:
            return self._escape_char(c)
        if self._high is not None and c != "\\":  # a lone high surrogate, which json keeps as it is
            self._flush_high()
        if c == "\\":
            self._escape, self._escape_at = "", self._pos
            return True
        if c == '"':
            return self._string_done()
        if c < " ":
            return False
        self._append(c)
        return True

    def _escape_char(self, c: str) -> bool:
        assert self._escape is not None
        self._fail_at = self._escape_at if self._high is None else self._high_at
        if self._escape == "":
            if c == "u":
                self._escape = "u"
                return True
            if c not in _ESCAPES:
                return False
            self._flush_high()
            self._append(_ESCAPES[c])
            self._escape = None
            return True
        if c not in _HEX:
            return False
        self._escape += c
        if len(self._escape) < 5:
            return True
        unit, self._escape = int(self._escape[1:], 16), None
        if self._high is not None and 0xDC00 <= unit <= 0xDFFF:
            self._append(chr(0x10000 + ((self._high - 0xD800) << 10) + unit - 0xDC00))
            self._high = None
        elif 0xD800 <= unit <= 0xDBFF:
            self._flush_high()
            self._high, self._high_at = unit, self._escape_at
        else:
            self._flush_high()
            self._append(chr(unit))
        return True

    def _flush_high(self) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._append(chr(high))

    def _string_done(self) -> bool:
        self._flush_high()
        text = "".join(self._string or ())
        self._string = None
        self._write('"')
        if self._is_key:
            if len(self._stack) == 1:
                self._key = text
            self._expect = "colon"
            return True
        if len(self._stack) == 1 and self._key is not None:
            self.members.setdefault(self._key, text)  # a repeated member: the first, as the stream saw it
        self._member_done()
        return True
