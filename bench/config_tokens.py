"""Greedy tokens of one GGUF under two engine settings, side by side: whether a variant (a kernel,
a layout, a flag of the server) changes what the engine generates.

    python bench/config_tokens.py --model PATH --a= --b=--no-ordered-values
        [--prompts 8] [--prompt-lens 5,37,200,600] [--tokens 64] [--seed 0] [--out DIR]

`--a` and `--b` are the server's engine flags (as `python -m server` takes them, given with "=" since
they start with "--"; the defaults here are 8 slots, context 1024). Prompts are random token ids of the given lengths (cycled), the same
for both; each setting loads the model, runs the engine's own step programs (a ModelRunner, all
prompts at once, each in its own slot) and generates `--tokens` greedy tokens per prompt. It prints
per prompt the tokens before the first divergence, the total, and writes
`config-tokens-<date>.json` under DIR.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shlex
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.config import ModelConfig  # noqa: E402
from model.gguf_file import GGUFFile  # noqa: E402
from model.offline import first_divergence, generate  # noqa: E402
from scheduler.loader import load_resolved  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402  (the server's flags)


def engine_config(flags: str):
    ap = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_arguments(ap, numerics="native")
    ap.set_defaults(max_context=1024)
    return engine_config_from_args(ap.parse_args(shlex.split(flags)))


def tokens_under(model: str, flags: str, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], dict]:
    t0 = time.perf_counter()
    m, ecfg = load_resolved(model, engine_config(flags))
    runner = m.make_runner(ecfg)
    runner.warmup()
    ready = time.perf_counter() - t0
    out = generate(runner, prompts, num_tokens)
    info = {"flags": flags, "kernels": m.kernel_names, "ready_s": round(ready, 1),
            "generate_s": round(time.perf_counter() - t0 - ready, 1)}
    del runner, m
    gc.collect()  # the first model's device buffers go before the second loads
    return out, info


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", required=True)
    ap.add_argument("--a", default="", help="the engine flags of the first setting")
    ap.add_argument("--b", default="", help="... of the second")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-lens", type=lambda v: [int(t) for t in v.split(",")], default=[5, 37, 200, 600])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    slots = engine_config(args.a).num_slots
    if args.prompts > min(slots, engine_config(args.b).num_slots):
        ap.error(f"--prompts {args.prompts}: each prompt takes a slot of its own (--slots, {slots} here)")

    # the prompts: ids of the model's vocabulary past its first 4 (control tokens)
    gf = GGUFFile(args.model)
    vocab = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors)).vocab_size
    rng = np.random.default_rng(args.seed)
    lens = [args.prompt_lens[i % len(args.prompt_lens)] for i in range(args.prompts)]
    prompts = [rng.integers(4, vocab, n).tolist() for n in lens]
    (a, info_a), (b, info_b) = (tokens_under(args.model, flags, prompts, args.tokens) for flags in (args.a, args.b))
    agree = total = 0
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        n = first_divergence(x, y)
        agree, total = agree + n, total + len(y)
        rows.append({"prompt_len": len(prompts[i]), "agree": n, "tokens": len(y)})
        print(f"prompt {i} ({len(prompts[i])} tokens): {n}/{len(y)} the same", flush=True)
    print(f"{agree}/{total} tokens the same ({100 * agree / total:.2f}%): {info_a} against {info_b}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"config-tokens-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({
            "gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "model": args.model,
            "a": info_a, "b": info_b, "seed": args.seed, "tokens_per_prompt": args.tokens,
            "agree": agree, "total": total, "prompts": rows}, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
