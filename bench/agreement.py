"""Greedy agreement with llama.cpp on the committed fixtures: per prompt, the tokens before
the first divergence, summed over prompts, over all recorded tokens.

    python bench/agreement.py [--model PATH] [--fixture tests/fixtures/generation_smollm2.json]
        [--numerics ggml [--ggml-threads N]] [--kernels op=impl,...] [--kv-dtype float16] [--limit N]

Runs the engine's own step programs (a ModelRunner with 8 slots, prompts prefilled in chunks of
512 as the recordings were), 8 prompts at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(ROOT)

from model.config import NUMERICS, EngineConfig  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.offline import first_divergence, generate  # noqa: E402
from scheduler.loader import resolve_kv_dtype  # noqa: E402
from server.default_model import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--fixture", default=str(ROOT / "tests/fixtures/generation_smollm2.json"))
    ap.add_argument("--kernels", default="")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--numerics", default="native", choices=NUMERICS)
    ap.add_argument("--ggml-threads", type=int, default=0,
                    help="llama.cpp's threads in the recording (default: the fixture's meta.settings.n_threads)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    fixture = json.load(open(args.fixture))
    threads = args.ggml_threads or fixture["meta"]["settings"]["n_threads"]
    kernels = tuple(tuple(kv.split("=")) for kv in args.kernels.split(",") if kv)
    ecfg = resolve_kv_dtype(EngineConfig(num_slots=8, max_context=args.max_context, kv_dtype=args.kv_dtype,
                                         kernels=kernels, numerics=args.numerics,
                                         ggml_threads=threads))
    m = load_model(args.model, ecfg)
    runner = m.make_runner(ecfg)
    runner.warmup()
    cases = fixture["cases"]
    if args.limit:
        cases = cases[: args.limit]
    agree = total = 0
    t0 = time.time()
    for i in range(0, len(cases), 8):
        batch = cases[i : i + 8]
        outs = generate(runner, [c["prompt_ids"] for c in batch], 32, stop_ids=m.tokenizer.eog_ids)
        for c, o in zip(batch, outs):
            ref = c["generated_ids"]
            n = first_divergence(o, ref)
            agree += n
            total += len(ref)
            print(f"{c['name']:40s} prompt {len(c['prompt_ids']):5d}  agree {n:3d}/{len(ref)}", flush=True)
    print(f"agreement {agree}/{total} = {100 * agree / total:.2f}%  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
