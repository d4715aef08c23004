"""Perplexity of a GGUF over a text, and what a kernel variant changes in it: llama.cpp's
`llama-perplexity` method, and its KL-divergence comparison, in one run.

The text is tokenized once (with the model's BOS policy) and cut into windows of `--ctx` tokens,
each starting with BOS where the model adds one (the first token of each piece replaced by it);
the model reads each window teacher-forced and the logits at positions ctx/2 .. ctx-2 are scored
on the token after each (ctx/2 - 1 a window), as llama-perplexity does. Windows run `--batch` at a time in their own cache rows: the first half as
one prefill chunk, then a decode step per scored token. The log-probability of each actual next
token is taken on the device (the [B, V] logits never leave it).

`--compare "FLAGS"` loads the model a second time with those flags changed (e.g. `"--kernels
matmul=reference"`, `"--kv-dtype float8_e4m3fn"`, `"--numerics native"`, or `"--model
other-quant.gguf"` of the same vocabulary) and runs both in lockstep over the same windows:
beside each one's perplexity it reports the mean and 99th percentile of KL(base || variant) per
token and how often the two put the same token first, which is what a kernel's rounding costs
(llama-perplexity's --kl-divergence). With `--numerics ggml` on the CPU the base is llama.cpp's
own arithmetic.

    python3 bench/perplexity.py --model M.gguf [--text FILE] [--ctx 512] [--windows 8] \\
        [--compare "--kernels matmul=reference"] [--out DIR]

The default text is this repository's README.md (any text file will do; a text the model was
not trained on gives the honest figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import shlex
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from model import forward  # noqa: E402
from scheduler.loader import load_resolved  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402


def windows_of(tokens: list[int], ctx: int, bos: int | None, limit: int | None) -> list[list[int]]:
    """Consecutive pieces of `ctx` tokens, each opening with BOS in place of its first token."""
    out = []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        piece = list(tokens[start:start + ctx])
        if bos is not None:
            piece[0] = bos
        out.append(piece)
        if limit is not None and len(out) == limit:
            break
    return out


@jax.jit
def _scores(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: the target's log-probability, the log-probabilities [B, V], the argmax."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], logp, jnp.argmax(logp, axis=-1)


@jax.jit
def _kl(base: jax.Array, other: jax.Array) -> jax.Array:
    """KL(base || other) per row, from log-probabilities."""
    return jnp.sum(jnp.exp(base) * (base - other), axis=-1)


class Scorer:
    """One loaded model's teacher-forced pass over a batch of windows, one row per window."""

    def __init__(self, loaded: Any, ecfg: Any, batch: int, ctx: int) -> None:
        self.cfg, self.kernels, self.params = loaded.config, loaded.kernels, loaded.params
        self.kernel_names = loaded.kernel_names
        self.batch, self.ctx = batch, ctx
        self.attend = 1 << max(0, ctx - 1).bit_length()
        self.kv_dtype = jnp.dtype(ecfg.kv_dtype)
        self.prefill = jax.jit(functools.partial(forward.prefill, self.cfg, self.kernels), donate_argnums=(1,),
                               static_argnums=(6,))
        self.decode = jax.jit(functools.partial(forward.decode, self.cfg, self.kernels), donate_argnums=(1,),
                              static_argnums=(4,))

    def start(self, windows: list[list[int]], first: int) -> jax.Array:
        """Prefills each window's tokens [0, first) into its row; the logits that predict token `first`."""
        self.cache = forward.KVCache.create(self.cfg, self.batch, self.attend, self.kv_dtype)
        rows = []
        for b, w in enumerate(windows):
            logits, self.cache = self.prefill(self.params, self.cache, jnp.int32(b), jnp.asarray(w[:first], jnp.int32),
                                              jnp.int32(0), jnp.int32(first), self.attend)
            rows.append(logits)
        rows += [jnp.zeros_like(rows[0])] * (self.batch - len(rows))
        return jnp.stack(rows)

    def step(self, tokens: np.ndarray, positions: np.ndarray) -> jax.Array:
        logits, self.cache = self.decode(self.params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                                         self.attend)
        return logits


def run(scorers: list[Scorer], windows: list[list[int]], ctx: int, batch: int) -> dict[str, Any]:
    # llama-perplexity's span: the logits at positions ctx/2 .. ctx-2, each scored on the token after it
    lead = ctx // 2 + 1
    nll: list[list[float]] = [[] for _ in scorers]
    kl: list[float] = []
    same_top: list[bool] = []
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        n = len(group)
        logits = [s.start(group, lead) for s in scorers]
        for t in range(lead, ctx):
            targets = np.zeros((batch,), np.int32)
            targets[:n] = [w[t] for w in group]
            scored = [_scores(lg, jnp.asarray(targets)) for lg in logits]
            for k, (lp, _, _) in enumerate(scored):
                nll[k] += (-np.asarray(lp)[:n]).tolist()
            if len(scorers) > 1:
                kl += np.asarray(_kl(scored[0][1], scored[1][1]))[:n].tolist()
                same_top += (np.asarray(scored[0][2])[:n] == np.asarray(scored[1][2])[:n]).tolist()
            if t + 1 < ctx:
                tokens = np.zeros((batch,), np.int32)
                tokens[:n] = targets[:n]
                positions = np.full((batch,), -1, np.int32)
                positions[:n] = t
                logits = [s.step(tokens, positions) for s in scorers]
    out: dict[str, Any] = {"scored_tokens": len(nll[0])}
    for k, values in enumerate(nll):
        v = np.asarray(values, np.float64)
        mean, sem = float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
        out["base" if k == 0 else "variant"] = {"ppl": math.exp(mean), "ppl_err": math.exp(mean) * sem,
                                                "mean_nll": mean}
    if kl:
        k_arr = np.asarray(kl, np.float64)
        out["kl_mean"], out["kl_p99"], out["kl_max"] = float(k_arr.mean()), float(np.percentile(k_arr, 99)), float(k_arr.max())
        out["same_top_pct"] = 100.0 * float(np.mean(same_top))
        out["delta_nll"] = out["variant"]["mean_nll"] - out["base"]["mean_nll"]
    return out


def engine_config(args: argparse.Namespace) -> Any:
    """The engine flags' config, its context at least one window."""
    return dataclasses.replace(engine_config_from_args(args), max_context=max(args.max_context, args.ctx))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the server's default model)")
    add_engine_arguments(ap, numerics="auto")
    ap.add_argument("--text", default=str(ROOT / "README.md"), help="a text file (UTF-8)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (even; half of them scored)")
    ap.add_argument("--windows", type=int, default=8, help="at most this many windows")
    ap.add_argument("--batch", type=int, default=8, help="windows run together")
    ap.add_argument("--compare", default=None, metavar="FLAGS",
                    help="a variant: these flags (one string; --compare=\"...\" for a single flag) over the base's, run "
                         "beside it: --model (another quant of the same vocabulary) and the engine flags that shape the "
                         "arithmetic (--kernels, --numerics, --kv-dtype, the --split-* flags); scheduling flags do "
                         "nothing here")
    ap.add_argument("--out", default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.ctx < 4 or args.ctx % 2:
        ap.error("--ctx must be even and at least 4")
    if args.model is None:
        from server.default_model import default_model_path

        args.model = str(default_model_path())
    t0 = time.perf_counter()
    configs = [load_resolved(args.model, engine_config(args))]
    text = pathlib.Path(args.text).read_text(encoding="utf-8")
    tokenizer = configs[0][0].tokenizer
    tokens = tokenizer.encode(text, add_bos=None)  # the model's own BOS policy, as llama-perplexity's
    variant_is_base = False
    if args.compare:
        variant = ap.parse_args(argv + shlex.split(args.compare))  # its --model, if it names one, wins
        variant.model = variant.model or args.model
        configs.append(load_resolved(variant.model, engine_config(variant)))
        if configs[1][0].tokenizer.encode(text, add_bos=None) != tokens:
            ap.error("the variant's model tokenizes the text otherwise: its perplexity is not comparable")
        variant_is_base = (variant.model, configs[1][1]) == (args.model, configs[0][1])
        if variant_is_base:
            print("warning: --compare changes nothing here (the same model and engine settings)", flush=True)
    loaded, ecfg = configs[0]
    windows = windows_of(tokens, args.ctx, tokenizer.bos_id if tokenizer.add_bos else None, args.windows)
    if not windows:
        ap.error(f"the text has {len(tokens)} tokens: fewer than one window of {args.ctx}")
    scorers = [Scorer(m, c, min(args.batch, len(windows)), args.ctx) for m, c in configs]
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {len(tokens)} tokens, {len(windows)} windows of {args.ctx}",
          flush=True)
    t1 = time.perf_counter()
    result = run(scorers, windows, args.ctx, scorers[0].batch)
    report = {
        **common.run_facts(args.model), "text": str(args.text), "ctx": args.ctx, "windows": len(windows),
        "numerics": ecfg.numerics, "kv_dtype": ecfg.kv_dtype, "kernels": scorers[0].kernel_names,
        "variant_config": {"flags": args.compare, "model": str(variant.model), "numerics": configs[1][1].numerics,
                           "kv_dtype": configs[1][1].kv_dtype, "kernels": scorers[1].kernel_names,
                           "is_base": variant_is_base} if len(scorers) > 1 else None,
        "seconds": round(time.perf_counter() - t1, 2), **result,
    }
    line = f"PPL {result['base']['ppl']:.4f} +/- {result['base']['ppl_err']:.4f} over {result['scored_tokens']} tokens"
    if "variant" in result:
        line += (f"; variant PPL {result['variant']['ppl']:.4f} (mean NLL {result['delta_nll']:+.2e}), "
                 f"KL mean {result['kl_mean']:.3e} p99 {result['kl_p99']:.3e}, same top token "
                 f"{result['same_top_pct']:.2f}%")
    print(line, flush=True)
    common.save_report(args.out, "perplexity", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
