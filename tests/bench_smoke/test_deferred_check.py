"""bench/deferred_check.py runs on the CPU and finds the deferred decode equal to the one-program one."""

from __future__ import annotations

import json

from bench import deferred_check


def test_the_deferred_check_runs_tiny(tiny_tp_path, tmp_path):
    argv = ["--model", str(tiny_tp_path), "--steps", "3", "--max-context", "256", "--out", str(tmp_path)]
    assert deferred_check.main(argv) == 0
    (path,) = tmp_path.glob("deferred-check-*.json")
    report = json.loads(path.read_text())
    for case in report["cases"].values():
        assert case["tokens_equal"] and case["bitwise"]
        assert case["tokens_one_program"] == case["tokens_deferred"]
        assert [len(t) for t in case["tokens_one_program"]] == [2, 2, 3, 3]  # a third prompt joins at the second step
