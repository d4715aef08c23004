"""bench.common.idle_gaps: the idle time of a device trace's span, overlapping streams included."""

from bench.common import idle_gaps


def _ev(name, ts, dur):
    return {"name": name, "ts": ts, "dur": dur}


def test_idle_gaps_counts_only_time_no_event_covers():
    events = [
        _ev("a", 0.0, 10.0),
        _ev("b", 5.0, 20.0),  # overlaps a (another stream): no gap, the work now ends at 25
        _ev("c", 30.0, 5.0),  # 5 us idle after b
        _ev("d", 100.0, 10.0),  # 65 us idle after c
        _ev("e", 101.0, 2.0),  # inside d
    ]
    g = idle_gaps(events, top=2, min_us=20.0)
    assert g["span_us"] == 110.0
    assert g["busy_us"] == 40.0
    assert g["idle_fraction"] == round(70.0 / 110.0, 4)
    assert g["gaps_of_20us_or_more"] == {"count": 1, "sum_us": 65.0}
    assert g["largest"] == [{"us": 65.0, "after": "c", "before": "d"}, {"us": 5.0, "after": "b", "before": "c"}]


def test_idle_gaps_without_events():
    assert "error" in idle_gaps([])


def test_idle_gaps_by_device_keeps_devices_apart():
    from bench.common import idle_gaps_by_device

    a = [dict(_ev("a1", 0.0, 10.0), pid=1), dict(_ev("a2", 50.0, 10.0), pid=1)]  # 40 us idle
    b = [dict(_ev("b1", 10.0, 40.0), pid=2)]  # would cover device 1's gap
    g = idle_gaps_by_device(a + b)["per_device"]
    assert g["1"]["busy_us"] == 20.0 and g["1"]["span_us"] == 60.0
    assert g["2"]["busy_us"] == 40.0
    assert idle_gaps_by_device(a) == idle_gaps(a)


def test_request_timeline_keeps_the_request_window_and_the_long_host_events():
    """bench.common.request_timeline: device work from the submit to the token only, in ms from
    the submit; host events that overlap the window and last at least min_us, longest kept, in
    time order, with their thread's name."""
    from bench.common import request_timeline

    trace = {
        "device": [_ev("before", 900.0, 50.0), _ev("k1", 1300.0, 100.0), _ev("k2", 1500.0, 200.0),
                   _ev("after", 2600.0, 10.0)],
        "host": [dict(_ev("dispatch", 1100.0, 300.0), pid=1, tid=7), dict(_ev("tiny", 1200.0, 5.0), pid=1, tid=7),
                 dict(_ev("wait", 950.0, 900.0), pid=1, tid=8), dict(_ev("late", 2500.0, 90.0), pid=1, tid=7)],
        "threads": {(1, 7): "engine"},
    }
    t = request_timeline(trace, 1000.0, 2000.0, min_us=30.0, top=2)
    assert t["ttft_ms"] == 1.0 and t["kernels"] == 2
    assert t["device_first_ms"] == 0.3 and t["device_last_end_ms"] == 0.7
    assert t["device"]["busy_us"] == 300.0 and t["device"]["span_us"] == 400.0
    assert [(h["name"], h["ms"], h["thread"]) for h in t["host"]] == [("wait", -0.05, "/8"), ("dispatch", 0.1, "engine/7")]


def test_busiest_kernels_ranks_names_by_total_time():
    from bench.common import busiest_kernels

    events = [_ev("a", 0.0, 3.0), _ev("b", 3.0, 10.0), _ev("a", 20.0, 5.0), _ev("c", 30.0, 1.0)]
    assert busiest_kernels(events, top=2) == [
        {"name": "b", "calls": 1, "us": 10.0, "mean_us": 10.0},
        {"name": "a", "calls": 2, "us": 8.0, "mean_us": 4.0},
    ]


def test_attention_decode_configs_take_ints_and_booleans():
    import argparse

    import pytest

    from bench.attention import parse_configs

    assert parse_configs("default;max_splits=32,flag=false;flag=True") == [
        {}, {"max_splits": 32, "flag": False}, {"flag": True}]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_configs("block_s=big")
