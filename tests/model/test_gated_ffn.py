"""model/gated_ffn.py: gate/up rows interleaved at load for a matmul that makes the gated
activation itself, checked on the CPU with matmuls registered for the test: one that reads x in
a permuted order of its own (as the Mosaic GPU kernel does for Q4_0) and takes `gated=act`, the
product made from the reference's output as the kernel's epilogue defines it."""

from __future__ import annotations

import numpy as np
import pytest

from model.weights import LayerGroup
from pallas_kernels import gated as gated_ops
from tests.model.test_ordered_values import _loaded, _order, _registered, permuting, same_logits

CALLS: list[tuple[tuple[int, int], str | None, bool]] = []


def gating(x, w, tuning=None, *, layer=None, interpret=False, gated=None, x_in_order=False, **options):
    """`permuting`, and with `gated` the product of the interleaved rows (`from_interleaved`)."""
    CALLS.append((tuple(w.shape), gated, x_in_order))
    y = permuting(x, w, layer=layer, x_in_order=x_in_order)
    return y if gated is None else gated_ops.from_interleaved(y, gated)


gating.x_order = permuting.x_order
gating.takes_gated = lambda w, rows, act: act in gated_ops.ACTIVATIONS


def decode_only(x, w, tuning=None, *, layer=None, interpret=False, **options):
    """`gating` for decode rows (at most 8) only: prompt chunks get the reference."""
    if np.prod(x.shape[:-1]) > 8:
        raise NotImplementedError("decode rows only")
    return gating(x, w, layer=layer, **options)


decode_only.x_order = gating.x_order
decode_only.takes_gated = gating.takes_gated


@pytest.fixture
def with_gating():
    CALLS.clear()
    yield from _registered("gating", gating)


@pytest.fixture
def with_decode_only():
    CALLS.clear()
    yield from _registered("decode_only_gating", decode_only)


def _same_logits(path):
    loaded, _ = _loaded(path)
    plain, _ = _loaded(path, gated_ffn=False)
    assert not plain.kernels.gated_ffn
    outputs = same_logits(loaded, plain, CALLS)
    return loaded, plain, outputs[0][2], outputs[1][2]


def test_gate_up_interleaved_in_the_down_projections_order_give_the_same_logits(tiny_tp_path, with_gating):
    """The gate/up rows are interleaved with the features in the down projection's x order, the
    gate/up matmul gets gated=silu and the down projection x_in_order, and the decode and
    prefill logits are those of the load that keeps the model's order (--no-gated-ffn)."""
    loaded, plain, calls, plain_calls = _same_logits(tiny_tp_path)
    mc = loaded.config
    up_shape, down_shape = (2 * mc.ffn_dim, mc.embed_dim), (mc.embed_dim, mc.ffn_dim)
    assert loaded.kernels.gated_ffn == {(("q8_0", *up_shape), ("q8_0", *down_shape), True)}
    index = gated_ops.interleave_index(mc.ffn_dim, _order(mc.ffn_dim))
    ours, theirs = loaded.params.layers["w_gate_up"], plain.params.layers["w_gate_up"]
    for name, p in theirs.planes.items():
        axis = p.ndim + theirs.format.n_axis(name)
        np.testing.assert_array_equal(np.asarray(ours.planes[name]), np.take(np.asarray(p), index, axis=axis))
    assert {g for shape, g, _ in calls if shape == up_shape} == {"silu"}
    assert all(in_order for shape, _, in_order in calls if shape == down_shape)
    assert not any(g for _, g, _ in plain_calls)
    assert not any(in_order for shape, _, in_order in plain_calls if shape == down_shape)


def test_interleaved_in_layer_groups(synthetic_gguf, with_gating):
    """A 12-layer Q4_K_M mix (the down projection Q6_K in some layers, layers in groups): every
    layer's gate/up interleaved by its own down projection's key, and the same logits."""
    loaded, _, calls, _ = _same_logits(synthetic_gguf("tiny-tp", "q4_k_m", layers=12))
    dicts = [d for lp in loaded.params.layers for d in (lp.phases if isinstance(lp, LayerGroup) else [lp])]
    assert any(isinstance(lp, LayerGroup) for lp in loaded.params.layers)
    assert len({key[1][0] for key in loaded.kernels.gated_ffn}) == 2  # two formats of w_down
    assert all(d["w_gate_up"].shape[0] == 2 * loaded.config.ffn_dim for d in dicts)
    assert any(g == "silu" for _, g, _ in calls)


def test_decode_only_gating_leaves_prompt_chunks_the_product_after_the_call(tiny_tp_path, with_decode_only):
    """Where prompt chunks go to the reference (no epilogue, x as it is), the down projection's x
    has no one order: the features stay in the model's order, and the chunks' product is made
    from the reference's output (model/kernels.py); the logits are the same."""
    loaded, _, calls, _ = _same_logits(tiny_tp_path)
    mc = loaded.config
    assert loaded.kernel_names["matmul[q8_0]"] == "reference"
    key = next(iter(loaded.kernels.gated_ffn))
    assert key[-1] is False  # the product as it is, not in an x order
    assert {g for shape, g, _ in calls if shape == (2 * mc.ffn_dim, mc.embed_dim)} == {"silu"}


def test_no_interleave_without_a_gating_matmul(tiny_tp_path):
    """The reference matmul has no epilogue: nothing is interleaved."""
    loaded, _ = _loaded(tiny_tp_path)
    assert not loaded.kernels.gated_ffn
