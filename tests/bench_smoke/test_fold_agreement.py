"""bench/fold_agreement.py's folded model: every matrix with offsets (`q4_k_split.OFFSET_FORMS`)
becomes the bf16 weights of the folded kernel, the rest stays as it is, and a tied output matrix
with offsets is folded for the output head alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bench.fold_agreement import folded_params
from model.weights import Params
from pallas_kernels import legacy_split, q4_k_split
from pallas_kernels.quant import QuantizedTensor
from tests.pallas_kernels.test_matmul_conformance import random_weight


def test_matrices_with_offsets_become_their_folded_weights():
    rng = np.random.default_rng(0)
    split = legacy_split.split_q4_1(random_weight("q4_1", 64, 256, rng))
    plain = random_weight("q8_0", 64, 256, rng)
    params = Params(embed=split, output=None, output_norm=jnp.ones(256), rope_freqs=None,
                    layers={"wq": split, "wo": plain, "norm": jnp.ones(256)}, is_stacked=True)
    got = folded_params(params)
    for w in (got.layers["wq"], got.output):
        assert isinstance(w, QuantizedTensor) and w.fmt == "bf16" and w.shape == (64, 256)
        np.testing.assert_array_equal(np.asarray(w.planes["w"], np.float32),
                                      np.asarray(q4_k_split.folded_dequantize(split)))
    assert got.layers["wo"] is plain and got.embed is split  # the lookup stays exact
    assert got.layers["norm"] is params.layers["norm"]
    untied = Params(embed=split, output=plain, output_norm=jnp.ones(256), rope_freqs=None, layers={}, is_stacked=True)
    assert folded_params(untied).output is plain
