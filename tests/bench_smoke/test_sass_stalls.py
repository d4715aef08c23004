"""bench/sass_stalls.py on a small CSV in the layout of `ncu --page source --csv --print-source
sass`: predicates stripped from opcodes, executed counts and stall samples summed by opcode and
reason (the "Not Issued" columns left out), stretches of consecutive instructions, and a file
that is not that page refused."""

from __future__ import annotations

import json

import pytest

from bench import sass_stalls

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')
ROWS = [
    ("0x10", "LDC R1, c[0x0][0x28]", 2, 2, 100, 0, 2, 0),
    ("0x20", "@P1 LDG.E R4, desc[UR8][R4.64]", 10, 10, 100, 10, 0, 10),
    ("0x30", "LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT", 1, 0, 1600, 0, 1, 0),
    ("0x40", "@!UP0 LOP3.LUT R6, R4, 0xf0, RZ, 0xc0, !PT", 3, 1, "1,600", 0, 3, 0),  # ncu's thousands comma
    ("0x50", "EXIT", 0, 0, 100, 0, 0, 0),
]


def _csv(tmp_path):
    lines = ['"Kernel Name","anonymous_mosaic_gpu_kernel",', HEADER]
    for r in ROWS:
        lines.append(",".join(f'"{v}"' for v in r))
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_sums_by_opcode_reason_and_stretch(tmp_path):
    s = sass_stalls.summarize(sass_stalls.read(_csv(tmp_path)), stretch=2)
    assert s["instructions"] == 5 and s["executed"] == 3500 and s["samples"] == 16
    assert list(s["opcodes"]) == ["LOP3.LUT", "LDC", "LDG.E", "EXIT"]
    assert s["opcodes"]["LOP3.LUT"] == {"executed": 3200, "samples": 4, "static": 2}
    assert s["stalls"] == {"long_sb": 10, "wait": 6}  # not the "(Not Issued)" column
    assert [(t["first"], t["executed"], t["samples"]) for t in s["stretches"]] == [(0, 200, 12), (2, 3200, 4),
                                                                                   (4, 100, 0)]
    assert s["stretches"][0]["hot"] == ["LDC", "LDG.E"]


def test_main_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert sass_stalls.main([_csv(tmp_path), "--top", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "LOP3.LUT" in text and "EXIT" not in text.split("stall reason")[0]  # --top 2 opcodes
    assert "long_sb" in text
    assert json.loads(out.read_text())["samples"] == 16


def test_refuses_another_page(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name","Metric Name","Metric Value"\n"0","k","Duration","9.2"\n')
    with pytest.raises(ValueError, match="SASS page"):
        sass_stalls.read(str(path))
