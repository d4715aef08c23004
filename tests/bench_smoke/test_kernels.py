"""bench/kernels.py on the CPU (interpret mode): the Q4_K and Q6_K rows include their splits
(for the Q4_0 kernels, for the Mosaic kernel's 8-bit path), checked against the unsplit reference
like every other implementation."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_split_rows(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--formats", "q4_k,q6_k", "--impls", "reference",
                    "--shapes", "64x512", "--ms", "1,8", "--runs", "1", "--mats", "1", "--copy-gb", "0.01",
                    "--out", str(tmp_path)], check=True, timeout=600)
    (path,) = tmp_path.glob("kernels-*.json")
    rows = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "reference:q4_k_split"]
    assert [r["m"] for r in rows] == [1, 8]
    for r in rows:
        assert r["ok"] and 0 < r["rel_err"] < 1e-3 and r["us"] > 0
        # the split's bytes: 0.6875 per weight against Q4_K's 0.5625
        assert r["gbps"] * r["us"] * 1e3 >= 64 * 512 * 0.6875
    rows = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "reference:q6_k_split"]
    assert [r["m"] for r in rows] == [1, 8]
    for r in rows:  # 1.125 bytes per weight against Q6_K's 0.8203
        assert r["ok"] and 0 < r["rel_err"] < 1e-3 and r["gbps"] * r["us"] * 1e3 >= 64 * 512 * 1.125
