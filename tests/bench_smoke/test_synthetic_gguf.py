"""bench/make_synthetic_gguf.py writes files the model loader takes: run as a script (nothing
imports bench/), then read back with GGUFFile, ModelConfig and the tokenizer."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gguf

from model.config import ModelConfig
from model.gguf_file import GGUFFile
from model.tokenizer import Tokenizer

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "make_synthetic_gguf.py"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """write(shape, quant) -> GGUFFile, each file written once per module."""
    directory = tmp_path_factory.mktemp("synthetic")
    files: dict[tuple[str, str], GGUFFile] = {}

    def write(shape: str, quant_name: str) -> GGUFFile:
        if (shape, quant_name) not in files:
            files[shape, quant_name] = _write(directory, shape, quant_name)
        return files[shape, quant_name]

    return write


def _write(directory: pathlib.Path, shape: str, quant_name: str) -> GGUFFile:
    out = directory / f"{shape}-{quant_name}.gguf"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", shape, "--quant", quant_name, "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=60,
    )
    return GGUFFile(out)


@pytest.mark.parametrize(
    ("shape", "quant_name", "arch", "kind"),
    [("tiny", "q4_k_m", "llama", "llama"), ("tiny-qwen2", "q4_0", "qwen2", "gpt2")],
)
def test_tiny_file_loads(written, shape: str, quant_name: str, arch: str, kind: str) -> None:
    gf = written(shape, quant_name)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    assert (cfg.arch, cfg.num_layers, cfg.embed_dim, cfg.ffn_dim) == (arch, 2, 256, 768)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 2, 2048)
    assert cfg.has_qkv_bias == (arch == "qwen2")
    assert not cfg.tied_output
    assert gf.tensor("output.weight").ggml_type.name == "Q6_K"

    tok = Tokenizer.from_gguf_metadata(gf.metadata)
    assert gf.metadata["tokenizer.ggml.model"] == kind
    assert tok.vocab_size == 2048
    text = "Hello world, 42 tokens.\nBye"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize(("quant_name", "base"), [("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K")])
def test_k_quant_mix_and_weight_scale(written, quant_name: str, base: str) -> None:
    gf = written("tiny", quant_name)
    assert gf.metadata["general.file_type"] == {"q4_k_m": 15, "q5_k_m": 17}[quant_name]
    # llama.cpp's use_more_bits over 2 layers picks layer 1 for Q6_K attn_v and ffn_down
    assert gf.tensor("blk.0.attn_v.weight").ggml_type.name == base
    assert gf.tensor("blk.1.attn_v.weight").ggml_type.name == "Q6_K"
    assert gf.tensor("blk.1.ffn_down.weight").ggml_type.name == "Q6_K"
    assert gf.tensor("blk.1.ffn_up.weight").ggml_type.name == base
    assert gf.tensor("token_embd.weight").ggml_type.name == base
    assert gf.tensor("output.weight").ggml_type.name == "Q6_K"
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        info = gf.tensor(name)
        w = gguf.quants.dequantize(np.asarray(info.data), info.ggml_type)  # llama.cpp's math, in numpy
        k = info.shape[1]
        assert np.isfinite(w).all()
        # about unit gain: std near 1/sqrt(K), mean near zero
        assert 0.5 / np.sqrt(k) < w.std() < 2.0 / np.sqrt(k), (name, w.std() * np.sqrt(k))
        assert abs(w.mean()) < 0.2 / np.sqrt(k), (name, w.mean() * np.sqrt(k))


@pytest.mark.parametrize(("quant_name", "base", "file_type"), [("q4_1", "Q4_1", 3), ("q5_0", "Q5_0", 8),
                                                              ("q5_1", "Q5_1", 9)])
def test_legacy_quant_files_and_weight_scale(written, quant_name: str, base: str, file_type: int) -> None:
    gf = written("tiny", quant_name)
    assert gf.metadata["general.file_type"] == file_type
    for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        assert gf.tensor(name).ggml_type.name == base
    assert gf.tensor("output.weight").ggml_type.name == "Q6_K"  # llama.cpp's rule for its 4- and 5-bit files
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        info = gf.tensor(name)
        w = gguf.quants.dequantize(np.asarray(info.data), info.ggml_type)
        k = info.shape[1]
        assert np.isfinite(w).all()
        assert 0.5 / np.sqrt(k) < w.std() < 2.0 / np.sqrt(k), (name, w.std() * np.sqrt(k))
        assert abs(w.mean()) < 0.2 / np.sqrt(k), (name, w.mean() * np.sqrt(k))


def test_k_quant_fallback_for_rows_of_partial_super_blocks_is_llama_cpp_s() -> None:
    """Where K is not a multiple of 256, llama.cpp's K-quant mixes fall back per type (Q4_K ->
    Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0); the table is read from the script's module (no file)."""
    import dataclasses
    import importlib.util

    spec = importlib.util.spec_from_file_location("_make_synthetic_gguf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    shape = dataclasses.replace(mod.SHAPES["tiny"], embed_dim=320, ffn_dim=640, num_heads=5, num_kv_heads=5)
    Q = gguf.GGMLQuantizationType
    for quant, low in (("q4_k_m", Q.Q5_0), ("q5_k_m", Q.Q5_1)):
        types = {name: t for name, (_, t) in mod.tensor_types(shape, quant).items()}
        assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down.weight"] == low  # K 320, 640
        assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == Q.Q8_0  # Q6_K's layers
        assert types["output.weight"] == Q.Q8_0
    big = {name: t for name, (_, t) in mod.tensor_types(mod.SHAPES["tiny"], "q4_k_m").items()}
    assert big["blk.0.attn_q.weight"] == Q.Q4_K  # K 256: no fallback
