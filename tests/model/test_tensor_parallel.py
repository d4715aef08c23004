"""Tensor parallelism (model/sharding.py): the sharding rules and their errors, in process; and
generation through a ModelRunner with tp=1, 2 and 4 on four forced CPU devices, in a subprocess
(XLA's device-count flag must be set before JAX starts and must not reach the other tests)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from model import sharding
from model.config import EngineConfig, ModelConfig
from model.loader import load_model
from model.weights import LayerGroup, Params
from pallas_kernels.quant import FORMATS, QuantizedTensor
from server.__main__ import build_configs, build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
TP = "tp"

# Runs in the subprocess. Writes one JSON object on stdout: per tp, the greedy and seeded tokens,
# the per-token logprobs of the greedy run, where the cache and a few weights live, and the
# collectives XLA put into the decode program.
WORKER = r'''
import json, re, sys
import jax
import numpy as np
from model.config import EngineConfig
from model.loader import load_model
from model.offline import generate
from model.step_types import SamplingParams

PROMPTS = [[1, 5, 9, 200, 300], [1, 77, 78, 79, 80, 81], [1] + list(range(400, 430))]  # the last: two chunks


class Recorder:
    """A runner that keeps every StepOutput generate() reads."""

    def __init__(self, runner):
        self.runner, self.prefill_chunks, self.outputs = runner, runner.prefill_chunks, []

    def dispatch(self, plan):
        pending, outputs = self.runner.dispatch(plan), self.outputs

        class Result:
            def result(self):
                return self.results()[0]

            def results(self):
                outs = pending.results()
                outputs.extend(outs)
                return outs

        return Result()


def run(path, tp):
    cfg = EngineConfig(num_slots=4, max_context=64, prefill_budget=16, prefill_chunks=(16,), context_buckets=(64,),
                       max_top_logprobs=4, tensor_parallel=tp)
    loaded = load_model(path, cfg)
    runner = loaded.make_runner(cfg)
    runner.warmup()
    rec = Recorder(runner)
    greedy = generate(rec, PROMPTS, 8, sampling=SamplingParams(temperature=0, top_logprobs=4))
    logprobs, top_ids, top_logprobs = [], [], []
    for out in rec.outputs:
        logprobs += out.logprobs[out.valid].tolist()
        top_ids += out.top_ids[out.valid].tolist()
        top_logprobs += out.top_logprobs[out.valid].tolist()
    compiles = []
    listener = lambda event, duration, **_: compiles.append(event) if "compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    seeded = generate(runner, PROMPTS, 8, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    jax.monitoring.unregister_event_duration_listener(listener)
    hlo = runner._program("decode", 4, 64).as_text()  # the compiled decode program
    collectives = sorted({m.groups() for m in re.finditer(
        r"= \(?(\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
        hlo)})
    spec = lambda x: str(getattr(x.sharding, "spec", None))
    layers = loaded.params.layers
    return dict(
        greedy=greedy, seeded=seeded, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
        kernels=loaded.kernel_names, collectives=collectives, compiles=compiles,
        specs=dict(cache=spec(runner._cache.k), wq=spec(layers["wq" if "wq" in layers else "wqkv"].planes["qs"]),
                   wo=spec(layers["wo"].planes["d"]), embed=spec(loaded.params.embed.planes["qs"])),
    )


sys.stdout.write(json.dumps({tp: run(sys.argv[1], tp) for tp in (1, 2, 4)}))
'''


def run_on_four_cpu_devices(worker: str, path: pathlib.Path, timeout: float) -> dict[int, dict]:
    """Runs a worker script in a subprocess whose JAX sees four CPU devices; its stdout is one
    JSON object keyed by tp."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, "-c", worker, str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"tensor-parallel worker failed:\n{proc.stderr[-4000:]}")
    return {int(tp): r for tp, r in json.loads(proc.stdout).items()}


@pytest.fixture(scope="module")
def runs(tiny_tp_path: pathlib.Path) -> dict[int, dict]:
    return run_on_four_cpu_devices(WORKER, tiny_tp_path, 300)


# ---------------------------------------------------------------------------------------------
# end to end, on four CPU devices


def test_greedy_tokens_identical_across_tp(runs) -> None:
    assert len({tok for seq in runs[1]["greedy"] for tok in seq}) > 3  # the tokens vary: a real check
    for tp in (2, 4):
        assert runs[tp]["greedy"] == runs[1]["greedy"], f"tp={tp}"


def test_logprobs_close_across_tp(runs) -> None:
    ref = runs[1]
    top = np.array(ref["top_logprobs"])  # the greedy runs asked for 4 alternatives per token
    assert np.isfinite(top).all() and (np.diff(top, axis=1) <= 0).all()
    np.testing.assert_allclose(top[:, 0], ref["logprobs"], rtol=1e-5, atol=1e-6)  # greedy: the best one
    for tp in (2, 4):
        assert runs[tp]["top_ids"] == ref["top_ids"], f"tp={tp}"
        np.testing.assert_allclose(runs[tp]["logprobs"], ref["logprobs"], rtol=1e-4, atol=1e-6, err_msg=f"tp={tp}")
        np.testing.assert_allclose(runs[tp]["top_logprobs"], ref["top_logprobs"], rtol=1e-4, atol=1e-6,
                                   err_msg=f"tp={tp}")


def test_seeded_sampling_identical_across_tp(runs) -> None:
    # jax.random's bits do not depend on how the sampled arrays are sharded
    for tp in (2, 4):
        assert runs[tp]["seeded"] == runs[1]["seeded"], f"tp={tp}"


def test_nothing_compiles_after_warmup(runs) -> None:
    for tp in (1, 2, 4):
        assert runs[tp]["compiles"] == [], f"tp={tp}"


def test_arrays_live_where_the_rules_say(runs) -> None:
    for tp in (2, 4):
        assert runs[tp]["specs"] == {
            "cache": str(P(None, None, None, TP, None)),
            "wq": str(P(None, TP, None)),
            "wo": str(P(None, TP, None)),  # q8_0 scales are held [L, K/32, N]: a row split shards K/32
            "embed": str(P(TP, None)),
        }
        kernels = runs[tp]["kernels"]  # the CPU's: the references, and decode attention's own
        assert kernels["attention_decode"] == "chunked"
        assert {name for op, name in kernels.items() if op != "attention_decode"} == {"reference"}


def test_sampling_runs_on_logits_gathered_once(runs) -> None:
    """The vocab-parallel head's logits [B, V] are gathered once, and sampling (penalties, sort,
    softmax, argmax) runs whole on every device: no other activation collective than the
    row-parallel all-reduce [B, E]. The rest are the vocab-parallel embedding lookup's (its
    planes' rows, combined by XLA with an all-reduce)."""
    collectives = {tuple(c) for c in runs[4]["collectives"]}
    assert {c for c in collectives if c[0] in ("f32", "s32", "pred")} == {
        ("f32", "4,256", "all-reduce"), ("f32", "4,2048", "all-gather")}
    assert {c[2] for c in collectives} <= {"all-reduce", "all-gather"}


def test_xla_reduces_activations_and_never_gathers_weights(runs) -> None:
    collectives = {tuple(c) for c in runs[4]["collectives"]}
    assert ("f32", "4,256", "all-reduce") in collectives  # row-parallel matmul partial sums [B, E]
    weight_gathers = [c for c in collectives if c[2] == "all-gather" and c[0] in ("s8", "u8", "f16", "bf16")]
    assert weight_gathers == []  # weight planes are int8/uint8/f16: none is gathered
    assert runs[1]["collectives"] == []


# ---------------------------------------------------------------------------------------------
# sharding rules and errors, in process (shapes only)

E, H, KV, D, F, V, L = 256, 8, 4, 32, 768, 2048, 2


def _qt(fmt: str, n: int, k: int, stack: tuple[int, ...] = ()) -> QuantizedTensor:
    f = FORMATS[fmt]
    dtypes = f.plane_dtypes()
    return QuantizedTensor({p: np.zeros((*stack, *s), dtypes[p]) for p, s in f.plane_shapes(n, k).items()}, fmt, (n, k))


def _layer(stack: tuple[int, ...], down_fmt: str = "q8_0", down_k: int = F) -> dict:
    vec = lambda n: np.zeros((*stack, n), np.float32)  # noqa: E731
    return {
        "attn_norm": vec(E), "wq": _qt("q4_0", H * D, E, stack), "wk": _qt("q8_0", KV * D, E, stack),
        "wv": _qt("q6_k", KV * D, E, stack), "bq": vec(H * D), "bk": vec(KV * D), "bv": vec(KV * D),
        "q_norm": vec(D), "k_norm": vec(D), "wo": _qt("q4_0", E, H * D, stack), "ffn_norm": vec(E),
        "w_gate": _qt("q4_0", down_k, E, stack), "w_up": _qt("q4_0", down_k, E, stack),
        "w_down": _qt(down_fmt, E, down_k, stack),
    }


def _params(is_stacked: bool = True, **layer_kw) -> Params:
    layers = _layer((L,), **layer_kw) if is_stacked else [_layer((), **layer_kw) for _ in range(L)]
    return Params(embed=_qt("q8_0", V, E), output=_qt("q6_k", V, E), output_norm=np.ones(E, np.float32),
                  rope_freqs=None, layers=layers, is_stacked=is_stacked)


def _plane_specs(qt: QuantizedTensor) -> set:
    return set(qt.planes.values())


def _split_axis(qt: QuantizedTensor, split: str, lead: tuple) -> dict:
    """Per plane, the spec that shards its N axis (column split) or its packed X axis (row
    split); the transposed planes (q4_0/q8_0 scales [*S, K/32, N]) hold those axes swapped."""
    fmt = qt.format
    out = {}
    for name in qt.planes:
        axis = fmt.n_axis(name) if split == "column" else fmt.x_axis(name)
        out[name] = P(*lead, *((TP, None) if axis == -2 else (None, TP)))
    return out


@pytest.mark.parametrize("layout", ["stacked", "list", "groups"])
def test_megatron_rules(layout: str) -> None:
    params = _params(layout == "stacked")
    if layout == "groups":  # a LayerGroup of two phases of [2] stacks, then a single layer
        params.layers = [LayerGroup([_layer((2,)), _layer((2,))], 0, 2), _layer(())]
    specs = sharding.param_specs(params, 4)
    if layout == "stacked":
        layers = [((None,), specs.layers)]
    else:
        layers = [(s, layer) for entry in specs.layers
                  for s, layer in ([((None,), ph) for ph in entry.phases] if isinstance(entry, LayerGroup)
                                   else [((), entry)])]
    assert len(layers) == {"stacked": 1, "list": L, "groups": 3}[layout]
    for s, layer in layers:
        for key in ("wq", "wk", "wv", "w_gate", "w_up"):  # column-parallel: rows N
            assert layer[key].planes == _split_axis(layer[key], "column", s), key
            assert layer[key].planes[layer[key].format.planes[0]] == P(*s, TP, None), key  # the codes
        for key in ("wo", "w_down"):  # row-parallel: the packed K of every plane
            assert layer[key].planes == _split_axis(layer[key], "row", s), key
            assert layer[key].planes[layer[key].format.planes[0]] == P(*s, None, TP), key
        assert layer["wo"].planes["d"] == P(*s, TP, None)  # q4_0 scales [*S, K/32, N]: K/32 splits
        for key in ("bq", "bk", "bv"):
            assert layer[key] == P(*s, TP), key
        for key in ("attn_norm", "ffn_norm", "q_norm", "k_norm"):
            assert layer[key] == P(), key
    assert specs.embed.planes == _split_axis(specs.embed, "column", ())  # vocab-parallel
    assert _plane_specs(specs.output) == {P(TP, None)}
    assert specs.output_norm == P() and specs.rope_freqs is None


def test_tp_one_shards_nothing_but_accepts_every_shape() -> None:
    specs = sharding.param_specs(_params(down_fmt="q4_k", down_k=512), 1)  # every rule holds for tp=1
    assert _plane_specs(specs.layers["w_down"]) == {P(None, None, TP)}


def test_row_parallel_needs_whole_blocks_per_device() -> None:
    params = _params(down_fmt="q4_k", down_k=512)  # 512 / 2 = one 256-block each; 512 / 4 = 128: half a block
    sharding.param_specs(params, 2)
    with pytest.raises(ValueError, match=r"w_down \(q4_k\).*128 per device.*256-element block"):
        sharding.param_specs(params, 4)


def test_unknown_layer_tensor_is_an_error() -> None:
    params = _params()
    params.layers["mystery"] = np.zeros((L, E), np.float32)
    with pytest.raises(ValueError, match="mystery: no tensor-parallel rule"):
        sharding.param_specs(params, 2)


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", num_layers=2, embed_dim=E, ffn_dim=F, num_heads=H, num_kv_heads=KV, head_dim=D,
                vocab_size=V, context_length=64, rms_eps=1e-5, rope_theta=1e4, rope_dim=D, rope_neox=False)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize(("kw", "tp", "what"), [
    (dict(num_heads=12, num_kv_heads=4), 8, "attention heads"),
    (dict(num_kv_heads=2), 4, "kv heads"),
    (dict(ffn_dim=770), 4, "ffn size"),
    (dict(vocab_size=2050), 4, "vocabulary size"),
])
def test_divisibility_errors(kw: dict, tp: int, what: str) -> None:
    sharding.check_divisible(_cfg(), 4)
    with pytest.raises(ValueError, match=f"tensor parallel {tp} does not divide the model's {what}"):
        sharding.check_divisible(_cfg(**kw), tp)


def test_load_refuses_a_model_that_does_not_split(tiny_tp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="tensor parallel 3 does not divide the model's attention heads"):
        load_model(tiny_tp_path, EngineConfig(tensor_parallel=3))


def test_mesh_needs_enough_devices() -> None:
    n = len(jax.devices())
    assert sharding.make_mesh(n).shape == {TP: n}
    with pytest.raises(ValueError, match=f"tensor parallel {n + 1} needs {n + 1} devices"):
        sharding.make_mesh(n + 1)


# Runs in a subprocess on four CPU devices: the Triton kernels (Pallas interpret mode) under
# model.sharding.shard_kernels at tp=4 against the same kernels on one device, on tiny-tp. Prints
# the logits of a prefill and of a decode step for each, and the matmul shapes the kernel saw.
PALLAS_WORKER = r'''
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from model import forward, sharding
from model.config import ModelConfig
from model.forward import Kernels, KVCache
from model.gguf_file import GGUFFile
from model.weights import load_params
from pallas_kernels import attention_triton, attention_triton_prefill, matmul_triton
from pallas_kernels.matmul import embed_reference

gf = GGUFFile(sys.argv[1])
cfg = ModelConfig.from_gguf_metadata(gf.metadata, frozenset(gf.tensors))
seen = []

def mm(x, w, layer=None, split=None, elementwise_x=False):
    seen.append([split, list(w.shape), elementwise_x])
    return matmul_triton.qmatmul_triton(x.astype(jnp.float32), w, layer=layer, interpret=True)

kern = Kernels(mm, embed_reference, functools.partial(attention_triton.attention_decode_triton, interpret=True),
               functools.partial(attention_triton_prefill.attention_prefill_triton, interpret=True),
               decode_writes_cache=True)  # each device's kernel writes its own kv heads
prompt = jnp.asarray(np.arange(5, 21), jnp.int32)  # 16 tokens into slot 1

def run(tp):
    kv = jnp.float32
    if tp == 1:
        params, k, cache = load_params(gf, cfg, fuse=False), kern, KVCache.create(cfg, 2, 64, kv)
    else:
        mesh = sharding.make_mesh(tp)
        params = load_params(gf, cfg, fuse=False, place=sharding.placer(mesh))
        k, cache = sharding.shard_kernels(kern, mesh), sharding.create_cache(cfg, 2, 64, kv, mesh)
    seen.clear()
    pre = jax.jit(functools.partial(forward.prefill, cfg, k), static_argnums=(6,))
    logits_p, cache = pre(params, cache, jnp.int32(1), prompt, jnp.int32(0), jnp.int32(16), 32)
    shapes = list(seen)
    dec = jax.jit(functools.partial(forward.decode, cfg, k), static_argnums=(4,))
    logits_d, cache = dec(params, cache, jnp.asarray([0, 7], jnp.int32), jnp.asarray([-1, 16], jnp.int32), 32)
    # the next step attends to the key the first one wrote
    logits_d2, _ = dec(params, cache, jnp.asarray([0, 9], jnp.int32), jnp.asarray([-1, 17], jnp.int32), 32)
    return dict(prefill=np.asarray(logits_p).tolist(), decode=np.asarray(logits_d[1]).tolist(),
                decode2=np.asarray(logits_d2[1]).tolist(), shapes=shapes)

print(json.dumps({tp: run(tp) for tp in (1, 4)}))
'''


def test_pallas_kernels_run_per_shard(tiny_tp_path: pathlib.Path) -> None:
    """shard_kernels runs each Pallas kernel on its device's shard (the kernel sees N/4 rows of a
    column-parallel matrix and K/4 of a row-parallel one) and the sharded forward pass gives the
    logits of the same kernels on one device."""
    runs = run_on_four_cpu_devices(PALLAS_WORKER, tiny_tp_path, 600)
    for what in ("prefill", "decode", "decode2"):
        ref, got = np.asarray(runs[1][what]), np.asarray(runs[4][what])
        assert np.abs(ref).max() > 0.1 and np.isfinite(got).all()
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 1e-4, f"{what}: relative error {err:.3g}"
        assert int(np.argmax(got)) == int(np.argmax(ref))
    # tiny-tp: E 256, 8 heads of 32, 4 kv heads, F 768, V 2048 (tied output)
    one = {(split, tuple(shape)) for split, shape, _ in runs[1]["shapes"]}
    four = {(split, tuple(shape)) for split, shape, _ in runs[4]["shapes"]}
    assert ("column", (256, 256)) in one and ("row", (256, 768)) in one
    assert four == {("column", (64, 256)), ("column", (32, 256)), ("row", (256, 64)), ("column", (192, 256)),
                    ("row", (256, 192)), ("column", (512, 256))}
    # the forward pass's elementwise_x (wo's and w_down's x) reaches each shard's kernel: those two
    # are the row-parallel matrices
    assert {(split, ew) for split, _, ew in runs[1]["shapes"]} == {("column", False), ("row", True), ("vocab", False)}
    assert {(split, ew) for split, _, ew in runs[4]["shapes"]} == {("column", False), ("row", True)}  # vocab: column


def test_kernels_are_probed_on_per_device_shapes() -> None:
    from model.kernels import _shard_shapes

    both = {"column", "row"}
    w = _qt("q4_k", 512, 1024)
    assert _shard_shapes(w, both, 1) == [w]
    col, row = _shard_shapes(w, both, 4)
    assert col.shape == (128, 1024) and col.planes["qs"].shape == (128, 512)
    assert row.shape == (512, 256) and row.planes["qs"].shape == (512, 128) and row.planes["d"].shape == (512, 1)
    # a row split that would cut a 256-element super-block is not a shape any device gets
    assert [t.shape for t in _shard_shapes(_qt("q4_k", 512, 512), both, 4)] == [(128, 512)]
    # only the split the matrix gets is probed; a transposed plane splits along its own axes
    (col,) = _shard_shapes(_qt("q4_0", 512, 1024), {"column"}, 4)
    assert col.shape == (128, 1024) and col.planes["d"].shape == (32, 128)
    (row,) = _shard_shapes(_qt("q4_0", 512, 1024), {"row"}, 4)
    assert row.shape == (512, 256) and row.planes["d"].shape == (8, 512) and row.planes["qs"].shape == (512, 128)


def test_config_and_flag() -> None:
    with pytest.raises(ValueError, match="tensor parallel must be >= 1"):
        EngineConfig(tensor_parallel=0)
    assert build_configs(build_parser().parse_args([]), {})[0].tensor_parallel == 1
    assert build_configs(build_parser().parse_args(["--tensor-parallel", "4"]), {})[0].tensor_parallel == 4
