"""model/loader.py: the "auto" splits stay on only where the split weights fit the device's
memory beside the KV cache (`splits_that_fit`), costliest dropped first; "on" is kept."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from model import loader
from model.config import EngineConfig, ModelConfig
from model.gguf_file import GGUFFile

ALL = frozenset({"q4_k", "q5_k", "q6_k"})


@pytest.fixture(scope="module")
def tiny_q5_k_m(synthetic_gguf) -> pathlib.Path:
    return synthetic_gguf("tiny-tp", "q5_k_m")


def test_weight_bytes_are_what_the_loader_places(tiny_q5_k_m):
    gf = GGUFFile(tiny_q5_k_m)
    for splits, setting in ((frozenset(), "off"), (frozenset({"q5_k", "q6_k6"}), "on")):
        model = loader.load_model(tiny_q5_k_m, EngineConfig(max_context=128, split_q5_k=setting, split_q6_k=setting))
        assert model.splits == splits
        assert loader.weight_bytes(gf, splits) == loader.params_nbytes(model.params)
    # Q5_K's matrices (all but layer 1's attn_v and ffn_down, and the untied embedding, which is
    # never split) grow from 180 bytes per 256 weights as repacked (6-bit scales and mins a byte
    # each) to 36 per 32
    q5_k = sum(int(np.prod(i.shape)) for name, i in gf.tensors.items()
               if i.ggml_type.name == "Q5_K" and name != "token_embd.weight")
    grown = loader.weight_bytes(gf, frozenset({"q5_k"})) - loader.weight_bytes(gf, frozenset())
    assert grown == q5_k * (36 / 32 - 180 / 256)


def test_auto_splits_are_dropped_costliest_first_until_the_weights_fit(tiny_q5_k_m, caplog):
    gf = GGUFFile(tiny_q5_k_m)
    size = {s: loader.weight_bytes(gf, frozenset(s)) for s in (ALL, ())}
    assert loader.splits_that_fit(gf, ALL, ALL, None) == ALL  # no limit known (the CPU)
    assert loader.splits_that_fit(gf, ALL, ALL, size[ALL]) == ALL
    # a byte short: Q5_K's split adds the most (64%, against Q6_K's 37%), so it goes first
    assert loader.splits_that_fit(gf, ALL, ALL, size[ALL] - 1) == ALL - {"q5_k"}
    assert "not splitting q5_k matrices (auto)" in caplog.text
    # (this file has no Q4_K matrix: that split costs nothing and stays)
    assert loader.splits_that_fit(gf, ALL, ALL, size[()]) == {"q4_k"}
    # a split asked for with "on" stays, whatever it costs
    assert loader.splits_that_fit(gf, ALL, ALL - {"q5_k"}, size[()]) == {"q5_k"}


def test_kv_cache_bytes():
    gf_cfg = dict(num_layers=2, num_kv_heads=3, head_dim=64, context_length=100)
    cfg = ModelConfig.__new__(ModelConfig)
    for k, v in gf_cfg.items():
        object.__setattr__(cfg, k, v)
    # keys and values, 2 layers, 8 slots, the context capped at the model's 100, 3 x 64 per position
    want = 2 * 2 * 8 * 100 * 3 * 64
    assert loader.kv_cache_bytes(cfg, EngineConfig(num_slots=8, max_context=128, kv_dtype="bfloat16")) == 2 * want
    assert loader.kv_cache_bytes(cfg, EngineConfig(num_slots=8, max_context=128, kv_dtype="auto")) == 2 * want
    assert loader.kv_cache_bytes(cfg, EngineConfig(num_slots=8, max_context=128, kv_dtype="float32")) == 4 * want
    assert loader.kv_cache_bytes(cfg, EngineConfig(num_slots=8, max_context=64, kv_dtype="float8_e4m3fn")) == (
        2 * 2 * 8 * 64 * 3 * 64)


def test_formats_with_kernels_of_their_own_are_split_only_where_the_mosaic_matmul_takes_the_shape():
    """Q4_1, Q5_0 and Q5_1 keep their Triton kernels where the Mosaic GPU matmul would refuse the
    split (K not a multiple of its K step, N not of 64: SmolLM2's K = 576, Gemma 3's 640); Q6_K's
    split needs N in 64s; Q4_K and Q5_K split whatever the shape (the Triton Q4_0 / Q8_0 kernels
    take their splits)."""
    from model.weights import is_split

    every = frozenset({"q4_k", "q5_k", "q6_k", "q4_1", "q5_0", "q5_1"})
    for fmt in ("q4_1", "q5_0", "q5_1"):
        assert is_split(fmt, 576, 1536, every) and is_split(fmt, 4096, 11008 - 11008 % 256, every)
        assert not is_split(fmt, 1728, 576, every) and not is_split(fmt, 1024, 640, every)
        assert not is_split(fmt, 1000, 1024, every)  # N
        assert not is_split(fmt, 576, 1536, every - {fmt})
    assert is_split("q6_k", 576, 1536, every) and not is_split("q6_k", 1000, 1536, every)
    assert is_split("q4_k", 1000, 768, every) and is_split("q5_k", 1000, 768, every)
