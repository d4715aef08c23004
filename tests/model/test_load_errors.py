"""A file that is not a model we can run gives a clear GGUFLoadError / UnsupportedModelError
naming the problem, never a traceback from deep inside."""

from __future__ import annotations

import numpy as np
import pytest

import gguf
from model.config import EngineConfig, ModelConfig, UnsupportedModelError
from model.gguf_file import GGUFFile, GGUFLoadError
from model.loader import load_model


def _write(path, arch="llama", tensor_type=None, drop=()):
    w = gguf.GGUFWriter(str(path), arch)
    e, f, v = 64, 128, 32
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(e)
    w.add_feed_forward_length(f)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    tokens = ["a", "b", "ab"] + [chr(0x100 + i) for i in range(v - 3)]
    w.add_token_list(tokens)
    w.add_token_types([1] * v)
    w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (v, e), "output_norm.weight": (e,), "blk.0.attn_norm.weight": (e,),
        "blk.0.attn_q.weight": (e, e), "blk.0.attn_k.weight": (e, e), "blk.0.attn_v.weight": (e, e),
        "blk.0.attn_output.weight": (e, e), "blk.0.ffn_norm.weight": (e,), "blk.0.ffn_gate.weight": (f, e),
        "blk.0.ffn_up.weight": (f, e), "blk.0.ffn_down.weight": (e, f),
    }
    for name, shape in shapes.items():
        if name in drop:
            continue
        data = rng.standard_normal(shape).astype(np.float32)
        if tensor_type is not None and len(shape) == 2 and name == "blk.0.attn_q.weight":
            raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_dtype=tensor_type)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_file_loads(tmp_path):
    m = load_model(_write(tmp_path / "ok.gguf"), EngineConfig(max_context=64, num_slots=1))
    assert m.config.arch == "llama" and m.config.tied_output


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello, world" * 10)
    with pytest.raises(GGUFLoadError, match="not a GGUF file"):
        GGUFFile(p)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFLoadError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [100, 2000, -1000])
def test_truncated(tmp_path, keep):
    full = _write(tmp_path / "full.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[:keep])
    with pytest.raises(GGUFLoadError, match="truncated|corrupt"):
        GGUFFile(p)


def test_unsupported_arch(tmp_path):
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'mamba'"):
        load_model(_write(tmp_path / "m.gguf", arch="mamba"), EngineConfig(max_context=64))


def test_unsupported_tensor_type(tmp_path):
    # Q8_0 bytes labelled as IQ2_XXS: a type this server has no kernels for.
    p = _write(tmp_path / "iq.gguf", tensor_type=gguf.GGMLQuantizationType.Q8_0)
    data = bytearray(p.read_bytes())
    gf = GGUFFile(p)
    assert gf.tensors["blk.0.attn_q.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    with pytest.raises(GGUFLoadError, match="unsupported tensor type|row of"):
        _relabel_and_load(tmp_path, data, gguf.GGMLQuantizationType.IQ4_NL)


def _relabel_and_load(tmp_path, data: bytearray, new_type):
    # The tensor-info record is name, n_dims, dims, type (u32), offset (u64): patch the type.
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = int(new_type).to_bytes(4, "little")
    p = tmp_path / "relabelled.gguf"
    p.write_bytes(bytes(data))
    return load_model(p, EngineConfig(max_context=64))


def test_missing_tensor(tmp_path):
    with pytest.raises(GGUFLoadError, match="missing tensor 'blk.0.ffn_up.weight'"):
        load_model(_write(tmp_path / "m.gguf", drop=("blk.0.ffn_up.weight",)), EngineConfig(max_context=64))


@pytest.mark.parametrize("pooling_type, pooling", [(None, None), (0, None), (1, "mean"), (2, None), (3, "last")])
def test_pooling_type_names_the_embeddings_pooling(pooling_type, pooling):
    """llama.cpp's {arch}.pooling_type: mean (1) and last (3) are served; none, cls and rank are not."""
    meta = {"general.architecture": "qwen3", "qwen3.attention.head_count": 2, "qwen3.embedding_length": 8,
            "qwen3.block_count": 1, "qwen3.feed_forward_length": 16, "qwen3.vocab_size": 10}
    if pooling_type is not None:
        meta["qwen3.pooling_type"] = pooling_type
    assert ModelConfig.from_gguf_metadata(meta, frozenset({"token_embd.weight"})).pooling == pooling
