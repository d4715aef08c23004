"""EngineConfig.split_q4_k (`--split-q4-k`): a Q4_K_M model's Q4_K matrices load split for Q4_0's
kernels (pallas_kernels/q4_k_split.py), and its forward pass gives the unsplit model's logits up
to the rounding of the block scales (bf16 for Q4_K's split, f16 for Q5_K's)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from model.config import EngineConfig
from model.loader import load_model
from model.offline import teacher_forced_logits
from pallas_kernels.quant import QuantizedTensor


@pytest.fixture(scope="module")
def tiny_q4_k_m(synthetic_gguf) -> pathlib.Path:
    return synthetic_gguf("tiny-tp", "q4_k_m")


def formats(params) -> set[str]:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedTensor))
    return {leaf.fmt for leaf in leaves if isinstance(leaf, QuantizedTensor)}


def assert_same_logits(base, split, seed: int, rel: float = 5e-3) -> None:
    """Teacher-forced on two random prompts, the split model's logits are the base model's up to
    the rounding of the split's scales (and offsets): within `rel` in relative norm."""
    rng = np.random.default_rng(seed)
    cases = [(rng.integers(0, 2048, 40).tolist(), rng.integers(0, 2048, 6).tolist()) for _ in range(2)]
    forced = [teacher_forced_logits(m.config, m.kernels, m.params, cases, max_context=128) for m in (base, split)]
    for a, b in zip(*forced):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(b).all()
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < rel
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8  # random weights: near-ties are common


def host_and_device_splits(path: pathlib.Path, splits: set[str]):
    """The params split on the device after placement (one device) and on the host before it (a
    `place` of the caller's own: tensor parallelism), asserted to hold the same planes; the
    host-split params."""
    from model.config import ModelConfig
    from model.gguf_file import GGUFFile
    from model.weights import _to_device, load_params

    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    on_device = load_params(gf, cfg, splits=splits)
    on_host = load_params(gf, cfg, place=_to_device, splits=splits)
    a, b = jax.tree_util.tree_leaves_with_path(on_device), jax.tree_util.tree_leaves_with_path(on_host)
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    return on_host


@pytest.mark.parametrize("q6_k", ["off", "on", "6bit"])
def test_split_model_gives_the_same_logits(tiny_q4_k_m, q6_k):
    base = load_model(tiny_q4_k_m, EngineConfig(max_context=128))
    bits = 6 if q6_k == "6bit" else 8
    split = load_model(tiny_q4_k_m, EngineConfig(max_context=128, split_q4_k="on", split_q6_k="off" if q6_k == "off"
                                                 else "on", q6_k_split_bits=bits))
    q6_k_key, q6_k_form = ("q6_k6", "q6_k_split6") if bits == 6 else ("q6_k", "q6_k_split")
    assert split.splits == ({"q4_k", q6_k_key} if q6_k != "off" else {"q4_k"})
    assert not base.splits  # "auto": not on a CPU
    assert {"q4_k", "q6_k"} <= formats(base.params) and not {"q4_k_split", "q6_k_split"} & formats(base.params)
    # every layer's Q4_K (and Q6_K) matrix is split; the untied embedding (only gathered from) is not
    assert "q4_k_split" in formats(split.params.layers) and "q4_k" not in formats(split.params.layers)
    if q6_k != "off":
        assert q6_k_form in formats(split.params) and "q6_k" not in formats(split.params)
        assert split.kernel_names[f"matmul_decode[{q6_k_form}]"] == "reference"
    assert not split.config.tied_output and split.params.embed.fmt == "q4_k"
    assert split.kernel_names["matmul_decode[q4_k_split]"] == "reference"  # the CPU
    # measured 6.4e-3 and 7.3e-3: the planes' bf16 scales and offsets (2^-8 of each, the folded
    # kernel's own rounding), over 2 layers; 1.8e-3 and 1.9e-3 with f16 planes (to the 35th session)
    assert_same_logits(base, split, seed=0, rel=1.5e-2)


def test_host_and_device_splits_agree(tiny_q4_k_m):
    """The split made on the device after placement and on the host before it give the same planes."""
    assert {"q4_k_split", "q6_k_split"} <= formats(host_and_device_splits(tiny_q4_k_m, {"q4_k", "q6_k"}))
    assert "q6_k_split6" in formats(host_and_device_splits(tiny_q4_k_m, {"q6_k6"}))


@pytest.fixture(scope="module")
def tiny_q5_k_m(synthetic_gguf) -> pathlib.Path:
    return synthetic_gguf("tiny-tp", "q5_k_m")


def test_split_q5_k_model_gives_the_same_logits_and_host_and_device_splits_agree(tiny_q5_k_m):
    """Q5_K split for Q8_0's kernels (pallas_kernels/q5_k_split.py), as Q4_K's above."""
    base = load_model(tiny_q5_k_m, EngineConfig(max_context=128))
    split = load_model(tiny_q5_k_m, EngineConfig(max_context=128, split_q5_k="on"))
    assert split.splits == {"q5_k"} and not base.splits  # "auto": not on a CPU
    assert "q5_k" in formats(base.params) and "q5_k_split" not in formats(base.params)
    assert "q5_k_split" in formats(split.params.layers) and "q5_k" not in formats(split.params.layers)
    assert split.params.embed.fmt == "q5_k"  # untied: only gathered from
    assert split.kernel_names["matmul_decode[q5_k_split]"] == "reference"  # the CPU
    assert_same_logits(base, split, seed=1)  # measured 1.4e-3 and 1.5e-3: the f16 planes' rounding
    assert "q5_k_split" in formats(host_and_device_splits(tiny_q5_k_m, {"q5_k"}))


def test_split_legacy_smollm2_gives_the_same_logits(smollm2, smollm2_path, fixtures_dir):
    """SmolLM2's Q4_1 matrices in q4_k_split's form (pallas_kernels/legacy_split.py) where the
    Mosaic GPU matmul takes their shape (ffn_down, 576 x 1536: the others' K of 576 is not a
    multiple of its K step, and they stay Q4_1 for Triton's Q4_1 kernel), teacher-forced on two of
    the llama.cpp fixture's prompts: the logits move by the rounding of the split's bf16 scales and
    offsets only (the folded GPU kernel's own rounding)."""
    import dataclasses
    import json

    from tests.model.conftest import SMOL_ENGINE

    split = load_model(smollm2_path, dataclasses.replace(SMOL_ENGINE, split_legacy="on"))
    assert split.splits == {"q4_1", "q5_0", "q5_1"} and not smollm2.splits
    layers = split.params.layers
    assert layers["w_down"].fmt == "q4_1_split" and layers["w_down"].shape == (576, 1536)
    assert {layers[k].fmt for k in ("wqkv", "wo", "w_gate_up")} == {"q4_1"}
    assert split.kernel_names["matmul_decode[q4_1_split]"] == "reference"  # the CPU
    cases = json.loads((fixtures_dir / "generation_smollm2.json").read_text())["cases"]
    cases = sorted(cases, key=lambda c: len(c["prompt_ids"]))[:2]
    pairs = [(c["prompt_ids"], c["generated_ids"]) for c in cases]
    forced = [teacher_forced_logits(m.config, m.kernels, m.params, pairs, max_context=1024) for m in (smollm2, split)]
    for a, b in zip(*forced):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(b).all()
        # measured 0.17 and 0.16 (2.5e-3 and 5.5e-3 in relative norm), the split's bf16 scales and
        # offsets; 2.5e-4 and 2.6e-4 with f16 scales and offsets (to the 36th session)
        assert np.abs(a - b).max() < 0.5 and np.linalg.norm(a - b) / np.linalg.norm(a) < 1.5e-2
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9  # measured 1.0
