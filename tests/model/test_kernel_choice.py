"""model/kernels.py chooses the matmul per weight format twice: for decode (x of up to num_slots
rows) and for prefill chunks, probing every matrix shape of the format; at run time a call goes
to one or the other by its rows. Checked with a decode-only implementation registered for the
test beside the reference (what the Mosaic GPU kernel is on a Hopper GPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from model.config import EngineConfig
from model.loader import load_model
from pallas_kernels import registry
from pallas_kernels.matmul import qmatmul_reference

CALLS: list[int] = []


def decode_only(x, w, tuning=None, *, layer=None, interpret=False):
    rows = int(np.prod(x.shape[:-1]))
    if rows > 8:
        raise NotImplementedError("decode only: at most 8 rows")
    CALLS.append(rows)
    return qmatmul_reference(x, w, layer=layer)


@pytest.fixture
def with_decode_only():
    impls, chosen = registry._REGISTRY._impls["matmul"], registry._REGISTRY._chosen
    saved, saved_chosen = list(impls), dict(chosen)
    registry.register("matmul", "decode_only", decode_only, priority=1000)
    CALLS.clear()
    yield
    impls[:] = saved
    chosen.clear()
    chosen.update(saved_chosen)


def _loaded(path, **kw):
    cfg = EngineConfig(num_slots=8, max_context=64, prefill_budget=64, prefill_chunks=(8, 64), context_buckets=(64,),
                       **kw)
    return load_model(path, cfg), cfg


def test_decode_and_prefill_are_chosen_and_routed_apart(tiny_tp_path, with_decode_only):
    loaded, cfg = _loaded(tiny_tp_path)
    names = loaded.kernel_names
    assert names["matmul_decode[q8_0]"] == "decode_only"  # takes every shape at 8 rows
    assert names["matmul[q8_0]"] == "reference"  # refuses the 64-row chunk
    w = loaded.params.layers["wo"]
    k = w.shape[1]
    for rows, expect in ((8, [8]), (1, [1]), (64, [])):
        CALLS.clear()
        y = loaded.kernels.matmul(jnp.ones((rows, k), jnp.float32), w, layer=0)
        assert y.shape == (rows, w.shape[0]) and CALLS == expect


def test_forcing_the_decode_matmul_alone(tiny_tp_path, with_decode_only):
    loaded, _ = _loaded(tiny_tp_path, kernels=(("matmul_decode", "reference"),))
    assert loaded.kernel_names["matmul_decode[q8_0]"] == "reference"
    loaded, _ = _loaded(tiny_tp_path, kernels=(("matmul", "reference"),))  # both regimes
    assert loaded.kernel_names["matmul_decode[q8_0]"] == "reference" == loaded.kernel_names["matmul[q8_0]"]
    with pytest.raises(NotImplementedError, match="forced implementation 'decode_only'"):
        _loaded(tiny_tp_path, kernels=(("matmul", "decode_only"),))  # it cannot take the prefill chunk


def test_a_shape_the_first_kernel_refuses_gets_its_own_choice(tiny_tp_path, with_decode_only):
    """Where no implementation takes every shape of a format, each shape gets the first that
    takes it (as a row-parallel shard can leave the Mosaic kernel's tiling), named per shape."""
    loaded, _ = _loaded(tiny_tp_path)
    down = loaded.params.layers["w_down"]
    n_down, k_down = down.shape

    def refuses_down(x, w, tuning=None, *, layer=None, interpret=False):
        if w.shape == (n_down, k_down):
            raise NotImplementedError("not this shape")
        return decode_only(x, w, layer=layer)

    impls = registry._REGISTRY._impls["matmul"]  # restored by the fixture
    assert impls[0].name == "decode_only"
    impls[0] = dataclasses.replace(impls[0], fn=refuses_down)
    loaded, _ = _loaded(tiny_tp_path)
    names = loaded.kernel_names
    assert "matmul_decode[q8_0]" not in names
    assert names[f"matmul_decode[q8_0 {n_down}x{k_down}]"] == "reference"
    others = {k: v for k, v in names.items() if k.startswith("matmul_decode[q8_0 ") and f"{n_down}x{k_down}" not in k}
    assert others and set(others.values()) == {"decode_only"}
    for name, expect in (("wo", [8]), ("w_down", [])):
        w = loaded.params.layers[name]
        CALLS.clear()
        y = loaded.kernels.matmul(jnp.ones((8, w.shape[1]), jnp.float32), w, layer=0)
        assert y.shape == (8, w.shape[0]) and CALLS == expect, name
    assert loaded.kernel_names["matmul[q8_0]"] == "reference"


def test_x_made_by_elementwise_ops_is_announced_only_to_a_matmul_that_takes_it(tiny_tp_path, with_decode_only):
    """Kernels.matmul(..., elementwise_x=True) (the forward pass's output and down projections)
    passes `gather_x=True` to an implementation with a `takes_gather_x` attribute (the Mosaic GPU
    matmul's), nothing to the others, nor with EngineConfig.gather_x off; and the forward pass
    says it for exactly those matrices."""
    options: list[tuple] = []

    def gathers(x, w, tuning=None, *, layer=None, interpret=False, **kw):
        options.append((tuple(w.shape), kw))
        return qmatmul_reference(x, w, layer=layer)

    gathers.takes_gather_x = True
    loaded, _ = _loaded(tiny_tp_path)
    w = loaded.params.layers["wo"]
    x = jnp.ones((8, w.shape[1]), jnp.float32)
    CALLS.clear()
    loaded.kernels.matmul(x, w, 0, elementwise_x=True)  # decode_only: no `takes_gather_x`, takes no option
    assert CALLS == [8]
    registry.register("matmul", "gathers", gathers, priority=2000)
    loaded, cfg = _loaded(tiny_tp_path)
    assert loaded.kernel_names["matmul_decode[q8_0]"] == "gathers"
    options.clear()
    loaded.kernels.matmul(x, w, 0, elementwise_x=True)
    loaded.kernels.matmul(x, w, 0)
    assert options == [(tuple(w.shape), {"gather_x": True}), (tuple(w.shape), {})]
    options.clear()
    loaded.make_runner(cfg).warmup()  # traces the decode and prefill programs (all through `gathers`)
    layers = loaded.params.layers
    gathered = {tuple(layers[k].shape) for k in ("wo", "w_down")}
    assert {s for s, kw in options if kw} == gathered
    assert {s for s, kw in options if not kw} == {tuple(layers[k].shape) for k in ("wqkv", "w_gate_up")} | {
        tuple(loaded.params.output.shape)}
    loaded, _ = _loaded(tiny_tp_path, gather_x=False)  # --no-gather-x (A/B): never asked
    options.clear()
    loaded.kernels.matmul(x, w, 0, elementwise_x=True)
    assert options == [(tuple(w.shape), {})]


def test_unknown_forced_op_is_an_error(tiny_tp_path):
    with pytest.raises(ValueError, match="unknown ops"):
        _loaded(tiny_tp_path, kernels=(("matmul_prefill", "reference"),))


def test_the_kv_write_goes_to_an_attention_kernel_that_takes_it(tiny_tp_path):
    """A decode attention that writes the cache itself (a `writes_cache` attribute, as the Triton
    kernel has) is handed the write (Kernels.decode_writes_cache) unless the engine asks for
    separate scatters (EngineConfig.separate_kv_write); the CPU's own is never handed it."""
    from pallas_kernels.attention import attention_decode_reference

    def writes(*args, **kwargs):
        return attention_decode_reference(*args, **kwargs)

    writes.writes_cache = True
    loaded, _ = _loaded(tiny_tp_path)
    assert loaded.kernel_names["attention_decode"] == "chunked" and not loaded.kernels.decode_writes_cache
    impls, chosen = registry._REGISTRY._impls["attention_decode"], registry._REGISTRY._chosen
    saved, saved_chosen = list(impls), dict(chosen)
    registry.register("attention_decode", "writes", writes, priority=1000)
    try:
        loaded, _ = _loaded(tiny_tp_path)
        assert loaded.kernel_names["attention_decode"] == "writes" and loaded.kernels.decode_writes_cache
        loaded, _ = _loaded(tiny_tp_path, separate_kv_write=True)
        assert not loaded.kernels.decode_writes_cache
    finally:
        impls[:] = saved
        chosen.clear()
        chosen.update(saved_chosen)


def test_the_few_rows_attention_plan_can_be_turned_off(tiny_tp_path):
    """A decode attention with a plan for few busy rows (a `few_rows_limit` attribute, as the
    Triton kernel has) gets it used by default, and not under `few_rows_attention=False`
    (`--no-few-rows-attention`)."""
    from pallas_kernels.attention import attention_decode_reference

    def with_plan(*args, few_rows=False, **kwargs):
        return attention_decode_reference(*args, **kwargs)

    with_plan.few_rows_limit = lambda rows, kv_heads, groups, head_dim, itemsize, span: rows // 4 if span >= 64 else 0
    impls, chosen = registry._REGISTRY._impls["attention_decode"], registry._REGISTRY._chosen
    saved, saved_chosen = list(impls), dict(chosen)
    registry.register("attention_decode", "with_plan", with_plan, priority=1000)
    try:
        loaded, _ = _loaded(tiny_tp_path, few_rows_attention=False)
        assert loaded.kernel_names["attention_decode"] == "with_plan"
        assert loaded.kernels.decode_few_rows_limit(64) == 0
        loaded, _ = _loaded(tiny_tp_path)
        assert loaded.kernels.decode_few_rows_limit(64) == 2  # 8 slots // 4
        assert loaded.kernels.decode_few_rows_limit(32) == 0  # not a bucket of this engine
    finally:
        impls[:] = saved
        chosen.clear()
        chosen.update(saved_chosen)


def test_ggml_numerics_refuses_what_it_does_not_reproduce(synthetic_gguf, tiny_tp_path):
    """`--numerics ggml` runs only what ggml_cpu reproduces, and says what it refuses (the model
    tests run it on SmolLM2: test_llama_cpp_agreement.py)."""
    with pytest.raises(ValueError, match="f16 cache"):
        EngineConfig(numerics="ggml", kv_dtype="float32")
    with pytest.raises(ValueError, match="q8_0 matrices"):  # Q8_0 beyond the embedding and head
        _loaded(tiny_tp_path, numerics="ggml", kv_dtype="float16")
    with pytest.raises(ValueError, match="chooses every kernel itself"):
        _loaded(synthetic_gguf("tiny", "q4_1"), numerics="ggml", kv_dtype="float16", kernels=(("matmul", "reference"),))
    with pytest.raises(ValueError, match=r"q6_k matrices \[2048, 256\]"):  # the file's head, as llama.cpp quantizes
        _loaded(synthetic_gguf("tiny", "q4_1"), numerics="ggml", kv_dtype="float16")


def test_auto_numerics_fall_back_to_native_and_the_cache_dtype_follows(tiny_tp_path):
    """`--numerics auto` runs native where ggml is refused; on the CPU its cache is llama.cpp's
    f16 (as ggml's), native's f32."""
    from scheduler.loader import resolve_kv_dtype

    loaded, _ = _loaded(tiny_tp_path, numerics="auto", kv_dtype="float16")  # Q8_0 matrices: refused
    assert loaded.kernels.numerics == "native" and "ggml_cpu" not in loaded.kernel_names.values()
    kv = {n: resolve_kv_dtype(EngineConfig(numerics=n, kv_dtype="auto")).kv_dtype for n in ("auto", "ggml", "native")}
    assert kv == {"auto": "float16", "ggml": "float16", "native": "float32"}
