"""What splitting Q4_K for Q4_0's kernels (`--split-q4-k`, pallas_kernels/q4_k_split.py) and Q6_K
for the Mosaic matmul's 8-bit path (`--split-q6-k`, pallas_kernels/q6_k_split.py) cost in
correctness on a real Q4_K_M model: the teacher-forced comparison with llama.cpp's recorded
token streams (as tests/model/test_llama_cpp_agreement.py makes it), run without a split, with
Q4_K split and with both split, on the CPU path.

    python bench/q4_k_split_agreement.py --model gemma-3-270m-q4_k_m.gguf \
        [--fixture tests/fixtures/generation_gemma3.json] [--cases N] [--max-context C] [--out DIR]

Per setting: top-1 agreement with llama.cpp, agreement on its decisive steps, the logit |diff|
over llama.cpp's top-10 (p50, p99, max), seconds (load, compile and run); and the split's
logits against the unsplit ones (same top-1, largest |diff|). Writes
bench/results/split-agreement-<date>.json.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time

if __package__ in (None, ""):
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench import common  # noqa: E402
from bench.kv_dtype_agreement import (  # noqa: E402
    against_base, against_llama_cpp, finish, forced_logits, parse_agreement_args, result_record)

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "generation_gemma3.json"

log = logging.getLogger("bench.q4_k_split_agreement")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, required=True, help="a GGUF with Q4_K matrices")
    args, cases = parse_agreement_args(ap, argv, FIXTURE)
    from model.config import EngineConfig
    from model.loader import load_model

    stamp = common.timestamp()
    path_out = common.result_path(args.out, "split-agreement", stamp)
    results, logits = {}, {}
    settings = {"unsplit": ("off", "off"), "split_q4_k": ("on", "off"), "split_q4_k_q6_k": ("on", "on")}
    for name, (q4_k, q6_k) in settings.items():
        t0 = time.perf_counter()
        model = load_model(args.model, EngineConfig(num_slots=8, max_context=args.max_context, split_q4_k=q4_k,
                                                    split_q6_k=q6_k, split_q5_k="off", split_legacy="off"))
        formats = sorted({op for op in model.kernel_names if op.startswith("matmul[")})
        logits[name] = forced_logits(model, cases, "float32", args.max_context)
        row = {**against_llama_cpp(cases, logits[name]), "matmuls": formats,
               "seconds": round(time.perf_counter() - t0, 1)}
        results[name] = row
        log.info("%s: %s", name, row)
        del model
    for name in list(settings)[1:]:
        results[f"{name}_vs_unsplit"] = against_base(logits["unsplit"], logits[name])
    return finish(path_out, result_record("split-agreement", stamp, args.model, args.fixture, cases,
                                          args.max_context, results))


if __name__ == "__main__":
    sys.exit(main())
