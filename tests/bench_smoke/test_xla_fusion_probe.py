"""bench/xla_fusion_probe.py runs on the CPU: every form compiles and counts its kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_probe_counts_every_form(tmp_path):
    out = tmp_path / "probe.txt"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "xla_fusion_probe.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = out.read_text().splitlines()
    forms = {line.split()[0]: int(line.split()[1]) for line in lines[1:]}
    assert set(forms) == {"current", "current_gather", "plain", "deferred", "deferred_t"}
    assert all(n >= 3 for n in forms.values())  # at least one kernel per layer
