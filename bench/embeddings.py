"""Embeddings (/v1/embeddings) engine direct, on whatever backend runs them: what a batch of
inputs costs against prefilling the same prompts plainly, and whether an input's vector is the
same alone and in the batch.

One engine (`scheduler.loader.build_engine`, the server's flags) takes, for each length in
`--lengths`, `--inputs` random-token prompts of that many tokens, `--repeats` times, alternated:

  * embed: the server's own loop (`server.embeddings_api.embed`: at most a slot's worth of the
    batch in the engine at a time), mean or last pooling (`--pooling`);
  * plain: the same prompts as generation requests of one token, no prompt cache, through the
    same window.

It reports inputs/s and prompt tok/s for both, their ratio, the host time of the response
(normalizing and rendering the vectors as JSON, `embeddings_api.respond`), and the largest
difference between the first input's vector alone and in the batch.

    python3 bench/embeddings.py --model /tmp/m.gguf [--lengths 32,128,480] [--inputs 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from scheduler.types import GenerationRequest  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402
from server.embeddings_api import EmbeddingRequest, embed, respond  # noqa: E402


async def _plain(engine, requests: list[GenerationRequest], window: int) -> None:
    """The requests through a window of `window` at a time, each to its end."""
    async def final(stream):
        async for event in stream:
            if event.finish_reason is not None:
                assert event.finish_reason in ("stop", "length"), event
                return
    queue = list(requests)
    running: set[asyncio.Task] = set()
    while queue or running:
        while queue and len(running) < window:
            running.add(asyncio.ensure_future(final(engine.submit(queue.pop(0)))))
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    add_engine_arguments(ap, numerics="native")
    ap.set_defaults(max_context=2048, kv_dtype="auto")
    ap.add_argument("--lengths", default="32,128,480", help="prompt lengths, comma-separated")
    ap.add_argument("--inputs", type=int, default=64, help="inputs per batch")
    ap.add_argument("--pooling", default="last", choices=("mean", "last"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cache_dir:
        common.enable_compilation_cache(args.cache_dir)
    from scheduler.loader import build_engine  # imports JAX

    t0 = time.perf_counter()
    engine = build_engine(args.model, engine_config_from_args(args))
    engine.start()
    if not engine.wait_ready():
        raise SystemExit(f"the engine did not start: {engine.stats().error}")
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    info = engine.info()
    window, vocab = int(info["num_slots"]), int(engine.tokenizer.vocab_size)
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    loop = asyncio.new_event_loop()
    results, ok = [], True
    try:
        for length in lengths:
            prompts = [tuple(int(t) for t in rng.integers(0, vocab, length)) for _ in range(args.inputs)]
            pooled = [GenerationRequest(f"e{i}", p, 0, pooling=args.pooling) for i, p in enumerate(prompts)]
            plain = [GenerationRequest(f"p{i}", p, 1, cache_prompt=False) for i, p in enumerate(prompts)]
            loop.run_until_complete(embed(engine, pooled[:window], window))  # first runs
            loop.run_until_complete(_plain(engine, plain[:window], window))
            rates: dict[str, list[float]] = {"embed": [], "plain": []}
            vectors = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                vectors = loop.run_until_complete(embed(engine, pooled, window))
                rates["embed"].append(len(prompts) / (time.perf_counter() - t))
                t = time.perf_counter()
                loop.run_until_complete(_plain(engine, plain, window))
                rates["plain"].append(len(prompts) / (time.perf_counter() - t))
            (alone,) = loop.run_until_complete(embed(engine, pooled[:1], window))
            diff = float(np.abs(alone - vectors[0]).max())
            t = time.perf_counter()
            body = respond(EmbeddingRequest(tuple(prompts), None, "float", None, 2, True, None), vectors,
                           length * len(prompts), "m", "embd-bench")
            render_ms = (time.perf_counter() - t) * 1e3
            best = {k: max(v) for k, v in rates.items()}
            row = {"length": length, "inputs": len(prompts), "inputs_s": rates,
                   "embed_tok_s": best["embed"] * length, "plain_tok_s": best["plain"] * length,
                   "embed_over_plain": best["embed"] / best["plain"], "alone_vs_batch_max_diff": diff,
                   "response_ms": render_ms, "response_bytes": len(body), "dim": int(vectors[0].shape[0])}
            ok &= bool(np.isfinite(np.stack(vectors)).all())
            results.append(row)
            print(f"{length} tokens x {len(prompts)}: embed {best['embed']:.1f} inputs/s "
                  f"({row['embed_tok_s']:.0f} tok/s), plain prefill {best['plain']:.1f} inputs/s "
                  f"(ratio {row['embed_over_plain']:.3f}); alone vs batch max |diff| {diff:.3g}; "
                  f"response {render_ms:.1f} ms, {len(body):,} bytes", flush=True)
    finally:
        engine.shutdown()
        loop.close()
    report = {**common.run_facts(args.model), "pooling": args.pooling, "slots": window,
              "prefill_chunks": info.get("prefill_chunks"), "results": results, "ok": ok}
    common.save_report(args.out, "embeddings", report)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
