"""`python -m server` with its default flags on the CPU (`--numerics auto`: llama.cpp's CPU
arithmetic for the default model, pallas_kernels/ggml_cpu.py) answers `/v1/completions` with
llama.cpp's own greedy tokens: the fixture's (tests/fixtures/generation_smollm2.json), for
prompts sent as token ids, together, through HTTP. (test_e2e.py runs its API tests with
`--numerics native`, the fast path.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import free_port

STARTUP_DEADLINE_S = 600
# Prompts other than the agreement test's ggml share (its 15 shortest and one long one).
CASES = ("code_python_dataclass", "zh_story", "math_pencils")


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # Only the compile sizes differ from the defaults (the prompts fit one 64-token chunk,
    # which is llama.cpp's ubatch for them too).
    cmd = [sys.executable, "-m", "server", "--model", str(smollm2_path), "--port", str(port),
           "--max-context", "1024", "--slots", "4", "--prefill-chunks", "64,512"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                r = httpx.get(base + "/health", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {STARTUP_DEADLINE_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_default_server_answers_with_llama_cpp_tokens(server, fixtures_dir):
    health = httpx.get(server + "/health", timeout=10).json()
    assert health["engine"]["numerics"] == "ggml" and health["engine"]["kv_dtype"] == "float16"
    fixture = json.loads((fixtures_dir / "generation_smollm2.json").read_text())
    cases = [c for c in fixture["cases"] if c["name"] in CASES]
    assert len(cases) == len(CASES)

    def complete(case):
        body = {"prompt": case["prompt_ids"], "max_tokens": len(case["generated_ids"]), "temperature": 0}
        r = httpx.post(server + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(complete, cases))
    for case, text in zip(cases, texts):
        ids = case["generated_ids"][:-1] if case["stop_reason"] == "eog" else case["generated_ids"]
        want = httpx.post(server + "/detokenize", json={"tokens": ids}, timeout=10).json()["content"]
        assert text == want, case["name"]
