"""Slot files (scheduler/slot_files.py: llama-server's `POST /slots/{id}?action=save|restore`) on a
model, engine direct: how long a save and a restore of a slot's cached prompt take, the file's
size, what a prompt reusing a restored prefix gains in first-token time, whether its tokens are
the cold prompt's, and what the actions cost a stream decoding beside them.

    python3 bench/slot_files.py --model M.gguf [--prompt-len 3000] [--max-context 4096] [--out DIR]
    python3 bench/slot_files.py --prompt-len 600 --max-context 1024   # the default model, on a CPU

One engine (the server's defaults but these; native numerics). A greedy request of --prompt-len
random tokens (16 out) runs cold; the slot holding its chunks is saved, every slot erased, the
file restored into another slot and the request run again: `cached_tokens` and its tokens against
the cold run. A stream of --beside tokens (greedy, no EOS) decodes meanwhile; its inter-token gaps
during the actions against its median say what they cost it. Writes `slot-files-<date>.json`
to --out (default: nowhere) and prints it.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.engine import build_config, start_engine  # noqa: E402
from model.step_types import SamplingParams  # noqa: E402
from scheduler.types import GenerationRequest  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


async def _run(engine, prompt: tuple[int, ...], max_tokens: int, rid: str, **kw) -> dict[str, Any]:
    """A request's tokens, its first-token time (ms) and every token's arrival (perf_counter s)."""
    start = time.perf_counter()
    stream = engine.submit(GenerationRequest(request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens,
                                             sampling=GREEDY, **kw))
    tokens, arrivals, final = [], [], None
    async for event in stream:
        if event.token_ids:
            arrivals.extend([time.perf_counter()] * len(event.token_ids))
            tokens.extend(event.token_ids)
        final = event
    if final is None or final.error:
        raise RuntimeError(f"request {rid} failed: {final and final.error}")
    return {"tokens": tokens, "ttft_ms": (arrivals[0] - start) * 1e3, "arrivals": arrivals,
            "cached": final.cached_tokens}


async def measure(engine, prompt_len: int, beside: int, directory: str) -> dict[str, Any]:
    num_slots = engine.stats().num_slots
    rng = np.random.default_rng(0)
    prompt = common.random_prompt(rng, prompt_len, int(engine.tokenizer.vocab_size))
    cold = await _run(engine, prompt, 16, "cold")
    held = max(range(num_slots), key=lambda s: engine.stats().cached[s])
    other = common.random_prompt(rng, 32, int(engine.tokenizer.vocab_size))
    stream = asyncio.ensure_future(_run(engine, other, beside, "beside", ignore_eos=True))
    while engine.stats().slots_busy == 0 or engine.stats().generation_tokens_total < 20:
        await asyncio.sleep(0.01)
    path = f"{directory}/slot.bin"
    windows = []
    t0 = time.perf_counter()
    saved = await asyncio.to_thread(engine.slot_action, "save", held, path)
    windows.append((t0, time.perf_counter()))
    for slot in range(num_slots):
        if slot not in {s.slot for s in engine.stats().slot_infos()}:
            await asyncio.to_thread(engine.slot_action, "erase", slot)
    busy = {s.slot for s in engine.stats().slot_infos()}
    into = next(s for s in range(num_slots) if s != held and s not in busy)
    t0 = time.perf_counter()
    restored = await asyncio.to_thread(engine.slot_action, "restore", into, path)
    windows.append((t0, time.perf_counter()))
    warm = await _run(engine, prompt, 16, "warm")
    side = await stream
    gaps = np.diff(side["arrivals"])
    def longest(a: float, b: float) -> float | None:  # the stream's longest gap ending in [a, b + 0.5 s]
        inside = [float(g) * 1e3 for g, t in zip(gaps, side["arrivals"][1:]) if a <= t <= b + 0.5]
        return round(max(inside), 3) if inside else None

    return {
        "prompt_len": prompt_len, "held_tokens": saved["n_saved"], "file_mib": round(saved["n_written"] / 2**20, 2),
        "save_ms": round(saved["timings"]["save_ms"], 2), "restore_ms": round(restored["timings"]["restore_ms"], 2),
        "save_gb_s": round(saved["n_written"] / saved["timings"]["save_ms"] / 1e6, 3),
        "restore_gb_s": round(restored["n_read"] / restored["timings"]["restore_ms"] / 1e6, 3),
        "ttft_cold_ms": round(cold["ttft_ms"], 2), "ttft_restored_ms": round(warm["ttft_ms"], 2),
        "cached_tokens": warm["cached"], "same_tokens": warm["tokens"] == cold["tokens"],
        "beside_gap_median_ms": round(statistics.median(gaps) * 1e3, 3) if len(gaps) else None,
        "beside_gap_max_during_save_ms": longest(*windows[0]),
        "beside_gap_max_during_restore_ms": longest(*windows[1]),
        "beside_tokens": len(side["tokens"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: the server's default model)")
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--beside", type=int, default=400, help="tokens of the stream decoding beside the actions")
    ap.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.slots < 3:
        ap.error("--slots must be 3 or more: the saved slot, the stream beside and the slot restored into")
    if args.cache_dir:
        common.enable_compilation_cache(args.cache_dir)
    if args.model is None:
        from server.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    engine, startup = start_engine(args.model, build_config(args.slots, args.max_context))
    try:
        with tempfile.TemporaryDirectory() as directory:
            row = asyncio.run(measure(engine, args.prompt_len, args.beside, directory))
    finally:
        engine.shutdown(30)
    report = {**common.run_facts(args.model), "startup": startup, **row}
    print(json.dumps(report, indent=1))
    common.save_report(args.out, "slot-files", report)
    return 0 if row["same_tokens"] and row["cached_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
