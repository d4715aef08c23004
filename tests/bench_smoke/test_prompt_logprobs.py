"""bench/prompt_logprobs.py runs on the CPU: scored prompts timed beside plain ones, and each cut's
plain prefill picks the best token the scored chunk's row gives."""

from __future__ import annotations

import json

from bench import prompt_logprobs


def test_the_prompt_logprobs_bench_runs_tiny(tiny_tp_path, tmp_path):
    argv = ["--model", str(tiny_tp_path), "--max-context", "256", "--prefill-chunks", "16,64", "--prompt-len", "100",
            "--prompts", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert prompt_logprobs.main(argv) == 0
    (path,) = tmp_path.glob("prompt-logprobs-*.json")
    report = json.loads(path.read_text())
    assert report["ok"] and [c["cut"] for c in report["checks"]] == [1, 2, 63, 64, 65, 99]
    assert all(c["same_best"] or c["near_tie"] for c in report["checks"])
    assert all(r > 0 for r in report["prefill_tok_s"]["plain"] + report["prefill_tok_s"]["scored"])
