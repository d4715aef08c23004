"""Speculative decoding by prompt lookup (`--draft-max`), engine direct: the same greedy requests
with and without drafts, in one engine, alternated.

    python bench/speculative.py --model PATH --draft-max 7 [--users 1,2,4] [--tokens 128] [--out DIR]

The engine runs with the given --draft-max; each batch of requests (greedy, or with
`--temperature` sampled, each with a seed of its own) runs once with the request
field `speculative.n_max` at 0 (a plain decode: no slot speculates, so the engine's plain decode
program runs) and once without it (the engine's draft max), the order alternating between repeats. Per
arm: decode tokens per second per request (its first token to its last), the batch's aggregate rate
over the same window, the tokens a decode step gave each request (its decode tokens over the
engine steps that gave it tokens, `RequestTiming.steps`), the drafts run and accepted (the
device's counts, steps computed past a request's end included), and whether every request's
tokens were the same in both arms (they must be: a speculative step's rows compute and choose
what a plain decode's do).

The prompts (`TASKS`) are chat requests of the kinds prompt lookup is known to help (a program
edited, a list reformatted, a passage quoted or summarised) and an open one that it should
not, rendered with the model's chat template where it has one. A model with random weights (the
synthetic GGUFs) tends to repeat a token, which its drafts then predict: its rate shows what
a speculative step costs and the most it can give, not what real text gets.
Writes bench/results/speculative-<date>.json.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

from bench import common  # noqa: E402
from bench.engine import TimingLog, make_request, run_batch, start_engine  # noqa: E402
from model.chat_template import render_chat  # noqa: E402
from model.step_types import SamplingParams  # noqa: E402
from server.__main__ import add_engine_arguments, engine_config_from_args  # noqa: E402  (the server's flags)
from server.prompts import bos_eos_text  # noqa: E402

log = logging.getLogger("bench.speculative")

_PROGRAM = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
'''

_PASSAGE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
            "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 "
            "square kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It "
            "can be seen from outer space and is the world's biggest single structure made by living organisms. "
            "This reef structure is composed of and built by billions of tiny organisms, known as coral polyps. "
            "It supports a wide diversity of life and was selected as a World Heritage Site in 1981.")

TASKS: dict[str, str] = {
    "code_edit": "Rewrite this Python code so that every function has type hints and a docstring. Keep the "
                 "code otherwise the same.\n\n" + _PROGRAM,
    "reformat": "Turn this list into a JSON array of objects with the keys name, age and email:\n"
                "alice,34,alice@example.com\nbob,17,bob@example.com\ncarol,45,carol@example.com\n"
                "dave,29,dave@example.com\nerin,52,erin@example.com\nfrank,16,frank@example.com",
    "quote": _PASSAGE + "\n\nQuote the sentence of the passage above that says where the reef is, then the one "
                        "that says what built it.",
    "summary": _PASSAGE + "\n\nSummarise the passage above in three sentences.",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def prompt_tokens(tokenizer: Any, text: str) -> tuple[int, ...]:
    """A chat request's prompt with the model's template, else the text as it is."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        bos, eos = bos_eos_text(tokenizer)
        text = render_chat(template, [{"role": "user", "content": text}], add_generation_prompt=True,
                           bos_token=bos, eos_token=eos)
    return tuple(tokenizer.encode(text))


async def run_arm(engine, timings: TimingLog, prompts: list[tuple[str, tuple[int, ...]]], tokens: int,
                  draft_max: int | None, label: str, temperature: float = 0.0) -> dict[str, Any]:
    before = engine.stats()
    # sampled requests get a seed each (the same in both arms: their tokens must be the same)
    requests = [make_request(f"{label}-{i}-{name}", ids, tokens, 0, ignore_eos=False, cache_prompt=False,
                             sampling=SamplingParams(temperature=temperature, seed=1000 + i, draft_max=draft_max))
                for i, (name, ids) in enumerate(prompts)]
    records = await run_batch(engine, requests)
    after = engine.stats()
    for r in records:
        if r.error or r.rejected:
            raise RuntimeError(f"{r.label}: {r.error or 'rejected'}")
    rates = [(r.num_tokens - 1) / (r.last - r.arrivals[0][0]) for r in records if r.num_tokens > 1]
    await timings.wait_for(label + "-", len(records))
    mine = [t for t in timings.items if t.request_id.startswith(label + "-")]
    decoded = sum(t.completion_tokens - 1 for t in mine)  # tokens of decode steps (the first is the prefill's)
    steps = sum(t.steps - 1 for t in mine)
    # the drafts of the tokens the requests kept (files before 2026-12-05's forty-seventh session
    # counted the device's, the steps dispatched past a request's end included)
    run = after.draft_tokens_total - before.draft_tokens_total
    accepted = after.draft_tokens_accepted_total - before.draft_tokens_accepted_total
    spec_steps = after.speculative_steps_total - before.speculative_steps_total
    return {
        "tok_s_per_request": [round(x, 1) for x in rates],
        "tok_s_per_request_mean": round(statistics.fmean(rates), 1) if rates else None,
        "aggregate_tok_s": common.steady_tok_s(records),
        "drafts_run": run,
        "drafts_accepted": accepted,
        "speculative_steps": spec_steps,  # engine steps that ran the speculative program (all requests')
        "decode_tokens": decoded,
        "decode_steps": steps,
        "tokens_per_step": round(decoded / max(steps, 1), 3),
        "tokens": [r.tokens for r in records],
    }


async def run_all(engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer = engine.tokenizer
    timings = TimingLog()
    engine.add_observer(timings)
    tasks = {name: prompt_tokens(tokenizer, text) for name, text in TASKS.items()}
    names = list(tasks)
    out = []
    # warm-up: every program compiled at start; one short run of each arm settles the host side
    for n_max in (0, None):
        await run_arm(engine, timings, [(names[0], tasks[names[0]])], 8, n_max, f"warmup{n_max}")
    for users in args.users:
        for start in range(0, len(names) if users == 1 else 1):  # alone: each task; together: the first users
            chosen = [names[(start + i) % len(names)] for i in range(users)]
            prompts = [(n, tasks[n]) for n in chosen]
            arms: dict[str, list[dict[str, Any]]] = {"plain": [], "speculative": []}
            for rep in range(args.repeats):
                order = [("plain", 0), ("speculative", None)]
                for arm, n_max in (order if rep % 2 == 0 else order[::-1]):
                    arms[arm].append(await run_arm(engine, timings, prompts, args.tokens, n_max,
                                                   f"{arm}-{users}-{start}-{rep}", args.temperature))
            same = all(a["tokens"] == arms["plain"][0]["tokens"] for runs in arms.values() for a in runs)
            row = {"users": users, "tasks": chosen, "same_tokens": same}
            for arm, runs in arms.items():
                row[arm] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
            plain = statistics.fmean(r["tok_s_per_request_mean"] for r in arms["plain"])
            spec = statistics.fmean(r["tok_s_per_request_mean"] for r in arms["speculative"])
            row["speedup_per_request"] = round(spec / plain, 3)
            out.append(row)
            log.info("%d user(s) %s: plain %.1f, speculative %.1f tok/s per request (x%.2f), %s tokens a step, "
                     "%s engine steps speculative, same tokens: %s", users, ",".join(chosen), plain, spec, spec / plain,
                     [r["tokens_per_step"] for r in arms["speculative"]],
                     [r["speculative_steps"] for r in arms["speculative"]], same)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, required=True, help="GGUF file")
    add_engine_arguments(ap, numerics="native")  # the server's engine flags and defaults (server --help)
    ap.add_argument("--users", default="1,2,4", help="requests run together, comma-separated")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request (EOS ends it sooner)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating which goes first")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' temperature (0: greedy; above, each request has a seed of its own)")
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    args.users = [int(u) for u in args.users.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    if config.draft_max < 1:
        ap.error("--draft-max N (N >= 1) is the speculative arm's setting")
    if max(args.users) > config.num_slots:
        ap.error(f"--users up to --slots ({config.num_slots})")
    stamp = common.timestamp()
    engine, startup = start_engine(args.model, config)
    try:
        rows = asyncio.run(run_all(engine, args))
    finally:
        engine.shutdown(60)
    result = {
        **common.device_info(),
        "git": common.git_rev(),
        "command": "python bench/speculative.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": common.model_facts(args.model),
        "draft_max": config.draft_max,
        "ngram": [config.ngram_min, config.ngram_max],
        "draft_min_gain": config.draft_min_gain,
        "temperature": args.temperature,
        "startup": startup,
        "rows": rows,
    }
    path = common.result_path(args.out, "speculative", stamp)
    common.write_json(path, result)
    print(f"wrote {path}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
