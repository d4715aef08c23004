"""bench/prefix_copy.py runs on the CPU (--tiny) and writes its rows."""

from __future__ import annotations

import json

from bench import prefix_copy


def test_the_prefix_copy_bench_runs_tiny(tmp_path):
    assert prefix_copy.main(["--tiny", "--layers", "1,0", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("prefix-copy-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["span"], r["layers_per_iteration"]) for r in rows] == [(512, 1), (512, 4), (1024, 1), (1024, 4)]
    assert all(r["ms"] > 0 and r["temp_mib"] >= 0 for r in rows)
