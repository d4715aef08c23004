"""model/ordered_values.py: value rows stored at load in the order the output projection reads
x in, checked on the CPU with a matmul registered for the test that reads x in a permuted order
of its own (as the Mosaic GPU kernel does for Q4_0) beside the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import forward
from model.config import EngineConfig
from model.loader import load_model
from model.ordered_values import head_order
from model.weights import LayerGroup
from pallas_kernels import registry
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.quant import slice_rows

CALLS: list[tuple[tuple[int, int], bool]] = []


def _order(k: int) -> np.ndarray:
    """Within each 32-block its even columns, then its odd ones (the Mosaic kernel's Q4_0 order)."""
    return np.arange(k).reshape(k // 32, 16, 2).swapaxes(1, 2).reshape(k)


def permuting(x, w, tuning=None, *, layer=None, interpret=False, x_in_order=False, **options):
    """x @ w.T as the reference computes it, from x read in `_order`: permuted here unless it
    comes so (`x_in_order`)."""
    order = _order(w.shape[1])
    xp = x if x_in_order else x[..., order]
    CALLS.append((tuple(w.shape), x_in_order))
    return qmatmul_reference(xp[..., np.argsort(order)], w, layer=layer)


permuting.x_order = lambda w, rows: _order(w.shape[1])


def decode_only(x, w, tuning=None, *, layer=None, interpret=False, **options):
    """`permuting` for decode rows (at most 8) only."""
    if np.prod(x.shape[:-1]) > 8:
        raise NotImplementedError("decode rows only")
    return permuting(x, w, layer=layer, **options)


decode_only.x_order = permuting.x_order


def _registered(name, fn):
    impls, chosen = registry._REGISTRY._impls["matmul"], registry._REGISTRY._chosen
    saved, saved_chosen = list(impls), dict(chosen)
    registry.register("matmul", name, fn, priority=1000)
    CALLS.clear()
    yield
    impls[:] = saved
    chosen.clear()
    chosen.update(saved_chosen)


@pytest.fixture
def with_permuting():
    yield from _registered("permuting", permuting)


@pytest.fixture
def with_decode_only():
    yield from _registered("decode_only_permuting", decode_only)


def _loaded(path, **kw):
    cfg = EngineConfig(num_slots=4, max_context=64, prefill_budget=64, prefill_chunks=(8, 64), context_buckets=(64,),
                       **kw)
    return load_model(path, cfg), cfg


def test_head_order():
    d = 32
    per_head = _order(d)
    assert np.array_equal(head_order(np.concatenate([per_head + h * d for h in range(4)]), 4, d), per_head)
    assert head_order(None, 4, d) is None
    assert head_order(np.arange(4 * d), 4, d) is None  # as it is: nothing to store
    assert head_order(_order(8 * 16), 8, 16) is None  # 32-blocks across heads of 16
    mixed = np.concatenate([per_head, np.arange(d) + d])  # one head permuted, the other not
    assert head_order(mixed, 2, d) is None
    assert head_order(np.concatenate([np.arange(d) + d, np.arange(d)]), 2, d) is None  # heads swapped
    assert head_order(np.arange(2 * d), 3, d) is None  # not the heads' columns


def test_values_stored_in_the_output_projections_order_give_the_same_tokens(tiny_tp_path, with_permuting):
    """Loaded with the permuting matmul, the value rows of the fused q/k/v matrix are each kv
    head's rows in that order, the output projection alone gets x_in_order, and the decode
    and prefill logits are those of the load that keeps the model's order (--no-ordered-values)."""
    loaded, plain = _same_logits(tiny_tp_path)
    mc = loaded.config
    d, q_dim, kv_dim = mc.head_dim, mc.q_dim, mc.kv_dim
    rows = (np.arange(mc.num_kv_heads)[:, None] * d + _order(d)[None, :]).reshape(-1)
    ours, theirs = loaded.params.layers["wqkv"], plain.params.layers["wqkv"]
    v_ours, v_theirs = slice_rows(ours, q_dim + kv_dim, q_dim + 2 * kv_dim), slice_rows(theirs, q_dim + kv_dim,
                                                                                        q_dim + 2 * kv_dim)
    for name, p in v_theirs.planes.items():
        axis = p.ndim + v_theirs.format.n_axis(name)
        np.testing.assert_array_equal(np.asarray(v_ours.planes[name]), np.take(np.asarray(p), rows, axis=axis))
    qk = slice_rows(ours, 0, q_dim + kv_dim).planes, slice_rows(theirs, 0, q_dim + kv_dim).planes
    for name in qk[0]:
        np.testing.assert_array_equal(np.asarray(qk[0][name]), np.asarray(qk[1][name]))


def test_values_ordered_in_layer_groups_with_biases(synthetic_gguf, with_permuting):
    """A 12-layer Q4_K_M mix: values fused with nothing in some layers (`wv`, Q6_K), layers in
    groups, the value bias permuted with its rows: the same logits again."""
    loaded, plain = _same_logits(synthetic_gguf("tiny-tp", "q4_k_m", layers=12))
    layers = loaded.params.layers
    assert not loaded.params.is_stacked
    dicts = [d for lp in layers for d in (lp.phases if isinstance(lp, LayerGroup) else [lp])]
    assert any(isinstance(lp, LayerGroup) for lp in layers) and any("wv" in d for d in dicts)
    assert all("bv" in d for d in dicts)


def _same_logits(path):
    """The model loaded with and without ordered values: both loads, after checking that their
    logits agree and that only the output projection took x in order."""
    loaded, _ = _loaded(path)
    plain, _ = _loaded(path, ordered_values=False)
    wo = (loaded.config.embed_dim, loaded.config.q_dim)
    assert {key[1:] for key in loaded.kernels.ordered_values} == {wo} and not plain.kernels.ordered_values
    outputs = same_logits(loaded, plain, CALLS)
    assert {shape for shape, in_order in outputs[0][2] if in_order} == {wo}
    assert all(in_order == (shape == wo) for shape, in_order in outputs[0][2])
    assert not any(in_order for _, in_order in outputs[1][2])
    return loaded, plain


def same_logits(loaded, plain, calls: list) -> list[tuple]:
    """(prefill logits, decode logits, the matmul calls recorded in `calls`) of each load, after
    checking that the two loads' logits agree."""
    outputs = []
    for model in (loaded, plain):
        calls.clear()
        outputs.append((*_prefill_then_decode(model), list(calls)))
    for ours, theirs in zip(outputs[0][:2], outputs[1][:2]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    return outputs


def _prefill_then_decode(model):
    """Logits of a 9-token prompt in slot 1, then of one decode step of slots 0 and 1."""
    cfg, kern, params = model.config, model.kernels, model.params
    cache = forward.KVCache.create(cfg, 4, 64, jnp.float32)
    prompt = jnp.asarray([5, 17, 300, 2, 9, 44, 1000, 3, 71, 0, 0, 0, 0, 0, 0, 0], jnp.int32)
    pre = jax.jit(functools.partial(forward.prefill, cfg, kern))
    logits_p, cache = pre(params, cache, jnp.int32(1), prompt, jnp.int32(0), jnp.int32(9))
    _, cache = pre(params, cache, jnp.int32(0), prompt[::-1], jnp.int32(0), jnp.int32(16))
    dec = jax.jit(functools.partial(forward.decode, cfg, kern))
    logits_d, _ = dec(params, cache, jnp.asarray([7, 8, 0, 0], jnp.int32), jnp.asarray([16, 9, -1, -1], jnp.int32))
    return np.asarray(logits_p), np.asarray(logits_d[:2])


def test_no_order_where_decode_and_prefill_read_x_differently(tiny_tp_path, with_decode_only):
    """A permuting matmul that takes decode rows only leaves prompt chunks to the reference,
    which reads x as it is: no one order (Kernels.x_order None), so the values stay in the
    model's order and no call gets x_in_order."""
    loaded, _ = _loaded(tiny_tp_path)
    plain, _ = _loaded(tiny_tp_path, ordered_values=False)
    assert loaded.kernel_names["matmul_decode[q8_0]"] == "decode_only_permuting"
    assert loaded.kernel_names["matmul[q8_0]"] == "reference"
    assert loaded.kernels.x_order(loaded.params.layers["wo"]) is None and not loaded.kernels.ordered_values
    for name, p in plain.params.layers["wqkv"].planes.items():
        np.testing.assert_array_equal(np.asarray(loaded.params.layers["wqkv"].planes[name]), np.asarray(p))
    CALLS.clear()
    _prefill_then_decode(loaded)
    assert CALLS and not any(in_order for _, in_order in CALLS)
