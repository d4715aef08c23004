"""`python -m server` with its default flags on the CPU (`--numerics auto`: llama.cpp's CPU
arithmetic for the default model, pallas_kernels/ggml_cpu.py) answers `/v1/completions` with
llama.cpp's own greedy tokens: the fixture's (tests/fixtures/generation_smollm2.json), for
prompts sent as token ids, together, through HTTP. (test_e2e.py runs its API tests with
`--numerics native`, the fast path.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import running_server

# Prompts other than the agreement test's ggml share (its 15 shortest and one long one).
CASES = ("code_python_dataclass", "zh_story", "math_pencils")


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    # Only the compile sizes differ from the defaults (the prompts fit one 64-token chunk,
    # which is llama.cpp's ubatch for them too).
    args = ["--model", str(smollm2_path), "--max-context", "1024", "--slots", "4", "--prefill-chunks", "64,512",
            "--no-prompt-logprobs"]
    with running_server(args, tmp_path_factory.mktemp("server") / "server.log") as base:
        yield base


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
