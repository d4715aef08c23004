"""bench/perplexity.py on the CPU: its perplexity is the teacher-forced logits' (model/offline.py,
another path through the model), and a variant that changes nothing diverges by nothing."""

from __future__ import annotations

import json
import math

import jax
import numpy as np

from bench import perplexity
from model.offline import teacher_forced_logits
from scheduler.loader import load_resolved
from model.config import EngineConfig


def test_windows_open_with_bos_and_stop_at_the_limit():
    assert perplexity.windows_of(list(range(10, 30)), 8, 1, None) == [[1, *range(11, 18)], [1, *range(19, 26)]]
    assert perplexity.windows_of(list(range(10, 30)), 8, 1, 1) == [[1, *range(11, 18)]]
    assert perplexity.windows_of(list(range(5)), 8, 1, None) == []


def test_perplexity_is_the_teacher_forced_one(tiny_tp_path, tmp_path):
    argv = ["--model", str(tiny_tp_path), "--ctx", "32", "--windows", "3", "--batch", "2", "--numerics", "native",
            "--compare", "--kv-dtype float32", "--out", str(tmp_path)]
    assert perplexity.main(argv) == 0
    (path,) = tmp_path.glob("perplexity-*.json")
    report = json.loads(path.read_text())
    assert report["windows"] == 3 and report["scored_tokens"] == 3 * 16
    # the variant's flags change nothing here: the same numbers, no divergence
    assert report["variant"]["mean_nll"] == report["base"]["mean_nll"]
    assert report["kl_max"] < 1e-6 and report["same_top_pct"] == 100.0
    loaded, ecfg = load_resolved(tiny_tp_path, EngineConfig(max_context=64, numerics="native", kv_dtype="float32"))
    tokens = loaded.tokenizer.encode(perplexity.ROOT.joinpath("README.md").read_text(encoding="utf-8"), add_bos=False)
    windows = perplexity.windows_of(tokens, 32, loaded.tokenizer.bos_id, 3)
    logits = teacher_forced_logits(loaded.config, loaded.kernels, loaded.params,
                                   [(w[:16], w[16:]) for w in windows], max_context=64, chunks=(16,))
    nll = [-float(jax.nn.log_softmax(row)[t]) for w, rows in zip(windows, logits) for row, t in zip(rows, w[16:])]
    assert math.isclose(report["base"]["mean_nll"], float(np.mean(nll)), rel_tol=1e-5)
    assert math.isclose(report["base"]["ppl"], math.exp(np.mean(nll)), rel_tol=1e-5)
