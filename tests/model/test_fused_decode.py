"""The decode step's fused residual add + norm (`forward._decode_fused`, `Kernels.add_norm`) gives
the logits and cache of the plain composition: with the reference op, with the Triton kernel in
Pallas interpret mode, with K-split partial sums, with x handed to the matmuls in the "words"
column order they ask for, for stacked layers, a list of them and a tied head. tiny-tp (qwen2:
q/k/v biases; E 256, 2 layers, q8_0) with random norm weights."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import forward
from model.config import ModelConfig
from model.forward import Kernels, KVCache
from model.gguf_file import GGUFFile
from model.weights import Params, load_params
from pallas_kernels import norm, quant
from pallas_kernels.attention import attention_decode_reference, attention_prefill_reference
from pallas_kernels.matmul import embed_reference, qmatmul_reference


def _from_words(x: jax.Array) -> jax.Array:
    """The inverse of `norm.to_order(x, "words")`."""
    m, k = x.shape
    return jnp.reshape(jnp.swapaxes(jnp.reshape(x, (m, k // 32, 2, 16)), 2, 3), (m, k))


@pytest.fixture(scope="module")
def tiny(tiny_tp_path):
    """tiny-tp with random norm weights (the file's are all ones, which would hide a norm read
    from the wrong layer or the wrong norm)."""
    gf = GGUFFile(tiny_tp_path)
    cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
    params = load_params(gf, cfg)
    assert params.is_stacked
    rng = np.random.default_rng(3)

    def rand(a):
        return jnp.asarray(1.0 + 0.5 * rng.standard_normal(a.shape), a.dtype)

    layers = dict(params.layers, attn_norm=rand(params.layers["attn_norm"]), ffn_norm=rand(params.layers["ffn_norm"]))
    return cfg, dataclasses.replace(params, layers=layers, output_norm=rand(params.output_norm))


def _unstacked(params: Params) -> Params:
    """The same weights as a list of per-layer dicts (what a model with non-uniform layers loads)."""
    n = params.layers["attn_norm"].shape[0]
    layers = [{k: quant.layer_of(v, i) if isinstance(v, quant.QuantizedTensor) else v[i]
               for k, v in params.layers.items()} for i in range(n)]
    return dataclasses.replace(params, layers=layers, is_stacked=False)


class Fakes:
    """Reference matmuls of bf16 x that take x in the words order where `matmul_order` says so
    (undoing it first) and split their results in two partial sums; they count the words-order
    calls."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.words_calls = 0

    def matmul(self, x, w, layer=None, split=None, x_order="natural"):
        del split
        if x_order == "words":
            assert self.order(w, x.shape[0]) == "words"
            self.words_calls += 1
            x = _from_words(x)
        # bf16 x, as model/kernels.py hands the GPU kernels (the fused norm's output is bf16)
        return qmatmul_reference(x.astype(jnp.bfloat16), w, layer=layer)

    def parts(self, x, w, layer=None, x_order="natural"):
        y = self.matmul(x, w, layer, None, x_order)
        return jnp.stack([0.5 * y, 0.5 * y])

    def order(self, w, m):
        del m
        return "natural" if w.shape[0] == self.vocab else "words"


def _decode(cfg, params, kern, unroll=True):
    cache = KVCache.create(cfg, 3, 64, jnp.float32)
    rng = np.random.default_rng(0)
    cache = KVCache(jnp.asarray(rng.standard_normal(cache.k.shape), jnp.float32) * 0.5,
                    jnp.asarray(rng.standard_normal(cache.v.shape), jnp.float32) * 0.5)
    tokens = jnp.asarray([3, 1000, 7], jnp.int32)
    positions = jnp.asarray([5, -1, 30], jnp.int32)  # the middle row inactive
    fn = jax.jit(functools.partial(forward.decode, cfg, kern, attend=64, unroll=unroll))
    logits, cache = fn(params, cache, tokens, positions)
    return np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("add_norm, layers", [("reference", "stacked"), ("triton-interpret", "stacked"),
                                              ("triton-interpret", "list"), ("reference", "tied head")])
def test_fused_decode_matches_the_composition(tiny, add_norm, layers):
    cfg, params = tiny
    if layers == "list":
        params = _unstacked(params)
    elif layers == "tied head":  # the output head read from the embedding table
        params = dataclasses.replace(params, output=None)
    fakes = Fakes(cfg.vocab_size)
    plain = Kernels(fakes.matmul, embed_reference, attention_decode_reference, attention_prefill_reference)
    op = norm.add_norm_reference if add_norm == "reference" else functools.partial(norm.add_norm_triton,
                                                                                  interpret=True)
    fused = dataclasses.replace(plain, add_norm=op, matmul_parts=fakes.parts, matmul_order=fakes.order)
    assert forward._fuses_decode(fused, params, unroll=True) and not forward._fuses_decode(plain, params, True)
    want = _decode(cfg, params, plain)
    assert fakes.words_calls == 0
    got = _decode(cfg, params, fused)
    # q/k/v and gate/up per layer took x in the words order (undone by the fake: a wrong order
    # would change the logits); the output head took it natural
    assert fakes.words_calls == 2 * cfg.num_layers
    assert np.isfinite(got[0]).all() and np.abs(want[0]).max() > 0.1
    for g, w, what in zip(got, want, ("logits", "k cache", "v cache")):
        assert _rel(g, w) < 1e-5, what
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()


def test_scanned_layers_keep_the_composition(tiny):
    """A scanned stack (traced layer index) does not fuse: each layer's next norm is static."""
    cfg, params = tiny
    fakes = Fakes(cfg.vocab_size)
    plain = Kernels(fakes.matmul, embed_reference, attention_decode_reference, attention_prefill_reference)
    fused = dataclasses.replace(plain, add_norm=norm.add_norm_reference, matmul_parts=fakes.parts,
                                matmul_order=fakes.order)
    assert params.is_stacked and not forward._fuses_decode(fused, params, unroll=False)


@pytest.mark.parametrize("order", ["natural", "words"])
@pytest.mark.parametrize("m, e, p", [(1, 64, 1), (8, 256, 3), (5, 4096, 4)])
def test_add_norm_triton_matches_reference(order, m, e, p):
    rng = np.random.default_rng(m * e + p)
    x = jnp.asarray(rng.standard_normal((m, e)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((p, m, e)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(e), jnp.float32)
    x_ref, h_ref = norm.add_norm_reference(x, parts, w, 1e-6, order)
    x_got, h_got = norm.add_norm_triton(x, parts, w, 1e-6, order, interpret=True)
    np.testing.assert_allclose(np.asarray(x_got), np.asarray(x_ref), rtol=1e-6, atol=1e-6)
    assert h_got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(h_got, np.float32), np.asarray(h_ref, np.float32), rtol=1e-2, atol=1e-2)
    if order == "words":  # the order is the matmul kernel's own permutation of the natural result
        natural = norm.add_norm_reference(x, parts, w, 1e-6, "natural")[1]
        np.testing.assert_array_equal(np.asarray(_from_words(h_got), np.float32), np.asarray(natural, np.float32))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_add_norm_reads_a_stacked_weight_at_its_layer(impl):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    fn = norm.add_norm_reference if impl == "reference" else functools.partial(norm.add_norm_triton, interpret=True)
    want = norm.add_norm_reference(x, parts, stack[2], 1e-6, "words")
    for layer in (2, jnp.int32(2)):
        got = jax.jit(lambda x, p, w, i: fn(x, p, w, 1e-6, "words", layer=i))(x, parts, stack, layer)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_add_norm_refusals():
    x, parts, w = jnp.zeros((2, 96)), jnp.zeros((1, 2, 96)), jnp.zeros(96)
    with pytest.raises(NotImplementedError):  # not a power of two
        norm.add_norm_triton(x, parts, w, 1e-6)
    with pytest.raises(ValueError):  # a stack needs its layer
        norm.add_norm_reference(x, parts, jnp.zeros((2, 96)), 1e-6)
    with pytest.raises(ValueError):
        norm.add_norm_reference(x, jnp.zeros((1, 3, 96)), w, 1e-6)
    with pytest.raises(ValueError):
        norm.add_norm_reference(x, parts, w, 1e-6, "columns")
