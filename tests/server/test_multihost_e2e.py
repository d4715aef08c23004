"""`python -m server` from two processes (--coordinator, --num-processes, --process-id) on the
CPU, one device each, the synthetic tiny-tp model split tp=2 over both: process 0 answers HTTP,
process 1 follows its step plans, and process 1 exits once process 0 is stopped."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEADLINE_S = 300


def _start(models: list[pathlib.Path], port: int, tmp_path: pathlib.Path):
    """Two `python -m server` processes joined through a local coordinator; process i loads models[i]."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    common = ["--slots", "2", "--max-context", "512", "--prefill-budget", "64", "--prefill-chunks", "64",
              "--tensor-parallel", "2", "--compile-cache", "none", "--coordinator", coordinator,
              "--num-processes", "2", "--port", str(port)]
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]
    procs = []
    for i in (0, 1):
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "server", "--model", str(models[i]), *common,
                                           "--process-id", str(i)], cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    return procs, logs


def test_two_processes_serve_and_stop_together(tiny_tp_path, tmp_path):
    port = free_port()
    procs, logs = _start([tiny_tp_path, tiny_tp_path], port, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + DEADLINE_S
        while True:
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    pytest.fail(f"process {i} exited with {proc.returncode}:\n{logs[i].read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not ready after {DEADLINE_S} s:\n{logs[0].read_text()[-3000:]}")
            time.sleep(0.5)
        health = httpx.get(base + "/health", timeout=5).json()
        assert health["kernels"]  # the engine runs on process 0
        for _ in range(2):  # two requests: setups, prefills and decodes all go through the broadcast
            r = httpx.post(base + "/v1/completions", json={"prompt": "hello there", "max_tokens": 6,
                                                            "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] >= 1
        procs[0].send_signal(signal.SIGINT)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGINT for process 0
        for i, proc in enumerate(procs):
            try:
                assert proc.wait(timeout=120) in ((0, -signal.SIGINT) if i == 0 else (0,)), logs[i].read_text()[-3000:]
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} did not stop:\n{logs[i].read_text()[-3000:]}")
        ran = re.search(r"process 0 stopped; ran (\d+) steps", logs[1].read_text())
        assert ran and int(ran.group(1)) >= 2 * 6  # two requests: a prefill and several decodes each
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
