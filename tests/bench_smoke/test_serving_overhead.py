"""bench/serving_overhead.py: its device stand-in queues steps like a GPU stream, and the whole
script runs both sides (the real server app over HTTP, the engine directly) to the end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.serving_overhead import DeviceQueueModel
from model.step_types import PrefillChunk, StepPlan

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "serving_overhead.py"


def test_steps_queue_back_to_back_and_sample_every_row():
    model = DeviceQueueModel(num_slots=4, max_context=64, prefill_chunks=(8,), max_top_logprobs=2, step_s=0.2,
                             prefill_s_per_token=0.01, host_s=0.0, token_ids=np.array([7, 9], np.int32))
    t0 = time.perf_counter()
    first = model.dispatch(StepPlan(prefills=(PrefillChunk(1, np.arange(8, dtype=np.int32), 0, True),)))
    second = model.dispatch(StepPlan(decode_slots=(0, 1, 3)))
    assert time.perf_counter() - t0 < 0.1  # dispatch does not wait for the step
    out = first.result()
    assert out.valid.tolist() == [False, True, False, False] and out.tokens[1] in (7, 9)
    assert time.perf_counter() - t0 >= 0.28  # 200 ms + 8 tokens x 10 ms
    out = second.result()
    assert out.valid.tolist() == [True, True, False, True]
    assert time.perf_counter() - t0 >= 0.48  # queued after the first step, not beside it


@pytest.mark.parametrize("mode", [[], ["--engine-process"]], ids=["engine-thread", "engine-process"])
def test_script_runs_both_sides(smollm2_path, tmp_path, mode):
    subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_path), "--step-ms", "1", "--host-ms", "0.1",
                    "--users", "1,3", "--max-tokens", "12", "--prompt-len", "16", "--repeats", "2",
                    "--out", str(tmp_path), *mode], check=True, timeout=300)
    (path,) = tmp_path.glob("serving-*.json")
    result = json.loads(path.read_text())
    assert result["settings"]["engine_process"] == bool(mode)
    for side in ("http", "engine"):
        assert len(result["runs"][side]) == 2  # --repeats alternates whole runs; each run each level once
        for run in result["runs"][side]:
            assert {users: (level["tokens"], level["errors"]) for users, level in run.items()} == {"1": (12, 0), "3": (36, 0)}
    assert set(result["median"]) == {"1", "3"}
