"""StopMatcher: text is released only once no stop string can match across it."""

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
