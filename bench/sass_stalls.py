"""Where a kernel's warps spend their time, from Nsight Compute's SASS page: instructions executed
and warp stall samples summed by opcode and by stall reason, and the kernel cut into stretches of
consecutive instructions (prologue, K-step loop, epilogue) with their share of the samples.

    ncu --kernel-name regex:mosaic --launch-skip 3 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --import-source no -o /tmp/r python3 bench/profile_matmul.py 4096x4096
    ncu --import /tmp/r.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/sass_stalls.py sass.csv [--top 25] [--stretch 25] [--json OUT.json]

The CSV is `ncu --page source --csv --print-source sass`: a kernel-name line, then a header with
"Source", "Instructions Executed", "Warp Stall Sampling (All Samples)" and one `stall_*` column per
reason (ncu 2024-2025's names). Plain Python: it runs anywhere, on a CSV brought back from the GPU.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys

SOURCE, EXECUTED, SAMPLES = "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"
PREDICATE = re.compile(r"^@!?U?P\w+\s+")  # `@P1 `, `@!UP0 `


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> list[dict]:
    """The SASS rows of the CSV: {"sass", "op", "executed", "samples", "stalls": {reason: n}}."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    at = next((i for i, r in enumerate(rows) if SOURCE in r and EXECUTED in r), None)
    if at is None:
        raise ValueError(f"{path}: no header with {SOURCE!r} and {EXECUTED!r}: not ncu's SASS page as CSV")
    header = rows[at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[at + 1:]:
        if len(r) < len(header):
            continue
        sass = r[col[SOURCE]].strip()
        out.append({
            "sass": sass,
            "op": PREDICATE.sub("", sass).split(" ")[0],
            "executed": _num(r[col[EXECUTED]]),
            "samples": _num(r[col[SAMPLES]]) if SAMPLES in col else 0.0,
            "stalls": {h[len("stall_"):]: _num(r[col[h]]) for h in reasons},
        })
    return out


def summarize(rows: list[dict], stretch: int = 25) -> dict:
    """Totals, per opcode {"executed", "samples", "static"}, per stall reason, and per stretch of
    `stretch` consecutive instructions {"first", "executed", "samples", "hot": the opcodes holding
    more than 1% of all samples}."""
    executed = sum(r["executed"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    ops: dict[str, dict] = collections.defaultdict(lambda: {"executed": 0.0, "samples": 0.0, "static": 0})
    reasons: collections.Counter = collections.Counter()
    for r in rows:
        o = ops[r["op"]]
        o["executed"] += r["executed"]
        o["samples"] += r["samples"]
        o["static"] += 1
        reasons.update(r["stalls"])
    stretches = []
    for i in range(0, len(rows), stretch):
        part = rows[i:i + stretch]
        stretches.append({
            "first": i,
            "executed": sum(r["executed"] for r in part),
            "samples": sum(r["samples"] for r in part),
            "hot": [r["op"] for r in part if samples and r["samples"] > 0.01 * samples],
        })
    return {"instructions": len(rows), "executed": executed, "samples": samples,
            "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1]["executed"])),
            "stalls": dict(reasons.most_common()), "stretches": stretches}


def report(s: dict, top: int) -> str:
    ex, sa = s["executed"] or 1.0, s["samples"] or 1.0
    lines = [f"{s['instructions']} SASS instructions, {s['executed']:.0f} warp instructions executed, "
             f"{s['samples']:.0f} stall samples", "", "opcode                      executed          samples"]
    for op, o in list(s["opcodes"].items())[:top]:
        lines.append(f"{op:26s} {o['executed']:10.0f} {100 * o['executed'] / ex:5.1f}%  "
                     f"{o['samples']:7.0f} {100 * o['samples'] / sa:5.1f}%  ({o['static']} in the code)")
    lines += ["", "stall reason                samples"]
    lines += [f"{k:26s} {v:8.0f} {100 * v / sa:5.1f}%" for k, v in s["stalls"].items() if v]
    lines += ["", "stretch     executed   samples  hot opcodes"]
    for t in s["stretches"]:
        lines.append(f"{t['first']:5d}  {t['executed']:10.0f}  {100 * t['samples'] / sa:5.1f}%  {' '.join(t['hot'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25, help="opcodes listed")
    ap.add_argument("--stretch", type=int, default=25, help="instructions per stretch")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    s = summarize(read(args.csv), args.stretch)
    print(report(s, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
