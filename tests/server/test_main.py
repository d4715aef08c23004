"""`python -m server`: flags -> configs. Subprocesses for --help and a bad flag; the rest in-process."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import unittest.mock

import pytest

from model.config import MAX_AUTO_COMPILE_THREADS
from model.loader import split_formats
from server.__main__ import (
    _build_engine, _open_engine_process, build_configs, build_parser, engine_factory, prefill_chunks_for)
from server.default_model import cache_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_help() -> None:
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--model", "--slots", "--max-queue", "--prefill-budget", "--max-context", "--api-key", "--kernels", "--fetch-model"):
        assert flag in proc.stdout


def test_unknown_flag_is_an_error() -> None:
    proc = _run("--no-such-flag")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in proc.stderr


def test_abbreviated_flag_is_an_error() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--slot", "4"])


def test_defaults() -> None:
    engine, server = build_configs(build_parser().parse_args([]), {})
    assert (engine.num_slots, engine.max_queue, engine.prefill_budget, engine.max_context) == (8, 64, 512, 4096)
    assert engine.timeout_s == 600 and engine.kernels == () and engine.prefill_chunks == (64, 128, 256, 512)
    assert (server.host, server.port, server.api_key, server.chat_template) == ("127.0.0.1", 8080, None, None)
    assert server.tool_call_parser == "auto" and server.reasoning_format == "auto"
    assert server.model_name.endswith(".gguf")
    assert engine.unroll_decode_layers == "auto"
    assert engine.unrolls_decode("gpu") and not engine.unrolls_decode("cpu")
    assert engine.decode_steps_per_dispatch == 0 and engine.decode_steps() == 1  # 0: auto
    assert engine.dispatch_ahead == 1
    assert engine.few_rows_attention  # the same tokens under either plan (the kernel's chunked fold)
    assert (engine.numerics, engine.ggml_threads) == ("auto", 2)  # llama.cpp's arithmetic where reproduced
    assert not engine.separate_kv_write  # the attention kernel writes the keys and values where it can
    assert engine.gather_x
    assert engine.ordered_values  # values stored in the output projection's x order where that helps
    assert engine.gated_ffn  # the gated activation in the gate/up matmul where it makes it
    # Q4_K, Q5_K, Q6_K, Q4_1, Q5_0 and Q5_1 split where the Mosaic GPU matmul serves them: one Hopper GPU,
    # the matmul not forced elsewhere
    every = {"q4_k", "q5_k", "q6_k6", "q4_1", "q5_0", "q5_1"}  # Q6_K to its 6-bit split (`Q6_K_SPLIT6`)
    assert engine.split_q4_k == engine.split_q5_k == engine.split_q6_k == engine.split_legacy == "auto"
    no_legacy = build_configs(build_parser().parse_args(["--split-legacy", "off"]), {})[0]
    assert split_formats(no_legacy, True) == {"q4_k", "q5_k", "q6_k6"} and split_formats(no_legacy, False) == set()
    assert engine.reuse_kernel_lowering and engine.prefill_cuda_graphs and engine.gc_freeze
    assert engine.prompt_logprobs and engine.prompt_cache
    assert split_formats(engine) == set() and split_formats(engine, mosaic_available=True) == every
    for other in (dataclasses.replace(engine, kernels=(("matmul", "triton"),)),
                  dataclasses.replace(engine, tensor_parallel=2)):
        assert split_formats(other, mosaic_available=True) == set()
    mosaic = dataclasses.replace(engine, kernels=(("matmul", "mosaic_gpu"),))
    assert split_formats(mosaic, mosaic_available=True) == every
    jax_triton = dataclasses.replace(engine, kernels=(("matmul", "jax_triton"),))  # every split form but the 6-bit Q6_K
    eight = every - {"q6_k6"} | {"q6_k"}
    assert split_formats(jax_triton, mosaic_available=False, jax_triton_available=True) == eight
    assert split_formats(jax_triton, mosaic_available=True, jax_triton_available=False) == set()
    half = dataclasses.replace(engine, kernels=(("matmul_decode", "jax_triton"),))  # prefill: the Mosaic kernel's
    assert split_formats(half, True, True) == eight
    assert split_formats(half, False, True) == split_formats(half, True, False) == set()
    prefill_elsewhere = (("matmul_decode", "mosaic_gpu"), ("matmul", "triton"))  # Triton takes no Q6_K split
    assert split_formats(dataclasses.replace(engine, kernels=prefill_elsewhere), mosaic_available=True) == set()
    off = build_configs(build_parser().parse_args(["--split-q4-k", "off", "--split-q5-k", "off", "--split-legacy", "off",
                                                   "--split-q6-k", "on"]), {})[0]
    assert split_formats(off, True) == split_formats(off, False) == {"q6_k6"}
    # the 8-bit Q6_K split in place of the 6-bit one when asked
    assert engine.q6_k_split_bits == 6
    bits8 = build_configs(build_parser().parse_args(["--q6-k-split-bits", "8"]), {})[0]
    assert split_formats(bits8, mosaic_available=True) == eight
    with pytest.raises(ValueError, match="6 or 8"):
        dataclasses.replace(engine, q6_k_split_bits=4)
    bare = build_configs(build_parser().parse_args(["--split-q5-k"]), {})[0]
    assert bare.split_q5_k == "on" and split_formats(bare, False) == {"q5_k"}
    # 0: auto, one thread per usable core up to the backend's cap (never more than programs);
    # one on a backend not measured
    assert engine.compile_threads == 0
    cores = len(os.sched_getaffinity(0))
    for backend in ("cpu", "gpu"):
        assert engine.compile_workers(backend, 1000) == min(cores, MAX_AUTO_COMPILE_THREADS[backend])
        assert engine.compile_workers(backend, 1) == 1
    assert engine.compile_workers("tpu", 12) == 1
    with unittest.mock.patch("model.config._usable_cores", return_value=16):  # the caps themselves
        assert (engine.compile_workers("cpu", 12), engine.compile_workers("gpu", 12)) == (8, 4)


def test_the_engine_runs_in_a_process_of_its_own_by_default() -> None:
    def factory(argv: list[str]):
        args = build_parser().parse_args(argv)
        return engine_factory(args, build_configs(args, {})[0])

    default = factory(["--switch-interval-ms", "2"])
    assert default.func is _open_engine_process
    assert default.args[2:] == (cache_dir() / "jax-compile-cache", "info", 0.002)  # cache, log level, interval
    assert factory(["--no-engine-process"]).func is _build_engine
    distributed = ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"]
    assert factory(distributed).func is _build_engine  # process 0 drives the others' step loops


def test_flags(tmp_path: pathlib.Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(
        [
            "--model", str(tmp_path / "m.gguf"), "--host", "0.0.0.0", "--port", "0", "--slots", "4",
            "--max-queue", "0", "--prefill-budget", "256", "--max-context", "1024", "--timeout", "30",
            "--kernels", "attention=xla, matmul=triton", "--chat-template", str(template), "--log-level", "debug",
            "--unroll-decode-layers", "off", "--decode-steps", "4", "--compile-threads", "3", "--dispatch-ahead", "3",
            "--no-few-rows-attention", "--separate-kv-write", "--split-q4-k", "--no-reuse-kernel-lowering",
            "--no-prefill-cuda-graphs", "--no-gc-freeze", "--no-gather-x", "--no-ordered-values",
            "--no-gated-ffn", "--tool-call-parser", "llama3_json", "--reasoning-format", "none",
            "--no-prompt-logprobs", "--no-prompt-cache", "--slot-save-path", str(tmp_path / "slots"),
        ]
    )  # fmt: skip
    engine, server = build_configs(args, {})
    assert (engine.num_slots, engine.max_queue, engine.prefill_budget, engine.max_context) == (4, 0, 256, 1024)
    assert engine.prefill_chunks == (64, 128, 256) and engine.timeout_s == 30
    assert engine.kernels == (("attention", "xla"), ("matmul", "triton"))
    assert engine.unroll_decode_layers == "off" and not engine.unrolls_decode("gpu")
    assert engine.decode_steps() == 4
    assert engine.dispatch_ahead == 3
    assert engine.compile_workers("gpu", 12) == engine.compile_workers("cpu", 12) == 3
    assert engine.compile_workers("gpu", 2) == 2
    assert not engine.few_rows_attention and engine.separate_kv_write and engine.split_q4_k == "on"
    assert not engine.reuse_kernel_lowering and not engine.prefill_cuda_graphs and not engine.gc_freeze
    assert not engine.gather_x and not engine.ordered_values and not engine.gated_ffn
    assert not engine.prompt_logprobs and not engine.prompt_cache
    assert split_formats(engine, mosaic_available=False) == {"q4_k"}  # "on" splits whatever serves it
    assert (server.model_name, server.host, server.port, server.log_level) == ("m.gguf", "0.0.0.0", 0, "debug")
    assert server.chat_template == "{{ messages[0]['content'] }}"
    assert server.tool_call_parser == "llama3_json" and server.reasoning_format == "none"
    assert server.slot_save_path == str(tmp_path / "slots")
    assert build_configs(build_parser().parse_args([]), {})[1].slot_save_path is None


def test_a_slot_save_path_that_cannot_be_made_exits(tmp_path: pathlib.Path) -> None:
    from server.__main__ import main

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        main(["--slot-save-path", str(tmp_path / "file" / "slots")])


def test_api_key_from_flag_or_environment() -> None:
    parse = build_parser().parse_args
    assert build_configs(parse([]), {"PALLAS_SERVE_API_KEY": "env"})[1].api_key == "env"
    assert build_configs(parse(["--api-key", "flag"]), {"PALLAS_SERVE_API_KEY": "env"})[1].api_key == "flag"
    assert build_configs(parse([]), {"PALLAS_SERVE_API_KEY": ""})[1].api_key is None


@pytest.mark.parametrize(
    "argv",
    [["--slots", "0"], ["--max-context", "8"], ["--timeout", "0"], ["--port", "70000"], ["--max-queue", "-1"],
     ["--compile-threads", "-1"]],
)
def test_bad_values_raise_value_error(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        build_configs(build_parser().parse_args(argv), {})


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "0.0001", "5000"])
def test_switch_interval_out_of_range_exits(value: str) -> None:
    from server.__main__ import main

    with pytest.raises(SystemExit):
        main(["--switch-interval-ms", value])


@pytest.mark.parametrize("argv", [["--kernels", "attention"], ["--kernels", "=xla"], ["--slots", "many"],
                                  ["--unroll-decode-layers", "yes"], ["--tool-call-parser", "xml"],
                                  ["--reasoning-format", "hidden"]])
def test_malformed_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_prefill_chunks_for_budget() -> None:
    assert prefill_chunks_for(512) == (64, 128, 256, 512)
    assert prefill_chunks_for(2048) == (64, 128, 256, 512)
    assert prefill_chunks_for(100) == (64, 100)
    assert prefill_chunks_for(32) == (32,)
    assert prefill_chunks_for(300, (64, 512)) == (64, 300)
    with pytest.raises(ValueError):
        prefill_chunks_for(0)


def test_prefill_chunks_flag() -> None:
    engine, _ = build_configs(build_parser().parse_args(["--prefill-chunks", "256,64,128", "--prefill-budget", "200"]), {})
    assert engine.prefill_chunks == (64, 128, 200)
    engine, _ = build_configs(build_parser().parse_args(["--prefill-chunks", "32,128,256,512"]), {})
    assert engine.prefill_chunks == (32, 128, 256, 512)
    for bad in ("0,64", "a,64", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--prefill-chunks", bad])


def test_distributed_flags_go_together() -> None:
    engine, _ = build_configs(build_parser().parse_args(
        ["--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]), {})
    assert engine.num_slots == 8
    for bad in (["--coordinator", "h:1"], ["--coordinator", "h:1", "--num-processes", "2"],
                ["--coordinator", "h:1", "--num-processes", "1", "--process-id", "0"],
                ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"]):
        with pytest.raises(ValueError):
            build_configs(build_parser().parse_args(bad), {})


def test_decode_steps_below_zero_are_refused() -> None:
    with pytest.raises(ValueError, match="decode steps"):
        build_configs(build_parser().parse_args(["--decode-steps", "-1"]), {})
    with pytest.raises(ValueError, match="dispatched ahead"):
        build_configs(build_parser().parse_args(["--dispatch-ahead", "0"]), {})
