"""bench/http.py: both sides build one engine from the same flags, and the whole script runs
(the real server over HTTP, then the engine directly) to the end on the CPU."""

from __future__ import annotations

import gc
import json
import pathlib
import subprocess
import sys

from bench import common, http, server_metrics
from scheduler.requests import RequestTiming
from server.metrics import ITL_BUCKETS, Metrics

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "http.py"


def test_the_engine_side_builds_the_servers_engine_config(tmp_path):
    args = http.build_parser().parse_args([
        "--model", str(tmp_path / "m.gguf"), "--slots", "4", "--max-context", "256", "--max-queue", "2",
        "--server-args", "--decode-steps 3 --few-rows-attention --kv-dtype bfloat16 --slots 6"])
    config = http.engine_config_of(args)
    # --server-args reach the engine-direct side too, and override the bench's own flags
    assert (config.num_slots, config.max_context, config.max_queue) == (6, 256, 2)
    assert config.decode_steps_per_dispatch == 3 and config.few_rows_attention and config.kv_dtype == "bfloat16"
    assert http.engine_flags(args)[-2:] == ["--slots", "6"]
    # the warm-up burst: the largest level (32 by default), up to the bench's slots + queue
    assert http.warmup_requests(args) == 6
    assert http.warmup_requests(http.build_parser().parse_args(["--model", "m", "--users", "1,3"])) == 3


def test_script_runs_both_sides(smollm2_path, tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_path), "--max-context", "256",
                    "--users", "1,3", "--max-tokens", "6", "--prompt-len", "16", "--repeats", "1",
                    "--compile-cache", str(tmp_path / "cache"), "--out", str(tmp_path)], check=True, timeout=600)
    (path,) = tmp_path.glob("http-*.json")
    result = json.loads(path.read_text())
    for side in ("http", "engine"):
        levels = result[side]
        assert {users: (level["tokens"], level["errors"]) for users, level in levels.items()} == {"1": (6, 0), "3": (18, 0)}
    assert set(result["serving_cost"]) == {"1", "3"}
    # the server's own timings of each level's requests, read from its /metrics
    for users, level in result["http"].items():
        side = level["engine_side"]
        assert side["requests"] == int(users) and 0 < side["ttft_ms_mean"] < level["ttft_ms_mean"]
        assert 0 <= side["queue_ms_mean"] <= side["ttft_ms_mean"]
        # the HTTP handler's own share: before submit, and to the first token's frame (which
        # holds the engine's TTFT), all within what the client saw
        assert 0 < side["admit_ms_mean"] and side["ttft_ms_mean"] < side["first_frame_ms_mean"] < level["ttft_ms_mean"]
        cost = result["serving_cost"][users]
        assert cost["ttft_ms_mean_server_delivery"] > -0.5 and cost["ttft_ms_mean_outside_handler"] > 0
        # the client's own part: its request written (bench/http.py's own client; on 2 busy cores
        # its process may be descheduled after the write, so this is not always below the above)
        assert 0 < level["send_ms_mean"] == cost["ttft_ms_mean_client_send"]
    assert {"ttft_ms_mean_http_layer", "ttft_ms_mean_engine_added"} <= set(result["serving_cost"]["3"])
    # where the gaps' tail comes from: the client's, the server's engine thread's and the engine
    # direct's gaps over 5 and 10 ms, and the GC collections of the server and the client
    for users, level in result["http"].items():
        for side in (level, level["server_tails"], result["engine"][users]):
            assert 0 <= side["itl_over_10ms_pct"] <= side["itl_over_5ms_pct"] <= 100
        for side in (level, result["engine"][users]):  # pooled over the level's runs
            assert side["itl_gaps"] == side["tokens"] - side["requests"]  # 5 gaps per 6-token stream
            assert side["itl_over_5ms_pct"] == round(100 * side["itl_over_5ms"] / side["itl_gaps"], 3)
        # the server's engine runs in a process of its own: its collections are counted apart
        assert set(level["client_gc"]) == {"gc0", "gc1", "gc2"}
        assert set(level["server_tails"]) - {"itl_over_5ms_pct", "itl_over_10ms_pct"} == {
            "gc0", "gc1", "gc2", "engine_gc0", "engine_gc1", "engine_gc2"}


def test_long_gaps_counts_what_the_servers_histogram_puts_over_each_bound():
    gaps = [0.001, 0.005, 0.0051, 0.010, 0.0101, 0.030, 0.002, 0.004]
    assert common.long_gaps(gaps) == {"itl_gaps": 8, "itl_over_5ms": 4, "itl_over_5ms_pct": 50.0,
                                      "itl_over_10ms": 2, "itl_over_10ms_pct": 25.0}
    assert common.long_gaps([])["itl_over_5ms_pct"] is None
    # each bound is one of the histogram's, so that the server's share can be read from it
    assert all(b / 1e3 in ITL_BUCKETS for b in common.LONG_GAP_BOUNDS_MS)


def test_combine_runs_pools_the_long_gaps():
    runs = [{"itl_gaps": 10, "itl_over_5ms": 1, "itl_over_10ms": 0, "itl_over_5ms_pct": 10.0},
            {"itl_gaps": 30, "itl_over_5ms": 9, "itl_over_10ms": 3, "itl_over_5ms_pct": 30.0}]
    out = http.combine_runs(runs)
    assert (out["itl_over_5ms_pct"], out["itl_over_10ms_pct"]) == (25.0, 7.5)


def _timing(gaps_s):
    return RequestTiming("r", "length", 4, len(gaps_s) + 1, 0.001, 0.01, tuple(gaps_s), 1.0)


def test_server_tails_read_the_servers_histograms_between_two_scrapes():
    engine_gc = [((0,) * 13, (0,) * 13, (0,) * 13), (0.0, 0.0, 0.0)]
    metrics = Metrics(lambda: None, lambda: tuple(engine_gc))
    metrics.observe(_timing([0.002, 0.020]))  # before the level: not counted
    before = {"raw": server_metrics.parse_metrics(metrics.render()[0].decode())}
    metrics.observe(_timing([0.002, 0.005, 0.006, 0.012]))  # 5 ms: in the bucket le 0.005
    gc.collect()
    engine_gc[:] = [((2,) + (0,) * 12, (0,) * 13, (0,) * 13), (0.0003, 0.0, 0.0)]  # the engine process's
    after = {"raw": server_metrics.parse_metrics(metrics.render()[0].decode())}
    tails = server_metrics.server_tails(before, after)
    assert (tails["itl_over_5ms_pct"], tails["itl_over_10ms_pct"]) == (50.0, 25.0)
    assert tails["gc2"]["count"] >= 1 and tails["gc2"]["ms"] > 0
    assert tails["engine_gc0"] == {"count": 2, "ms": 0.3} and tails["engine_gc2"] == {"count": 0, "ms": 0.0}
    assert server_metrics.server_tails(None, after) is None


def test_gc_recorder_counts_this_processs_collections():
    with server_metrics.GcRecorder() as rec:
        gc.collect()
    assert rec.summary()["gc2"]["count"] == 1 and rec.summary()["gc2"]["max_ms"] > 0
    assert rec.pauses.callback not in gc.callbacks
