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
            "--kv-dtype", "float32", "--out", str(tmp_path / "same"), "--compare", "--kv-dtype float32"]
    assert perplexity.main(argv) == 0
    (path,) = (tmp_path / "same").glob("perplexity-*.json")
    report = json.loads(path.read_text())
    assert report["windows"] == 3 and report["scored_tokens"] == 3 * 15  # ctx/2 - 1 a window
    # a variant that changes nothing: the same numbers, no divergence, and said so
    assert report["variant_config"]["is_base"]
    assert report["variant"]["mean_nll"] == report["base"]["mean_nll"]
    assert report["kl_max"] < 1e-6 and report["same_top_pct"] == 100.0
    loaded, ecfg = load_resolved(tiny_tp_path, EngineConfig(max_context=64, numerics="native", kv_dtype="float32"))
    tokenizer = loaded.tokenizer
    tokens = tokenizer.encode(perplexity.ROOT.joinpath("README.md").read_text(encoding="utf-8"), add_bos=None)
    windows = perplexity.windows_of(tokens, 32, tokenizer.bos_id if tokenizer.add_bos else None, 3)
    logits = teacher_forced_logits(loaded.config, loaded.kernels, loaded.params,
                                   [(w[:17], w[17:]) for w in windows], max_context=64, chunks=(32,))
    nll = [-float(jax.nn.log_softmax(row)[t]) for w, rows in zip(windows, logits) for row, t in zip(rows, w[17:])]
    assert len(nll) == 45
    assert math.isclose(report["base"]["mean_nll"], float(np.mean(nll)), rel_tol=1e-5)
    assert math.isclose(report["base"]["ppl"], math.exp(np.mean(nll)), rel_tol=1e-5)


def test_a_variant_that_changes_the_arithmetic_diverges(tiny_tp_path, tmp_path):
    argv = ["--model", str(tiny_tp_path), "--ctx", "16", "--windows", "2", "--numerics", "native",
            "--kv-dtype", "float32", "--out", str(tmp_path), "--compare=--kv-dtype float8_e4m3fn"]
    assert perplexity.main(argv) == 0
    (path,) = tmp_path.glob("perplexity-*.json")
    report = json.loads(path.read_text())
    assert not report["variant_config"]["is_base"] and report["variant_config"]["kv_dtype"] == "float8_e4m3fn"
    assert report["kl_mean"] > 0 and report["variant"]["mean_nll"] != report["base"]["mean_nll"]
