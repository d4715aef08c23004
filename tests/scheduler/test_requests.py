"""StopMatcher: text is released only once no stop string can match across it; and the code
completion stops (GenerationRequest.min_indent, newline_limit_s) on a request's sent text."""

from __future__ import annotations

from scheduler.requests import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        out.append(text)
        if matched:
            return out, True
    return out, False


def test_no_stops_passes_through():
    assert feed_all(StopMatcher(()), ["ab", "c"]) == (["ab", "c"], False)
    assert feed_all(StopMatcher(("",)), ["ab"]) == (["ab"], False)


def test_match_inside_one_piece():
    assert feed_all(StopMatcher(("END",)), ["abENDcd"]) == (["ab"], True)


def test_match_across_pieces_is_held_back():
    assert feed_all(StopMatcher(("END",)), ["ab", "E", "N", "Dxx"]) == (["ab", "", "", ""], True)


def test_false_start_is_released():
    matcher = StopMatcher(("END",))
    assert feed_all(matcher, ["abE", "N", "o"]) == (["ab", "", "ENo"], False)


def test_overlapping_prefixes():
    # "aab" must still match after "aa" was held back as a possible start.
    assert feed_all(StopMatcher(("aab",)), ["a", "a", "a", "b"]) == (["", "", "a", ""], True)


def test_earliest_of_several_stops():
    assert feed_all(StopMatcher(("xyz", "yz!", "q")), ["wxy", "z!"]) == (["w", ""], True)


def test_release_returns_held_text():
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.release() == "ST"
    assert matcher.release() == ""


def _state(stop: tuple[str, ...] = (), **fields):
    """A request's state over the byte tokenizer (token b is byte b), with `fields` of its request."""
    from scheduler.requests import RequestState
    from scheduler.types import GenerationRequest
    from tests.scheduler.conftest import EOS, ByteDetokenizer, ByteTokenizer

    request = GenerationRequest("r", (1, 2), 64, stop=stop, **fields)
    return RequestState(request, None, 0, detokenizer=ByteDetokenizer(ByteTokenizer()), stop_ids=frozenset({EOS}),
                        max_context=256, deadline=float("inf"), submitted_at=0.0)


def _feed(state, text: str, times: list[float] | None = None) -> tuple[str, str | None, int]:
    """Each byte of `text` as a token (at `times`, else 0): (text sent, finish reason, tokens taken)."""
    import numpy as np

    sent, none = [], np.zeros((0,), np.int32)
    for i, b in enumerate(text.encode()):
        event = state.accept(b, -0.5, none, none.astype(np.float32), times[i] if times else 0.0)
        sent.append(event.text)
        if event.finish_reason is not None:
            return "".join(sent), event.finish_reason, i + 1
    return "".join(sent), None, len(text.encode())


def test_a_line_indented_less_than_min_indent_ends_the_output_before_its_text():
    """llama-server's n_indent: the first line is free; a later one whose first character other
    than a space or tab (each counts one) comes after fewer than min_indent of them ends the
    output before that character ("length"), a blank line's newline too."""
    assert _feed(_state(min_indent=4), "if x:\n    y = 1\n    \t\n\t\t\t\tz\n  w = 2\nmore") == (
        "if x:\n    y = 1\n    \t\n\t\t\t\tz\n  ", "length", 31)
    assert _feed(_state(min_indent=2), "a\n\tb") == ("a\n\t", "length", 4)
    assert _feed(_state(min_indent=4), "a\n    b\n        c") == ("a\n    b\n        c", None, 17)
    assert _feed(_state(min_indent=1), "a\n b\n\n c") == ("a\n b\n", "length", 6)  # the blank line
    assert _feed(_state(min_indent=1), "a\r\n b\r\n c") == ("a\r\n b\r\n c", None, 9)
    assert _feed(_state(), "a\nb") == ("a\nb", None, 3)  # min_indent 0: off
    # text held back for a stop string ("S") is checked once sent, and cut with its line
    assert _feed(_state(("ST",), min_indent=2), "a\n  S\nSx") == ("a\n  S\n", "length", 8)


def test_a_newline_after_the_time_limit_ends_the_output():
    """llama-server's t_max_predict_ms: a token whose text holds a newline and comes later than
    the limit after the first token ends the output after that text ("length"), with any text
    held back for a stop string (its lines checked as ever); other late tokens do not."""
    times = [0.0, 0.5, 0.9, 1.5, 1.6, 1.7]
    assert _feed(_state(newline_limit_s=1.0), "a\nbc\nd", times) == ("a\nbc\n", "length", 5)
    assert _feed(_state(newline_limit_s=1.0), "abcdef", times) == ("abcdef", None, 6)
    assert _feed(_state(newline_limit_s=2.0), "a\nbc\nd", times) == ("a\nbc\nd", None, 6)
    # "\n" held back as a possible "\nz" goes out with the "d" that follows it
    assert _feed(_state(("\nz",), newline_limit_s=1.0), "a\nbc\nd", times) == ("a\nbc\nd", "length", 6)
    # the text held back after it (a possible "ab") is sent too, and checked for its indentation
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 1.5, 1.6]
    assert _feed(_state(("\nq", "ab"), newline_limit_s=1.0), "x\n  y\nab", times) == ("x\n  y\na", "length", 7)
    assert _feed(_state(("\nq", "ab"), min_indent=2, newline_limit_s=1.0), "x\n  y\nab", times) == (
        "x\n  y\n", "length", 7)
