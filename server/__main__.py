"""`python -m server`: flags and environment -> `EngineConfig` + `ServerConfig` -> uvicorn.

The only place that reads the environment (PALLAS_SERVE_API_KEY; the model cache location is
read by `server.default_model`). HTTP comes up at once; the engine is built on a loader thread,
so /health answers "loading" meanwhile. By default the engine runs in a process of its own
(`scheduler.engine_process`: this process loads only the tokenizer and never imports JAX), so
that the event loop and the engine thread do not share one interpreter lock;
`--no-engine-process` (and a multi-process job, `--coordinator`) runs it on a thread here, built
by `scheduler.loader.build_engine(model_path, engine_config, chat_template_path)`.

Shutdown (SIGINT/SIGTERM, handled by uvicorn): no new connections; open requests get
`ServerConfig.shutdown_grace_s` to finish; then the engine is shut down, which ends every
remaining stream with an error frame and [DONE] (rather than uvicorn cancelling their tasks),
and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import math
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Callable, Sequence

import uvicorn

from model.chat_template import ChatTemplateError, load_template
from model.config import KV_DTYPES, NUMERICS, SPLIT_Q4_K, UNROLL_DECODE_LAYERS, EngineConfig, prefill_chunks_for
from server import reasoning, tool_calls
from server.app import EngineHolder, create_app
from server.config import LOG_LEVELS, ServerConfig
from server.default_model import FILENAME as DEFAULT_MODEL_FILENAME
from server.default_model import ModelFetchError, cache_dir, ensure_default_model

if TYPE_CHECKING:
    from scheduler.engine import Engine
    from scheduler.engine_process import EngineProcess

log = logging.getLogger("server")

API_KEY_ENV = "PALLAS_SERVE_API_KEY"


def parse_kernels(value: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in value.split(","):
        op, sep, impl = item.strip().partition("=")
        if not sep or not op or not impl:
            raise argparse.ArgumentTypeError(f"expected op=impl[,op=impl...], got {item!r}")
        pairs.append((op, impl))
    return tuple(pairs)


def parse_sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(v) for v in value.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes N[,N...], got {value!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {value!r}")
    return sizes


def add_engine_arguments(p: argparse.ArgumentParser, numerics: str = "auto") -> None:
    """The flags the EngineConfig is made of (`engine_config_from_args`): the server's, and the
    bench scripts' that build an engine of their own (bench/engine.py, bench/trace_step.py), so
    that a flag, its default and its mapping live here only. `numerics`: the --numerics default
    (the benches, which measure speed, pass native)."""
    p.add_argument("--slots", type=int, default=8, help="concurrent sequences (decode batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--prefill-budget", type=int, default=512, help="prompt tokens per engine step")
    p.add_argument("--prefill-chunks", type=parse_sizes, default=EngineConfig.prefill_chunks, metavar="N[,N...]",
                   help="compiled prompt chunk sizes (a chunk runs at the smallest size that holds it); "
                        "default %(default)s")
    p.add_argument("--max-context", type=int, default=4096, help="tokens per sequence (capped at the model's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--kernels", type=parse_kernels, default=(), help="force kernels: op=impl[,op=impl...]")
    p.add_argument("--decode-steps", type=int, default=0, metavar="N",
                   help="decode steps per device dispatch while no prompt is waiting (one lax.scan program; "
                        "0 = auto: 1)")
    p.add_argument("--dispatch-ahead", type=int, default=1, metavar="N",
                   help="programs kept queued on the device beyond the one whose tokens the engine is reading")
    p.add_argument("--unroll-decode-layers", default="auto", choices=UNROLL_DECODE_LAYERS,
                   help="unroll the decode program's layer loop (auto: on GPU only)")
    p.add_argument("--compile-threads", type=int, default=0, metavar="N",
                   help="threads compiling the step programs at start (0 = auto: one per usable core, at most 8 "
                        "on CPU and 4 on GPU)")
    p.add_argument("--few-rows-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="decode attention planned for few busy slots (3 of 8 to 24 for a 7B in context buckets "
                        "of 1024+ keys, of 32 from 2048; a quarter with GQA in buckets over 2048), where the "
                        "kernel has such a plan: faster for a lone long-context user, the same tokens (default on; "
                        "one more compile per such bucket)")
    p.add_argument("--constrained-overlap", default="auto", choices=("auto", "on", "off"),
                   help="constrained decoding: run a step's forward pass while the host reads the token its allowed "
                        "tokens follow, sampling after (two programs a step; auto: on a GPU with one device), or read "
                        "the token first (off)")
    p.add_argument("--draft-max", type=int, default=0, metavar="N",
                   help="speculative decoding by prompt lookup: a request checks up to N "
                        "drafts of its next tokens per step (the tokens that followed its last n-gram where it "
                        "occurred before) in the rows idle slots leave; the same tokens as without (0 = off; at most "
                        "--slots - 1)")
    p.add_argument("--ngram-max", type=int, default=3, metavar="N",
                   help="longest n-gram the speculative decode looks up (--draft-max)")
    p.add_argument("--ngram-min", type=int, default=1, metavar="N",
                   help="shortest n-gram the speculative decode looks up (--draft-max)")
    p.add_argument("--draft-min-gain", type=float, default=0.1, metavar="X",
                   help="a request whose drafts lately gave fewer than X accepted tokens per step stops "
                        "speculating, trying again every 8 steps, so that text without repeats runs the plain "
                        "decode, which costs less (0 = always speculate; --draft-max)")
    p.add_argument("--separate-kv-write", action="store_true",
                   help="write each decode step's keys and values with XLA scatters before the attention kernel, "
                        "not inside it (for A/B measurements)")
    p.add_argument("--no-gather-x", dest="gather_x", action="store_false",
                   help="permute the output and down projections' x for the Mosaic GPU matmul by a transpose, not "
                        "a gather XLA fuses into the ops before it (for A/B measurements)")
    p.add_argument("--no-ordered-values", dest="ordered_values", action="store_false",
                   help="keep the value rows in the model's order, so that the attention's output is permuted for "
                        "the Mosaic GPU matmul by a kernel of its own (for A/B measurements)")
    p.add_argument("--no-gated-ffn", dest="gated_ffn", action="store_false",
                   help="keep the gate/up rows in the model's order, so that the gated activation is a kernel of its "
                        "own rather than the Mosaic GPU matmul's epilogue (for A/B measurements)")
    p.add_argument("--no-prefill-cuda-graphs", dest="prefill_cuda_graphs", action="store_false",
                   help="compile the prefill programs without XLA's command buffers (CUDA graphs; for A/B "
                        "measurements)")
    p.add_argument("--no-host-outputs", dest="host_outputs", action="store_false",
                   help="leave the prefill programs' outputs in device memory for the host to copy, rather than "
                        "have the programs write them to pinned host memory (for A/B measurements; the decode "
                        "programs' outputs stay in device memory either way)")
    p.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="prefill every prompt whole, rather than reuse the whole chunks a free slot's cache "
                        "holds of its start (the same tokens either way; for A/B measurements)")
    p.add_argument("--no-prompt-logprobs", dest="prompt_logprobs", action="store_false",
                   help="refuse prompt logprobs (echo with logprobs, prompt_logprobs) and embeddings, and save the "
                        "compiles of their prefill programs (one per prefill chunk size and context bucket)")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="leave the heap loading built to Python's cyclic GC (by default it is frozen after warm-up, "
                        "so that full collections, which stall every thread, scan only what requests allocate)")
    p.add_argument("--reuse-kernel-lowering", action=argparse.BooleanOptionalAction, default=True,
                   help="lower each Mosaic GPU matmul kernel once for all step programs rather than once per "
                        "program (one GPU; on by default: a 7B's start-up on the H200 40%% shorter)")
    p.add_argument("--split-q4-k", nargs="?", const="on", default="auto", choices=SPLIT_Q4_K,
                   help="split Q4_K matrices at load for Q4_0's kernels (Q4_0 codes, bf16 block scales, bf16 offsets: "
                        "11%% more weight bytes); auto (default): where Q4_0's Mosaic GPU matmul serves them (one "
                        "Hopper GPU, the matmul not forced elsewhere) or a forced jax_triton one; the bare flag "
                        "means on")
    p.add_argument("--split-q5-k", nargs="?", const="on", default="auto", choices=SPLIT_Q4_K,
                   help="split Q5_K matrices at load for Q8_0's kernels (int8 codes, f16 block scales, f16 "
                        "offsets: 64%% more weight bytes); auto (default) and the bare flag as --split-q4-k")
    p.add_argument("--split-legacy", nargs="?", const="on", default="auto", choices=SPLIT_Q4_K,
                   help="Q4_1, Q5_0 and Q5_1 matrices at load in forms the Mosaic GPU matmul takes (Q5_0 as "
                        "Q8_0, exactly, 55%% more bytes; Q4_1 as Q4_0's codes with bf16 scales and offsets, 0%% "
                        "more; Q5_1 as Q8_0's codes and scales plus f16 offsets, 50%% more), where the Mosaic kernel "
                        "takes the shape (else Triton's kernels for the format); auto (default) and the bare flag "
                        "as --split-q4-k")
    p.add_argument("--split-q6-k", nargs="?", const="on", default="auto", choices=SPLIT_Q4_K,
                   help="split Q6_K matrices at load for the Mosaic GPU matmul: 6-bit codes in two planes and "
                        "f16 scales per 16 weights (7%% more weight bytes; int8 codes, 37%% more, with "
                        "--q6-k-split-bits 8); "
                        "auto (default) and the bare flag as --split-q4-k")
    p.add_argument("--q6-k-split-bits", type=int, default=EngineConfig.q6_k_split_bits, choices=(6, 8),
                   help="the Q6_K split's codes: 6 bits in two planes (0.875 bytes per weight) or int8 (1.125, "
                        "the one the jax-triton matmul takes, which keeps it when forced); default %(default)s")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="KV cache dtype (auto: on CPU float16, llama.cpp's, or float32 with --numerics native; bfloat16 "
                        "on GPU; float8_e4m3fn: 8-bit float, half "
                        "of bfloat16's memory and attention reads, values saturating at +-448)")
    p.add_argument("--numerics", default=numerics, choices=NUMERICS,
                   help="ggml: on the CPU, round every op as llama.cpp's x86-64 CPU build does, so that greedy "
                        "tokens equal llama.cpp's on the same file (f16 cache; Q4_1 matrices, a Q8_0 or Q4_1 "
                        "embedding and head; far slower than native); native: each op's own arithmetic; "
                        f"auto: ggml where it is reproduced, else native (default: {numerics})")
    p.add_argument("--ggml-threads", type=int, default=2, metavar="N",
                   help="with --numerics ggml: the thread count of the llama.cpp run to match (its decode "
                        "attention over 512 or more cached tokens splits them between its threads)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices of this host (or of every host after jax.distributed)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of `add_engine_arguments`' flags."""
    return EngineConfig(
        num_slots=args.slots,
        max_context=args.max_context,
        prefill_budget=args.prefill_budget,
        prefill_chunks=prefill_chunks_for(args.prefill_budget, args.prefill_chunks),
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        kernels=args.kernels,
        kv_dtype=args.kv_dtype,
        numerics=args.numerics,
        ggml_threads=args.ggml_threads,
        tensor_parallel=args.tensor_parallel,
        compile_threads=args.compile_threads,
        decode_steps_per_dispatch=args.decode_steps,
        dispatch_ahead=args.dispatch_ahead,
        unroll_decode_layers=args.unroll_decode_layers,
        few_rows_attention=args.few_rows_attention,
        constrained_overlap=args.constrained_overlap,
        prompt_cache=args.prompt_cache,
        prompt_logprobs=args.prompt_logprobs,
        draft_max=args.draft_max,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        draft_min_gain=args.draft_min_gain,
        separate_kv_write=args.separate_kv_write,
        gather_x=args.gather_x,
        ordered_values=args.ordered_values,
        gated_ffn=args.gated_ffn,
        reuse_kernel_lowering=args.reuse_kernel_lowering,
        prefill_cuda_graphs=args.prefill_cuda_graphs,
        gc_freeze=args.gc_freeze,
        host_outputs=args.host_outputs,
        split_q4_k=args.split_q4_k,
        split_q5_k=args.split_q5_k,
        split_q6_k=args.split_q6_k,
        q6_k_split_bits=args.q6_k_split_bits,
        split_legacy=args.split_legacy,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API.",
        allow_abbrev=False,  # a misspelt flag is an error, not a guess
    )
    p.add_argument("--model", type=pathlib.Path, help="GGUF file (default: SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    add_engine_arguments(p)
    p.add_argument("--api-key", help=f"require Authorization: Bearer KEY (also ${API_KEY_ENV})")
    p.add_argument("--chat-template", type=pathlib.Path, help="Jinja chat template replacing the GGUF's")
    p.add_argument("--tool-call-parser", default="auto", choices=tool_calls.CHOICES,
                   help="how chat replies to requests with tools are read for calls (returned as tool_calls): "
                        "auto (the chat template's format: hermes <tool_call> tags, llama3_json, mistral), "
                        "a format by name, or none (calls stay text)")
    p.add_argument("--reasoning-format", default="auto", choices=reasoning.CHOICES,
                   help="chat replies' <think>...</think> as reasoning_content: auto (where the chat template names "
                        "</think>), deepseek (always), none (thoughts stay in content); requests may set "
                        "reasoning_format")
    p.add_argument("--pooling", default="auto", choices=("auto", "mean", "last"),
                   help="how /v1/embeddings pools the prompt's normed last hidden states: auto (the GGUF's "
                        "pooling_type where it is mean or last, else last, as vLLM does for a decoder), mean over "
                        "the tokens, or the last token's")
    p.add_argument("--spm-infill", action="store_true",
                   help="/infill's (and a /v1/completions suffix's) fill-in-the-middle prompt in the suffix, "
                        "prefix, middle order that some code models were trained in (default: prefix, suffix, "
                        "middle)")
    p.add_argument("--slot-save-path", type=pathlib.Path, default=None, metavar="DIR",
                   help="enable llama-server's slot actions (POST /slots/N?action=save|restore|erase): an idle "
                        "slot's cached prompt saved to a file in DIR (created if missing) and restored from it")
    p.add_argument("--compile-cache", type=pathlib.Path, default=None,
                   help="JAX persistent compilation cache directory (default: in the model cache; 'none' disables)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="serve from several processes (hosts): process 0's address for jax.distributed; "
                        "with --num-processes and --process-id. Process 0 serves HTTP, the others follow it")
    p.add_argument("--num-processes", type=int, metavar="N", help="processes in the job (with --coordinator)")
    p.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (with --coordinator)")
    p.add_argument("--switch-interval-ms", type=float, default=None, metavar="MS",
                   help="Python's thread switch interval (sys.setswitchinterval): how long the event loop may "
                        "hold the GIL while the engine thread waits for it (default: Python's, 5 ms)")
    p.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine on a thread of the HTTP process rather than in a process of its own "
                        "(where they share one interpreter lock; always so with --coordinator)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--fetch-model", action="store_true", help="download the default model into the cache and exit")
    return p


def check_distributed(args: argparse.Namespace) -> None:
    """Raises ValueError unless --coordinator, --num-processes and --process-id come together and fit."""
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if not any(given):
        return
    if not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    if args.num_processes < 2:
        raise ValueError("--num-processes must be >= 2")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, {args.num_processes})")


def _join_processes(args: argparse.Namespace) -> int:
    """jax.distributed.initialize, before anything else starts JAX's backends; returns the number
    of devices of all processes."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backends: collectives across processes
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    log.info("process %d of %d; %d devices in all", jax.process_index(), jax.process_count(), jax.device_count())
    return jax.device_count()


def _use_compile_cache(compile_cache: pathlib.Path | None) -> None:
    if compile_cache is not None:
        import jax

        # Compiled step programs persist across restarts: a warm start skips XLA compilation.
        jax.config.update("jax_compilation_cache_dir", str(compile_cache))
        log.info("persistent compilation cache: %s", compile_cache)


def _follow(model: pathlib.Path | None, engine_config: EngineConfig, compile_cache: pathlib.Path | None) -> int:
    from scheduler.loader import run_follower

    _use_compile_cache(compile_cache)
    steps = run_follower(model if model is not None else ensure_default_model(), engine_config)
    log.info("process 0 stopped; ran %d steps", steps)
    return 0


def build_configs(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> tuple[EngineConfig, ServerConfig]:
    """Raises ValueError for values the configs refuse (ChatTemplateError for a bad template file)."""
    check_distributed(args)
    engine_config = engine_config_from_args(args)
    model_name = args.model.name if args.model is not None else DEFAULT_MODEL_FILENAME
    server_config = ServerConfig(
        model_name=model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key if args.api_key is not None else (environ.get(API_KEY_ENV) or None),
        chat_template=load_template(args.chat_template) if args.chat_template is not None else None,
        tool_call_parser=args.tool_call_parser,
        reasoning_format=args.reasoning_format,
        pooling=args.pooling,
        spm_infill=args.spm_infill,
        slot_save_path=str(args.slot_save_path) if args.slot_save_path is not None else None,
        log_level=args.log_level,
    )
    return engine_config, server_config


def _build_engine(
    model: pathlib.Path | None, engine_config: EngineConfig, chat_template: pathlib.Path | None,
    compile_cache: pathlib.Path | None,
) -> Engine:
    """Runs on the loader thread, so /health answers while the model downloads and loads."""
    # Imported here: it pulls in JAX, which `--help` and argument errors should not pay for.
    from scheduler.loader import build_engine

    _use_compile_cache(compile_cache)
    model_path = model if model is not None else ensure_default_model()
    log.info("loading %s", model_path)
    return build_engine(model_path, engine_config, chat_template)


def _open_engine_process(
    model: pathlib.Path | None, engine_config: EngineConfig, compile_cache: pathlib.Path | None,
    log_level: str, switch_interval_s: float | None,
) -> EngineProcess:
    """The loader thread's factory by default: the engine in a process of its own
    (scheduler/engine_process.py); only the tokenizer loads here, and JAX is never imported."""
    from scheduler.engine_process import EngineSpec, open_engine_process

    model_path = model if model is not None else ensure_default_model()
    log.info("loading %s in an engine process", model_path)
    spec = EngineSpec(
        model_path=str(model_path), engine_config=engine_config,
        compile_cache=str(compile_cache) if compile_cache is not None else None,
        log_level=log_level, switch_interval_s=switch_interval_s,
    )
    return open_engine_process(spec)


def engine_factory(args: argparse.Namespace, engine_config: EngineConfig) -> Callable[[], Engine | EngineProcess]:
    """What the loader thread calls: the engine in a process of its own, unless --no-engine-process
    or a multi-process job (process 0 then drives the others' step loops from this process)."""
    compile_cache = _compile_cache_dir(args.compile_cache)
    if args.engine_process and args.coordinator is None:
        switch_interval_s = args.switch_interval_ms / 1000 if args.switch_interval_ms is not None else None
        return functools.partial(
            _open_engine_process, args.model, engine_config, compile_cache, args.log_level, switch_interval_s)
    return functools.partial(_build_engine, args.model, engine_config, args.chat_template, compile_cache)


def _compile_cache_dir(flag: pathlib.Path | None) -> pathlib.Path | None:
    if flag is not None and str(flag).lower() == "none":
        return None
    return flag if flag is not None else cache_dir() / "jax-compile-cache"


class _Server(uvicorn.Server):
    """uvicorn whose graceful shutdown ends requests still open after the grace period through
    the engine, so their clients get a proper end instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, holder: EngineHolder, server_config: ServerConfig) -> None:
        super().__init__(config)
        self._holder = holder
        self._server_config = server_config

    async def shutdown(self, sockets: list | None = None) -> None:
        ender = asyncio.create_task(self._end_requests_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_requests_after_grace(self) -> None:
        await asyncio.sleep(self._server_config.shutdown_grace_s)
        engine = self._holder.engine
        if engine is not None:
            log.warning("ending requests still open after %.0f s", self._server_config.shutdown_grace_s)
            await asyncio.to_thread(engine.shutdown, self._server_config.engine_shutdown_timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.fetch_model:
        try:
            path = ensure_default_model()
        except ModelFetchError as e:
            log.error("%s", e)
            return 1
        log.info("default model: %s", path)
        return 0
    try:
        engine_config, server_config = build_configs(args, os.environ)
    except ChatTemplateError as e:
        parser.error(f"--chat-template: {e}")
    except ValueError as e:
        parser.error(str(e))
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model: no such file {args.model}")
    if args.slot_save_path is not None:
        try:
            args.slot_save_path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--slot-save-path: {e}")

    if args.switch_interval_ms is not None:
        if not (math.isfinite(args.switch_interval_ms) and 0.001 <= args.switch_interval_ms <= 1000):
            parser.error("--switch-interval-ms must be between 0.001 and 1000")  # Python rounds below 1 us to 0
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    log.info("engine config: %s", dataclasses.asdict(engine_config))
    if args.coordinator is not None:
        devices = _join_processes(args)
        if engine_config.tensor_parallel != devices:
            log.error("with several processes, --tensor-parallel must be the number of devices of all of "
                      "them (%d), got %d", devices, engine_config.tensor_parallel)
            return 2
        if args.process_id != 0:
            return _follow(args.model, engine_config, _compile_cache_dir(args.compile_cache))
    holder = EngineHolder()
    app = create_app(server_config, holder, engine_factory=engine_factory(args, engine_config))
    uvicorn_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        lifespan="on",
        # A backstop: by then the engine has ended every stream (see _Server).
        timeout_graceful_shutdown=int(server_config.shutdown_grace_s + server_config.engine_shutdown_timeout_s),
        log_config=None,  # keep the logging set up above
    )
    log.info("listening on http://%s:%d; the model loads in the background", server_config.host, server_config.port)
    _Server(uvicorn_config, holder, server_config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
