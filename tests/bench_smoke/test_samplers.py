"""bench/samplers.py runs on the CPU at a small size and writes a row per sampler."""

from __future__ import annotations

import json

from bench import samplers


def test_the_samplers_bench_runs_small(tmp_path):
    assert samplers.main(["--rows", "2", "--vocab", "300", "--context", "64", "--repeats", "2", "--out",
                          str(tmp_path)]) == 0
    (path,) = tmp_path.glob("samplers-*.json")
    report = json.loads(path.read_text())
    assert [r["case"] for r in report["results"]] == [name for name, _, _ in samplers.CASES]
    assert report["results"][0]["vs_greedy"] == 1.0 and all(r["us"] > 0 for r in report["results"])
