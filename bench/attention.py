"""Attention kernel benchmark: decode (flash decoding) and prefill, the Triton kernels against
the plain-jnp references, with the device copy bandwidth measured in the same run.

    python3 bench/attention.py [--out DIR] [--sweep]
    python3 bench/attention.py --interpret --tiny       # CPU smoke test (Pallas interpret mode)

Decode: B = 1, 8, 32 slots, every row at full length (position S - 1), S = 1k, 4k, 8k, the
Llama-2-7B (H 32, K 32, D 128) and Llama-3-8B (H 32, K 8, D 128) attention shapes, bf16 KV.
Bytes are the K and V cache bytes of the visible positions (B * S * K * D * 2 * 2); GB/s is
against the wall time of one call, and "% copy" against the `y = x + 1` copy bandwidth
(read + write) measured here. Prefill: one slot, a 512-token chunk at start 0 (S = 512, the
smallest context bucket) and at start 3584 (S = 4096); TFLOP/s counts 4 * H * D per visible
(query, key) pair. rel_err: relative norm error of the Triton output against the reference.

Timing: each measured call is one jitted program that runs the op on `copies` distinct K/V
buffers in a row (enough to exceed the L2 cache, at most --max-copies), so host dispatch is
paid once per program and the cache is read from HBM; us = median program time / copies.
Where a cache is large enough to take a single copy, that wall time holds the host's dispatch
and sync (0.1-0.4 ms on the H200): `--device-time` adds each call's kernel time from a profiler
trace and the bandwidth over it (`gbps_device`, `pct_hbm_device`), the kernel's own figure. A
read-only stream can pass the copy rate, which counts reads and writes.
`--sweep` then times a grid of kernel configurations on a few shapes (rows carry "config").
`--sweep-decode llama2-7b:8:200,llama2-7b:8:200:1,...` times decode configurations alone at
engine-like positions (B rows at that position, or only the first ACTIVE of them and the rest at
position 0 as the runner's inactive slots, attending over the runner's context bucket; bytes
count the visible keys): where the main plan's full-length rows favour long pipelines, a decode
step at a few hundred keys is bound by each program's latency.

Writes `attention-<date>.json` ({"meta": ..., "rows": [...]}) to --out (default
bench/results) and prints a table last.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: put the repository root first on sys.path
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

log = logging.getLogger("bench.attention")

MODELS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # name: (H, K, D)
TINY_MODELS = {"tiny-mha": (4, 4, 64), "tiny-gqa": (8, 2, 64)}
L2_DEFEAT_BYTES = 256 << 20  # K/V bytes per timed program: several times an H200's 50 MB L2


@dataclasses.dataclass(frozen=True)
class Plan:
    models: dict[str, tuple[int, int, int]]
    decode_b: tuple[int, ...]
    decode_s: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]  # (T, start)
    reps: int
    copy_bytes: int


FULL = Plan(MODELS, (1, 8, 32), (1024, 4096, 8192), ((512, 0), (512, 3584)), reps=20, copy_bytes=2 << 30)
TINY = Plan(TINY_MODELS, (1, 3), (128,), ((32, 0), (32, 96)), reps=3, copy_bytes=16 << 20)


def bucket(end: int) -> int:
    """The context bucket the runner would pick: the smallest power of two >= end, >= 512
    (the tiny plan's buckets are its S)."""
    s = 512
    while s < end:
        s *= 2
    return s


def time_program(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of fn() (blocked until ready), after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import jax
        import jax.numpy as jnp

        from pallas_kernels import attention, attention_triton, attention_triton_prefill

        self.jax, self.jnp = jax, jnp
        self.attention, self.triton, self.triton_prefill = attention, attention_triton, attention_triton_prefill
        self.args = args
        self.plan = TINY if args.tiny else FULL
        self.reps = args.reps or self.plan.reps
        self.key = jax.random.key(args.seed)
        # Reference outputs by shape key; inputs are drawn from a per-shape key, so a sweep's
        # configurations are checked against one reference run.
        self.reference_outs: dict[tuple, np.ndarray] = {}
        self.copy_gbps: float | None = None
        self.rows: list[dict[str, Any]] = []
        self.on_rows: Callable[[list[dict[str, Any]]], None] = lambda rows: None

    # -- implementations ------------------------------------------------------------------

    def decode_fn(self, impl: str, config=None, few_rows: bool = False) -> Callable:
        if impl == "reference":
            return self.attention.attention_decode_reference
        cfg = config or self.triton.DEFAULT_DECODE_CONFIG
        return lambda *a: self.triton.attention_decode_triton(*a, config=cfg, interpret=self.args.interpret,
                                                              few_rows=few_rows)

    def prefill_fn(self, impl: str, config=None) -> Callable:
        if impl == "reference":
            return self.attention.attention_prefill_reference
        cfg = config or self.triton_prefill.DEFAULT_PREFILL_CONFIG
        return lambda *a: self.triton_prefill.attention_prefill_triton(*a, config=cfg, interpret=self.args.interpret)

    def reseed(self, *shape_key: int) -> None:
        self.key = self.jax.random.fold_in(self.jax.random.key(self.args.seed), hash(shape_key) % 2**31)

    def normal(self, shape):
        """Standard normal bf16 drawn on the device (host numpy takes seconds per GB)."""
        self.key, sub = self.jax.random.split(self.key)
        return self.jax.random.normal(sub, shape, self.jnp.bfloat16)

    def num_copies(self, nbytes: int) -> int:
        if self.args.interpret:
            return 1  # each call site is its own interpret-mode program to compile
        return int(min(self.args.max_copies, max(1, -(-L2_DEFEAT_BYTES // nbytes))))

    # -- measurements ---------------------------------------------------------------------

    def measure_copy(self) -> None:
        self.copy_gbps = common.copy_bandwidth_gb_s(self.plan.copy_bytes)
        log.info("copy bandwidth %.0f GB/s (%d MiB buffer)", self.copy_gbps, self.plan.copy_bytes >> 20)

    def decode_inputs(self, b, s, h, k, d, copies, pos, active):
        self.reseed(b, s, h, k, d, pos, active)
        q = self.normal((b, h, d))
        kvs = [(self.normal((b, s, k, d)), self.normal((b, s, k, d))) for _ in range(copies)]
        # keys 0..pos visible in the first `active` rows; the others at position 0, as the
        # model's decode step passes its inactive slots
        positions = self.jnp.where(self.jnp.arange(b) < active, pos, 0).astype(self.jnp.int32)
        return q, kvs, positions

    def run_decode(self, model, b, s, impls=("triton", "reference"), config=None, extra=None,
                   pos: int | None = None, active: int | None = None, few_rows: bool = False) -> None:
        """B rows attending over [0, S): the first `active` (default all) at position `pos`
        (default S - 1: every key visible), the rest at position 0 (one key); `few_rows`: the
        Triton kernel's plan for few busy rows (the engine's decode program for up to
        `few_rows_limit` busy slots)."""
        jax = self.jax
        h, k, d = (MODELS | TINY_MODELS)[model]
        pos = s - 1 if pos is None else pos
        active = b if active is None else active
        # K and V, bf16, of the visible positions
        nbytes = (active * (pos + 1) + (b - active)) * k * d * 2 * 2
        copies = self.num_copies(b * s * k * d * 2 * 2)
        q, kvs, positions = self.decode_inputs(b, s, h, k, d, copies, pos, active)
        scale = d ** -0.5
        outs, first_row = {}, len(self.rows)
        for impl in impls:
            op = self.decode_fn(impl, config, few_rows)
            many = jax.jit(lambda q, kvs, p, op=op: [op(q, kc, vc, p, scale, 0) for kc, vc in kvs])
            one = jax.jit(lambda q, kc, vc, p, op=op: op(q, kc, vc, p, scale, 0))
            try:
                outs[impl] = np.asarray(one(q, *kvs[0], positions))
                if impl == "triton" and "reference" not in impls:
                    ref_fn = jax.jit(self.attention.attention_decode_reference, static_argnums=4)
                    outs["reference"] = self.reference_out(("decode", b, s, h, k, d, pos, active),
                                                           lambda: ref_fn(q, *kvs[0], positions, scale, 0))
                seconds = time_program(lambda: many(q, kvs, positions), self.reps) / copies
                device = self.device_time(lambda: many(q, kvs, positions), copies) if self.args.device_time else {}
            except Exception as e:  # noqa: BLE001 - a failed config is a result row, not the end of the run
                log.error("decode %s %s b=%d s=%d failed: %s", impl, model, b, s, e)
                self.rows.append(self.row("attention_decode", impl, model, b, s, h, k, d, pos=pos, active=active,
                                          error=str(e)[:300], **(extra or {})))
                continue
            gbps = nbytes / seconds / 1e9
            if device.get("device_us"):  # the same bytes over the kernels' own time
                device["gbps_device"] = nbytes / device["device_us"] / 1e3
                device["pct_hbm_device"] = 100 * device["gbps_device"] / self.copy_gbps if self.copy_gbps else None
            self.rows.append(self.row(
                "attention_decode", impl, model, b, s, h, k, d, pos=pos, active=active, us=seconds * 1e6,
                gbps=gbps, pct_hbm=100 * gbps / self.copy_gbps if self.copy_gbps else None,
                tflops=4 * h * d * (active * (pos + 1) + b - active) / seconds / 1e12, copies=copies, **device, **(extra or {}),
            ))
        self.fill_rel_err(first_row, outs)
        self.on_rows(self.rows)
        q = kvs = None  # the inputs' device buffers go before the next case's (a `del` here reads to pyflakes as
        # deleting the names the lambdas above use)

    def run_prefill(self, model, t, start, impls=("triton", "reference"), config=None, extra=None) -> None:
        jax, jnp = self.jax, self.jnp
        h, k, d = (MODELS | TINY_MODELS)[model]
        s = bucket(start + t) if not self.args.tiny else max(self.plan.decode_s)
        copies = 1 if self.args.interpret else 8  # compute-bound: the copies only amortise dispatch
        self.reseed(t, start, s, h, k, d)
        qs = [self.normal((t, h, d)) for _ in range(copies)]
        kc, vc = self.normal((s, k, d)), self.normal((s, k, d))
        start_arr = jnp.int32(start)
        scale = d ** -0.5
        pairs = sum(start + i + 1 for i in range(t))  # visible (query, key) pairs, causal
        outs, first_row = {}, len(self.rows)
        for impl in impls:
            op = self.prefill_fn(impl, config)
            many = jax.jit(lambda qs, kc, vc, p, op=op: [op(q, kc, vc, p, scale, 0) for q in qs])
            one = jax.jit(lambda q, kc, vc, p, op=op: op(q, kc, vc, p, scale, 0))
            try:
                outs[impl] = np.asarray(one(qs[0], kc, vc, start_arr))
                if impl == "triton" and "reference" not in impls:
                    ref_fn = jax.jit(self.attention.attention_prefill_reference, static_argnums=4)
                    outs["reference"] = self.reference_out(("prefill", t, start, s, h, k, d),
                                                           lambda: ref_fn(qs[0], kc, vc, start_arr, scale, 0))
                seconds = time_program(lambda: many(qs, kc, vc, start_arr), self.reps) / copies
            except Exception as e:  # noqa: BLE001
                log.error("prefill %s %s t=%d start=%d failed: %s", impl, model, t, start, e)
                self.rows.append(self.row("attention_prefill", impl, model, 1, s, h, k, d, t=t, start=start,
                                          error=str(e)[:300], **(extra or {})))
                continue
            self.rows.append(self.row(
                "attention_prefill", impl, model, 1, s, h, k, d, t=t, start=start, us=seconds * 1e6,
                tflops=4 * h * d * pairs / seconds / 1e12, copies=copies, **(extra or {}),
            ))
        self.fill_rel_err(first_row, outs)
        self.on_rows(self.rows)

    def device_time(self, fn: Callable[[], Any], copies: int) -> dict[str, Any]:
        """Device time of one op call from a profiler trace of `reps` calls of fn (a program of
        `copies` op calls): the sum of the kernels' durations per op call (launch gaps and the
        host's dispatch excluded, which the wall time of a short call is mostly made of), the
        kernels per call and the longest kernel's name."""
        with tempfile.TemporaryDirectory() as d:
            self.jax.profiler.start_trace(d)
            for _ in range(self.reps):
                self.jax.block_until_ready(fn())
            self.jax.profiler.stop_trace()
            events = common.device_trace_events(d)
        if not events:
            return {"device_error": "no device events in the trace"}
        calls = self.reps * copies
        by_name: dict[str, float] = {}
        for e in events:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e.get("dur", 0.0))
        return {"device_us": sum(by_name.values()) / calls, "kernels_per_call": len(events) / calls,
                "device_split_us": {n[:60]: round(t / calls, 2) for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:4]}}

    def reference_out(self, key: tuple, compute: Callable[[], Any]) -> np.ndarray:
        if key not in self.reference_outs:
            self.reference_outs[key] = np.asarray(compute())
        return self.reference_outs[key]

    def fill_rel_err(self, first_row: int, outs: dict[str, np.ndarray]) -> None:
        """rel_err of the rows from first_row on against the reference output of the same
        inputs (the reference's own row: 0); None where this run has no reference output."""
        ref = outs.get("reference")
        for row in self.rows[first_row:]:
            if ref is not None and row["impl"] in outs:
                row["rel_err"] = rel_err(outs[row["impl"]], ref)

    @staticmethod
    def row(op, impl, model, b, s, h, k, d, **fields) -> dict[str, Any]:
        out = {"op": op, "impl": impl, "model": model, "b": b, "s": s, "h": h, "k": k, "d": d,
               "us": None, "gbps": None, "pct_hbm": None, "tflops": None, "rel_err": None}
        out.update(fields)
        return out

    # -- plans ----------------------------------------------------------------------------

    def run_main(self) -> None:
        impls = ("triton",) if self.args.triton_only else ("triton", "reference")
        for model, b, s in itertools.product(self.plan.models, self.plan.decode_b, self.plan.decode_s):
            log.info("decode %s b=%d s=%d", model, b, s)
            self.run_decode(model, b, s, impls)
        for model, (t, start) in itertools.product(self.plan.models, self.plan.prefill):
            log.info("prefill %s t=%d start=%d", model, t, start)
            self.run_prefill(model, t, start, impls)

    def run_decode_sweep(self, shapes: list[tuple[str, int, int, int]]) -> None:
        """Decode configurations at engine-like positions: (model, B, position, active) rows
        attending over the context bucket of that position (`bucket`), as a decode step of the
        runner does (its inactive slots at position 0); the default config first. A config's
        `few_rows=true` is no config field: it runs the plan for few busy rows."""
        cfg_cls = self.triton.DecodeAttentionConfig
        if self.args.decode_configs:
            grid = [(cfg_cls(**{k: v for k, v in fields.items() if k != "few_rows"}), bool(fields.get("few_rows")))
                    for fields in self.args.decode_configs]
        else:
            grid = [(self.triton.DEFAULT_DECODE_CONFIG, False)]
            grid += [(cfg_cls(block_s=bs, num_warps=w, num_stages=st, num_splits=sp), False)
                     for bs, w, st, sp in itertools.product((32, 64, 128), (2, 4), (3,), (1, 4, 8))]
        for (model, b, pos, active), (cfg, few) in itertools.product(shapes, grid):
            s = bucket(pos + 1)
            log.info("sweep decode %s b=%d pos=%d active=%d s=%d %s%s", model, b, pos, active, s, cfg,
                     " few_rows" if few else "")
            self.run_decode(model, b, s, ("triton",), config=cfg, pos=pos, active=active, few_rows=few,
                            extra={"config": {**dataclasses.asdict(cfg), **({"few_rows": True} if few else {})}})

    def run_sweep(self) -> None:
        """Kernel configurations on a few shapes; the default config is included in each grid."""
        cfg_cls = self.triton.DecodeAttentionConfig
        if self.args.tiny:
            decode_shapes, decode_grid = [("tiny-gqa", 3, 128)], [cfg_cls(block_s=bs) for bs in (16, 32)]
        else:
            decode_shapes = [("llama3-8b", 8, 4096), ("llama2-7b", 32, 4096), ("llama3-8b", 1, 4096)]
            decode_grid = [cfg_cls(block_s=bs, num_warps=w, num_stages=st)
                           for bs, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
            decode_grid += [cfg_cls(target_programs=tp) for tp in (128, 512, 1024, 2048)]
        for (model, b, s), cfg in itertools.product(decode_shapes, decode_grid):
            log.info("sweep decode %s b=%d s=%d %s", model, b, s, cfg)
            self.run_decode(model, b, s, ("triton",), config=cfg, extra={"config": dataclasses.asdict(cfg)})
        pcfg = self.triton_prefill.PrefillAttentionConfig
        if self.args.tiny:
            prefill_shapes, prefill_grid = [("tiny-gqa", 32, 96)], [pcfg(block_t=16, block_k=16), pcfg()]
        else:
            prefill_shapes = [("llama3-8b", 512, 3584)]
            prefill_grid = [pcfg(block_t=bt, block_k=bk, num_warps=w, num_stages=st)
                            for bt, bk, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
        for (model, t, start), cfg in itertools.product(prefill_shapes, prefill_grid):
            log.info("sweep prefill %s t=%d start=%d %s", model, t, start, cfg)
            self.run_prefill(model, t, start, ("triton",), config=cfg, extra={"config": dataclasses.asdict(cfg)})


def fmt(value, spec: str) -> str:
    """format(value, spec), or "-" as wide as spec's width for a missing value."""
    width = int("".join(itertools.takewhile(str.isdigit, spec)) or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], copy_gbps: float | None, device: dict[str, Any]) -> None:
    print(f"\nattention on {device['device_kind']} (jax {device['jax']}); copy bandwidth "
          f"{fmt(copy_gbps, '.0f')} GB/s (read + write)")
    head = (f"{'op':8} {'impl':9} {'model':10} {'b':>3} {'s':>5} {'t@start':>9} {'us':>10} {'GB/s':>7} "
            f"{'%copy':>6} {'TFLOP/s':>8} {'rel_err':>8}  config")
    print(head)
    print("-" * len(head))
    for r in rows:
        ts = f"{r['t']}@{r['start']}" if "t" in r else (
            f"@{r['pos']}" + (f"x{r['active']}" if r.get("active") not in (None, r["b"]) else "")
            if r.get("pos") is not None else "-")
        cfg = r.get("config")
        cfg_s = ",".join(f"{k}={v}" for k, v in cfg.items() if v is not None) if cfg else ""
        if r.get("error"):
            cfg_s = f"FAILED: {r['error'][:80]} {cfg_s}"
        if r.get("device_us") is not None:
            pct = f" = {r['pct_hbm_device']:.1f}% of copy" if r.get("pct_hbm_device") is not None else ""
            cfg_s = f"device {r['device_us']:.2f} us{pct}, {r['kernels_per_call']:.0f} kernels; {cfg_s}"
        print(f"{r['op'].removeprefix('attention_'):8} {r['impl']:9} {r['model']:10} {r['b']:>3} {r['s']:>5} "
              f"{ts:>9} {fmt(r['us'], '10.1f')} {fmt(r['gbps'], '7.0f')} {fmt(r['pct_hbm'], '6.1f')} "
              f"{fmt(r['tflops'], '8.2f')} {fmt(r['rel_err'], '8.1e')}  {cfg_s}")


def parse_decode_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """MODEL:B:POS[:ACTIVE],...: B rows, the first ACTIVE (default B) at POS, the rest at 0."""
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise argparse.ArgumentTypeError(f"want MODEL:B:POS[:ACTIVE], got {item!r}")
        model, b, pos = parts[0], int(parts[1]), int(parts[2])
        active = int(parts[3]) if len(parts) == 4 else b
        if model not in MODELS | TINY_MODELS:
            raise argparse.ArgumentTypeError(f"unknown model {model!r}; one of {sorted(MODELS | TINY_MODELS)}")
        if not 1 <= active <= b:
            raise argparse.ArgumentTypeError(f"active rows {active} outside [1, {b}] in {item!r}")
        shapes.append((model, b, pos, active))
    return shapes


def parse_configs(text: str) -> list[dict[str, int | bool]]:
    """'default;num_splits=1;block_s=32,num_warps=4' -> [{}, {"num_splits": 1}, {...}]; FIELD=true|false gives a bool."""
    configs = []
    for item in text.split(";"):
        fields: dict[str, int | bool] = {}
        if item.strip() != "default":
            for pair in item.split(","):
                key, _, value = pair.partition("=")
                value = value.strip().lower()
                if value in ("true", "false"):
                    fields[key.strip()] = value == "true"
                    continue
                try:
                    fields[key.strip()] = int(value)
                except ValueError:
                    raise argparse.ArgumentTypeError(f"want FIELD=INT or FIELD=true|false in {item!r}, "
                                                     f"got {pair!r}") from None
        configs.append(fields)
    return configs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke test)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of kernel configurations")
    ap.add_argument("--sweep-only", action="store_true", help="only the configuration sweep")
    ap.add_argument("--sweep-decode", type=parse_decode_shapes, default=[],
                    help="only a decode configuration sweep at MODEL:B:POSITION[:ACTIVE][,...] (e.g. llama2-7b:8:200:1); "
                         "the main plan and --sweep are skipped")
    ap.add_argument("--decode-configs", type=parse_configs, default=None,
                    help="--sweep-decode times these configurations instead of its grid: ';'-separated, each "
                         "'default' or DecodeAttentionConfig fields (e.g. 'default;num_splits=1;block_s=32,"
                         "num_splits=8'), few_rows=true among them for the plan for few busy rows")
    ap.add_argument("--device-time", action="store_true",
                    help="decode rows also get device_us: kernel time per call from a profiler trace")
    ap.add_argument("--triton-only", action="store_true", help="skip the reference rows")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per program (0: plan default)")
    ap.add_argument("--max-copies", type=int, default=16, help="most K/V buffers per timed program")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import jax

    if not args.interpret and jax.default_backend() != "gpu":
        print("no GPU: run with --interpret (and --tiny) on the CPU", file=sys.stderr)
        return 2
    device = common.device_info()
    stamp = common.timestamp()
    path = common.result_path(args.out, "attention", stamp)
    bench = Bench(args)
    bench.measure_copy()
    meta = {"device": device, "git": common.git_rev(), "copy_gbps": bench.copy_gbps, "interpret": args.interpret,
            "tiny": args.tiny, "reps": bench.reps, "stamp": stamp}
    # Rewritten after every shape, so a run cut short still leaves its rows.
    bench.on_rows = lambda rows: common.write_json(path, {"meta": meta, "rows": rows})
    if args.sweep_decode:
        bench.run_decode_sweep(args.sweep_decode)
    elif not args.sweep_only:
        bench.run_main()
    if (args.sweep or args.sweep_only) and not args.sweep_decode:
        bench.run_sweep()
    common.write_json(path, {"meta": meta, "rows": bench.rows})
    print(f"wrote {path}")
    print_table(bench.rows, bench.copy_gbps, device)
    # A sweep configuration may fail (e.g. too much shared memory): that is a result; the
    # default configuration failing is not.
    failed = [r for r in bench.rows if r.get("error") and "config" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
