"""bench/embeddings.py runs on the CPU: a batch of embeddings timed beside the same prompts'
plain prefill, each input's vector the same alone and in the batch."""

from __future__ import annotations

import json

from bench import embeddings


def test_the_embeddings_bench_runs_tiny(tiny_tp_path, tmp_path):
    argv = ["--model", str(tiny_tp_path), "--max-context", "256", "--prefill-chunks", "16,64", "--slots", "2",
            "--lengths", "10,40", "--inputs", "4", "--repeats", "1", "--out", str(tmp_path)]
    assert embeddings.main(argv) == 0
    (path,) = tmp_path.glob("embeddings-*.json")
    report = json.loads(path.read_text())
    assert report["ok"] and [r["length"] for r in report["results"]] == [10, 40]
    for row in report["results"]:
        assert row["alone_vs_batch_max_diff"] == 0.0 and row["embed_tok_s"] > 0 and row["plain_tok_s"] > 0
        assert row["response_bytes"] > 4 * row["dim"]
