"""What the KV cache's dtype costs in correctness: the teacher-forced comparison of
tests/model/test_llama_cpp_agreement.py (our logits on llama.cpp's recorded token streams,
tests/fixtures/generation_smollm2.json) run once per KV dtype, on jax's default backend (the
CPU, or a GPU where there is one).

    python bench/kv_dtype_agreement.py [--model PATH] [--kv-dtypes float32,bfloat16,float8_e4m3fn] [--out DIR]

Per dtype: top-1 agreement with llama.cpp over all steps, agreement on its decisive steps (top-1
ahead of top-2 by more than 0.5), and the logit |diff| over llama.cpp's top-10 (p50, p99, max);
and, against our own f32-cache logits, the same top-1 agreement. Writes
bench/results/kv-agreement-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

if __package__ in (None, ""):
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "generation_smollm2.json"
DECISIVE_MARGIN = 0.5  # as tests/model/test_llama_cpp_agreement.py

log = logging.getLogger("bench.kv_dtype_agreement")


def forced_logits(model, cases, kv_dtype: str, max_context: int = 4096) -> list[np.ndarray]:
    from model.offline import teacher_forced_logits

    out = []
    for i in range(0, len(cases), 8):  # similar lengths share a batch, as the test does
        batch = cases[i:i + 8]
        out.extend(teacher_forced_logits(model.config, model.kernels, model.params,
                                         [(c["prompt_ids"], c["generated_ids"]) for c in batch],
                                         max_context=max_context, kv_dtype=kv_dtype))
    return out


def against_llama_cpp(cases, logits) -> dict:
    from model.offline import compare_top_logits

    c = compare_top_logits(cases, logits, DECISIVE_MARGIN)
    d = c.pop("diffs")
    return {**c, "top1_pct": round(100 * c["top1"] / c["steps"], 2), "logit_diff_p50": round(float(np.median(d)), 4),
            "logit_diff_p99": round(float(np.quantile(d, 0.99)), 4), "logit_diff_max": round(float(d.max()), 4)}


def against_base(base: list[np.ndarray], logits: list[np.ndarray]) -> dict:
    """How far one setting's teacher-forced logits are from a base setting's over the same
    cases: steps with the same top-1, and the largest |diff|."""
    return {
        "top1_same": sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(base, logits)),
        "steps": sum(len(a) for a in base),
        "logit_diff_max": round(max(float(np.abs(a - b).max()) for a, b in zip(base, logits)), 4),
    }


def shortest_cases(fixture: pathlib.Path, count: int, max_context: int) -> list[dict]:
    """A recorded fixture's cases, shortest prompt first: the `count` shortest (0: all). Raises
    ValueError when one does not fit `max_context` positions."""
    cases = sorted(json.loads(fixture.read_text())["cases"], key=lambda c: len(c["prompt_ids"]))
    if count:
        cases = cases[:count]
    if max(len(c["prompt_ids"]) + len(c["generated_ids"]) for c in cases) > max_context:
        raise ValueError("--max-context is shorter than a case: use --cases to keep the shorter ones")
    return cases


def result_record(kind: str, stamp: str, model: pathlib.Path, fixture: pathlib.Path, cases: list[dict],
                  max_context: int, results: dict) -> dict:
    """The JSON an agreement run writes: what ran where, on which fixture (relative to the
    project's root where it lies inside), and its results."""
    fixture = pathlib.Path(fixture).resolve()
    if fixture.is_relative_to(common.ROOT):
        fixture = fixture.relative_to(common.ROOT)
    return {"kind": kind, "date": stamp, "git": common.git_rev(), "device": common.device_info(),
            "model": common.model_facts(model), "fixture": str(fixture), "cases": len(cases),
            "max_context": max_context, "results": results}


def finish(path_out: pathlib.Path, record: dict) -> int:
    """Writes an agreement run's record (`result_record`), prints its results and where it went;
    the script's exit status."""
    common.write_json(path_out, record)
    print(json.dumps(record["results"], indent=1))
    print(f"wrote {path_out}")
    return 0


def parse_agreement_args(ap: argparse.ArgumentParser, argv: list[str] | None,
                         fixture: pathlib.Path = FIXTURE) -> tuple[argparse.Namespace, list[dict]]:
    """The agreement scripts' shared options after their own (--fixture, by default `fixture`;
    --cases, --max-context, --out), parsed, with INFO logging set up; and the fixture's cases
    they name (`shortest_cases`; a usage error where none fit)."""
    ap.add_argument("--fixture", type=pathlib.Path, default=fixture, help="llama.cpp's recordings for that model")
    ap.add_argument("--cases", type=int, default=0, help="only the N shortest cases (0: all)")
    ap.add_argument("--max-context", type=int, default=4096,
                    help="the cache's positions (a smaller cache is much faster on the CPU with 8-bit or bf16 KV)")
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args, shortest_cases(args.fixture, args.cases, args.max_context)
    except ValueError as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, default=None, help="SmolLM2-135M-Instruct Q4_1 (default: the cached one)")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,float8_e4m3fn")
    args, cases = parse_agreement_args(ap, argv)
    from model.config import EngineConfig
    from model.loader import load_model
    from server.default_model import ensure_default_model

    path = args.model or ensure_default_model()
    model = load_model(path, EngineConfig(num_slots=8, max_context=4096))
    stamp = common.timestamp()
    path_out = common.result_path(args.out, "kv-agreement", stamp)
    results, base = {}, None
    for dtype in args.kv_dtypes.split(","):
        t0 = time.perf_counter()
        logits = forced_logits(model, cases, dtype, args.max_context)
        row = against_llama_cpp(cases, logits)
        if base is None:
            base = (dtype, logits)
        else:
            row[f"top1_same_as_{base[0]}"] = against_base(base[1], logits)["top1_same"]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results[dtype] = row
        log.info("%s: %s", dtype, row)
        # after each dtype, so that a long run keeps what it measured (on the CPU an 8-bit or
        # bf16 cache makes the reference attention far slower than an f32 one: its conversions)
        record = result_record("kv-agreement", stamp, path, args.fixture, cases,
                               args.max_context, results)
        common.write_json(path_out, record)
    return finish(path_out, record)


if __name__ == "__main__":
    sys.exit(main())
