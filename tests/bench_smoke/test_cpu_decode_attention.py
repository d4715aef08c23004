"""bench/cpu_decode_attention.py on a small shape: each implementation timed at each context,
the same outputs, and the report written."""

from __future__ import annotations

import json

from bench import cpu_decode_attention


def test_the_script_times_both_and_they_agree(tmp_path):
    cpu_decode_attention.main(["--layers", "2", "--bucket", "512", "--contexts", "100,500", "--busy", "5",
                               "--repeats", "1", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("cpu-decode-attention-*.json")
    report = json.loads(path.read_text())
    assert [r["context"] for r in report["rows"]] == [100, 500] and report["busy"] == 5
    for row in report["rows"]:
        assert row["reference_ms"] > 0 and row["chunked_ms"] > 0
        assert row["max_abs_diff"] < 1e-4
        assert row["positions"][5:] == [-1, -1, -1] and all(row["context"] // 2 <= p < row["context"]
                                                            for p in row["positions"][:5])
