"""bench.common.steady_gaps: the inter-token gaps inside the steady window, and what the long ones
cost the steady rate."""

import pytest

from bench.common import StreamRecord, steady_gaps, steady_tok_s


def _record(label, times):
    return StreamRecord(label, 0.0, [(t, 1) for t in times])


def test_one_long_gap_is_counted_with_its_excess():
    # Two streams, a token every 2 ms; stream b waits 10 ms once (a stalled step) at 0.020.
    a = _record("a", [0.001 + 0.002 * i for i in range(30)])
    b_times = [0.002 + 0.002 * i for i in range(10)] + [0.030 + 0.002 * i for i in range(20)]
    b = _record("b", b_times)
    window = (max(a.arrivals[0][0], b.arrivals[0][0]), min(a.arrivals[-1][0], b.arrivals[-1][0]))
    g = steady_gaps([a, b])
    inside = [y - x for r in (a, b) for (x, _), (y, _) in zip(r.arrivals, r.arrivals[1:]) if window[0] <= x and y <= window[1]]
    assert g["gaps"] == len(inside)
    assert g["ms_p50"] == pytest.approx(2.0)
    assert g["ms_max"] == pytest.approx(10.0)
    assert g["long"] == 1
    # 8 ms beyond the p50, over two streams' worth of the window
    assert g["long_excess_pct"] == pytest.approx(round(100 * 0.008 / ((window[1] - window[0]) * 2), 2))
    assert g["ms_mean"] > g["ms_p50"]


def test_even_gaps_have_no_long_ones():
    recs = [_record(str(k), [0.0005 * k + 0.002 * i for i in range(20)]) for k in range(4)]
    g = steady_gaps(recs)
    assert g["long"] == 0 and g["long_excess_pct"] == 0.0
    assert g["ms_p50"] == pytest.approx(2.0) and g["ms_p99"] == pytest.approx(2.0)
    assert steady_tok_s(recs) == pytest.approx(500 * 4, rel=0.05)


def test_gaps_from_before_the_window_are_left_out():
    # a decodes from 0; b's prompt is prefilled meanwhile (a waits 20 ms), and b's first token
    # arrives a moment before a's token of the same step: the window opens there
    a = _record("a", [0.000, 0.0201] + [0.0221 + 0.002 * i for i in range(20)])
    b = _record("b", [0.0200] + [0.0220 + 0.002 * i for i in range(20)])
    g = steady_gaps([a, b])
    assert g["ms_max"] == pytest.approx(2.0) and g["long"] == 0


def test_no_window_without_overlap():
    # b starts after a ends: no moment when both generate
    a = _record("a", [0.0, 0.002, 0.004])
    b = _record("b", [0.010, 0.012])
    assert steady_gaps([a, b]) is None
    assert steady_tok_s([a, b]) is None
