"""Conformance of op "matmul" implementations with the reference (`qmatmul_reference`).

One shared base class (`MatmulConformance`) states what every implementation must do: same
function as the reference on fresh random quantized weights and activations, to a relative norm
error bounded per activation dtype (f32 1e-5, bf16 1e-2), every output element written and
finite (NaN never passes). Subclasses bind an implementation and a list of cases: the Triton
kernels in Pallas interpret mode on the CPU (small shapes), and the same kernels compiled for
the GPU (marked `gpu`, skipped where there is none). Run the GPU half with
`JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/pallas_kernels/test_matmul_conformance.py`
(tests/conftest.py otherwise forces the CPU).

Unwritten outputs: Pallas interpret mode starts every output buffer as NaN, and the GPU subclass
fills and frees a NaN buffer before each call so that the allocator hands that memory to the
kernel's output; either way an element the kernel never writes fails the finiteness check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from pallas_kernels import matmul_triton, quant, registry
from pallas_kernels.matmul import qmatmul_reference
from pallas_kernels.matmul_triton import TritonMatmulTuning

# Byte offsets of the f16 fields (d, m / dmin) in each GGUF block (ggml's block structs). Random
# bytes there would give NaN/inf scales; these get sane values instead.
F16_OFFSETS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}
GGUF_QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # gguf-py can quantize these
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def random_weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> quant.QuantizedTensor:
    """Random GGUF blocks through `quant.repack`: from gguf-py's quantizer (formats it can
    quantize, half of the time) or random bytes with sane f16 scales."""
    qtype = quant.FORMATS[fmt].ggml_type
    if fmt in GGUF_QUANTIZABLE and rng.random() < 0.5:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
        for off in F16_OFFSETS[fmt]:
            scale = rng.uniform(1e-3, 0.1, (n, k // block_size, 1)).astype(np.float16)
            blocks[..., off : off + 2] = scale.view(np.uint8)
        data = blocks.reshape(n, -1)
    return jax.device_put(quant.repack(data, qtype, (n, k)))


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    m: int
    n: int
    k: int
    x_dtype: str  # "float32" | "bfloat16"
    tuning: Any = None  # the implementation's tuning (TritonMatmulTuning, ...); None: its own choice
    stack: bool = False  # also run the stacked-weight test on this case

    @property
    def id(self) -> str:
        t = self.tuning
        kernel = getattr(t, "kernel", "tiled")  # the jax-triton tuning has one kernel per format
        tag = "default" if t is None else f"{kernel}-bn{t.block_n}-bk{t.block_k}-sk{t.split_k}-bm{t.block_m}"
        return f"{self.fmt}-m{self.m}-{self.n}x{self.k}-{self.x_dtype}-{tag}"


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = metafunc.cls.CASES
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


class MatmulConformance:
    """Shared conformance checks for op "matmul"; subclasses set CASES and `matmul`."""

    CASES: tuple[Case, ...] = ()

    def matmul(self, x: jax.Array, w: quant.QuantizedTensor, case: Case, layer=None) -> jax.Array:
        raise NotImplementedError

    def poison(self) -> None:
        """Make memory the next output may land in non-finite (hook for the GPU)."""

    def test_matches_reference(self, case: Case):
        seed = int(np.random.SeedSequence().entropy % (1 << 63))  # fresh inputs every run
        rng = np.random.default_rng(seed)
        w = random_weight(case.fmt, case.n, case.k, rng)
        x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.float32).astype(case.x_dtype)
        self.poison()
        y = self.matmul(x, w, case)
        assert y.shape == (case.m, case.n) and y.dtype == jnp.float32, (y.shape, y.dtype)
        y = np.asarray(y)
        expected = np.asarray(qmatmul_reference(x, w))
        bad = ~np.isfinite(y)
        assert not bad.any(), f"seed {seed}: {bad.sum()} non-finite outputs (unwritten or NaN), first at " \
                              f"{np.argwhere(bad)[0].tolist()}"
        err = relative_error(y, expected)
        assert err < TOLERANCE[case.x_dtype], f"seed {seed}: relative error {err:.3g}"

    def test_stacked_weight_reads_the_indexed_layer(self, case: Case):
        """A [L, N, K] stack with a traced layer index (the forward pass's layer loop) gives the
        indexed matrix's product, not a neighbour's."""
        if not case.stack:
            pytest.skip("single-matrix case")
        rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 63)))
        ws = [random_weight(case.fmt, case.n, case.k, rng) for _ in range(3)]
        stacked = jax.tree_util.tree_map(lambda *p: jnp.stack(p), *ws)
        x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.float32).astype(case.x_dtype)
        run = jax.jit(lambda x, w, i: self.matmul(x, w, case, layer=i))
        for i in (2, 0):
            y = np.asarray(run(x, stacked, jnp.int32(i)))
            err = relative_error(y, np.asarray(qmatmul_reference(x, ws[i])))
            assert err < TOLERANCE[case.x_dtype], f"layer {i}: relative error {err:.3g}"


def _t(kernel, block_n, block_k, split_k=1, block_m=16) -> TritonMatmulTuning:
    return TritonMatmulTuning(kernel, block_n=block_n, block_k=block_k, split_k=split_k, block_m=block_m)


class TestTritonInterpret(MatmulConformance):
    """The Triton kernels' bodies run by Pallas' interpreter on the CPU (the inline PTX is replaced
    by its bit-identical jnp twin there). Shapes are small: a few seconds per case on 2 cores."""

    CASES = (
        Case("q8_0", 1, 32, 64, "float32", _t("fma", 16, 32)),
        Case("q4_0", 3, 32, 256, "float32", _t("fma", 16, 64, split_k=2), stack=True),
        Case("q4_0", 5, 32, 128, "bfloat16", _t("mma", 16, 64), stack=True),  # 11 padded rows, masked
        Case("q4_0", 1, 64, 256, "bfloat16"),  # default tuning
        Case("q4_1", 2, 16, 128, "bfloat16", _t("fma", 16, 128)),
        Case("q5_0", 1, 16, 128, "float32", _t("fma", 16, 32, split_k=2)),
        Case("q5_1", 3, 16, 128, "float32", _t("mma", 16, 64)),  # f32 x: 3-pass bf16 dot
        Case("q4_k", 2, 16, 512, "float32", _t("fma", 16, 256, split_k=2)),
        Case("q4_k", 17, 16, 256, "bfloat16", _t("mma", 16, 256)),  # two row blocks of x
        Case("q5_k", 1, 16, 256, "bfloat16", _t("fma", 16, 256)),
        Case("q6_k", 1, 16, 256, "float32", _t("fma", 16, 256)),
        Case("q6_k", 4, 16, 256, "bfloat16", _t("mma", 16, 256), stack=True),
    )

    def matmul(self, x, w, case, layer=None):
        return matmul_triton.qmatmul_triton(x, w, case.tuning, layer=layer, interpret=True)


_GPU_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def _gpu_cases() -> tuple[Case, ...]:
    cases = []
    for fmt in _GPU_FORMATS:
        # default tunings: fma (f32 and bf16), 3-pass bf16 MMA (f32 x), bf16 MMA, prefill
        for m, dtype in ((1, "float32"), (1, "bfloat16"), (3, "float32"), (8, "bfloat16"), (512, "bfloat16")):
            cases.append(Case(fmt, m, 256, 1024, dtype))
        cases.append(Case(fmt, 2, 64, 512, "bfloat16", _t("fma", 32, 256)))
        cases.append(Case(fmt, 40, 96, 768, "bfloat16", _t("mma", 32, 256, split_k=3 if fmt[-1] == "k" else 1,
                                                          block_m=32)))
    cases += [Case("q4_0", 1, 4096, 4096, "bfloat16"), Case("q4_k", 8, 1024, 4096, "bfloat16", stack=True),
              Case("q6_k", 512, 4096, 1024, "bfloat16", stack=True), Case("q8_0", 1, 4096, 11008, "float32"),
              Case("q4_0", 8, 4096, 4096, "bfloat16", stack=True), Case("q4_k", 512, 1024, 2048, "bfloat16", stack=True),
              Case("q5_k", 512, 1024, 2048, "bfloat16", stack=True), Case("q4_0", 512, 1024, 4096, "bfloat16", stack=True),
              Case("q8_0", 512, 1024, 4096, "bfloat16", stack=True), Case("q6_k", 8, 1024, 4096, "bfloat16", stack=True)]
    return tuple(cases)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
class TestTritonGpu(MatmulConformance):
    """The Triton kernels compiled for the GPU, default and explicit tunings, inline PTX on."""

    CASES = _gpu_cases()

    def matmul(self, x, w, case, layer=None):
        return matmul_triton.qmatmul_triton(x, w, case.tuning, layer=layer)

    def poison(self):
        jax.block_until_ready(jnp.full((64 << 20,), jnp.nan, jnp.float32))  # freed at once, reused


# ---------------------------------------------------------------------------------------------
# the rest of the triton implementation's contract (no kernel runs)


def _spec(fmt: str, n: int, k: int) -> quant.QuantizedTensor:
    f = quant.ALL_FORMATS[fmt]
    shapes, dtypes = f.plane_shapes(n, k), f.plane_dtypes()
    return quant.QuantizedTensor({p: jax.ShapeDtypeStruct(shapes[p], dtypes[p]) for p in f.planes}, fmt, (n, k))


def test_registered_above_reference_and_gpu_only():
    impls = {impl.name: impl for impl in registry.implementations("matmul")}
    assert impls["triton"].priority > impls["reference"].priority
    assert impls["triton"].fn is matmul_triton.qmatmul_triton
    assert impls["triton"].is_available() == (jax.default_backend() == "gpu")


@pytest.mark.parametrize("fmt,n,k", [("f16", 32, 64), ("f32", 32, 64), ("q3_k", 32, 256), ("q2_k", 32, 256),
                                     ("q4_0", 40, 64), ("q6_k_split", 64, 256), ("q6_k_split6", 64, 256)])
def test_refuses_what_it_cannot_take(fmt, n, k):
    x = jax.ShapeDtypeStruct((2, k), jnp.float32)
    with pytest.raises(NotImplementedError):
        jax.eval_shape(matmul_triton.qmatmul_triton, x, _spec(fmt, n, k))


def test_refuses_other_x_dtypes():
    with pytest.raises(NotImplementedError, match="f32 or bf16"):
        jax.eval_shape(matmul_triton.qmatmul_triton, jax.ShapeDtypeStruct((2, 64), jnp.float16),
                       _spec("q4_0", 32, 64))


@pytest.mark.parametrize("kwargs", [
    dict(kernel="wgmma"), dict(block_n=48), dict(block_k=16), dict(split_k=0), dict(num_warps=32),
    dict(num_stages=0), dict(kernel="mma", block_n=8), dict(kernel="mma", block_m=8), dict(block_m=24),
])
def test_tuning_validation(kwargs):
    with pytest.raises(ValueError):
        TritonMatmulTuning(**kwargs)


def test_tuning_that_does_not_tile_is_an_error():
    x = jax.ShapeDtypeStruct((1, 256), jnp.float32)
    with pytest.raises(ValueError, match="does not tile"):
        jax.eval_shape(lambda x, w: matmul_triton.qmatmul_triton(x, w, _t("fma", 64, 32)), x, _spec("q4_0", 32, 256))
    with pytest.raises(ValueError, match="multiple of the unit"):
        jax.eval_shape(lambda x, w: matmul_triton.qmatmul_triton(x, w, _t("fma", 16, 128)), x, _spec("q4_k", 32, 256))


LLAMA_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096), (1024, 4096), (14336, 4096),
                (4096, 14336), (128256, 4096), (576, 576), (49152, 576), (1536, 576)]


@pytest.mark.parametrize("fmt", matmul_triton.SUPPORTED_FORMATS)
def test_default_tuning_tiles_every_model_shape(fmt):
    unit = matmul_triton.SPECS[fmt].unit
    for n, k in LLAMA_SHAPES:
        if k % unit:
            continue
        for m in (1, 2, 3, 8, 16, 33, 64, 65, 512):
            for dtype in (jnp.float32, jnp.bfloat16):
                matmul_triton.check_tiling(fmt, n, k, matmul_triton.default_tuning(fmt, m, n, k, dtype))
    for m in (1, 8, 512):  # and the whole call traces (eval_shape: nothing compiles)
        out = jax.eval_shape(matmul_triton.qmatmul_triton, jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16),
                             _spec(fmt, 4096, 4096))
        assert out.shape == (m, 4096) and out.dtype == jnp.float32


@pytest.mark.parametrize("fmt", ["q4_k", "q4_k_split"])
@pytest.mark.parametrize("m", [1, 8, 512])
def test_stacked_lowers_to_triton_for_cuda(m, fmt):
    """The Triton lowering (no GPU needed) takes the in-place layer index for both kernels (and
    Q4_K split at load, as Q4_0 plus the offsets' dot)."""
    w = _spec(fmt, 256, 1024)
    stacked = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct((30, *p.shape), p.dtype), w)
    fn = lambda x, w, i: matmul_triton.qmatmul_triton(x, w, layer=i)  # noqa: E731
    lowered = jax.jit(fn).trace(jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16), stacked,
                                jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_stack_without_layer_is_an_error():
    w = _spec("q4_0", 32, 64)
    stacked = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct((2, *p.shape), p.dtype), w)
    with pytest.raises(ValueError, match="needs a layer index"):
        jax.eval_shape(matmul_triton.qmatmul_triton, jax.ShapeDtypeStruct((1, 64), jnp.float32), stacked)
    with pytest.raises(ValueError, match="needs a layer index"):
        jax.eval_shape(qmatmul_reference, jax.ShapeDtypeStruct((1, 64), jnp.float32), stacked)


def test_leading_dims_and_empty_x():
    w = random_weight("q4_0", 16, 64, np.random.default_rng(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 64)), jnp.float32)
    y = matmul_triton.qmatmul_triton(x, w, _t("fma", 16, 64), interpret=True)
    assert y.shape == (2, 3, 16)
    assert relative_error(y, qmatmul_reference(x, w)) < 1e-5
    assert matmul_triton.qmatmul_triton(jnp.zeros((0, 64)), w).shape == (0, 16)


# ---------------------------------------------------------------------------------------------
# the inline PTX, which interpret mode replaces by its jnp twin, checked by a small emulator


def _emulate_ptx(asm: str, inputs: list[int]) -> list[int]:
    """Runs the straight-line PTX subset the kernels use on 32-bit values: $0..$3 out, $4.. in."""
    regs = {f"${4 + i}": v for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0)

    def f32(bits: int) -> float:
        return float(np.array([bits], np.uint32).view(np.float32)[0])

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(s) for s in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif op in ("shr.b32", "shr.u32"):
            r = a[0] >> a[1]
        elif op == "prmt.b32":  # default mode: result byte i = byte sel_i of {b:a} (no sign bit used)
            pool = a[0].to_bytes(4, "little") + a[1].to_bytes(4, "little")
            sel = [(a[2] >> (4 * i)) & 0xF for i in range(4)]
            assert all(s < 8 for s in sel), "sign-replicating selectors not emulated"
            r = int.from_bytes(bytes(pool[s] for s in sel), "little")
        elif op == "sub.f32":
            r = int(np.array([f32(a[0]) - f32(a[1])], np.float32).view(np.uint32)[0])
        else:
            raise AssertionError(f"unemulated PTX {op}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(4)]


def _pack(b: np.ndarray) -> int:
    return int.from_bytes(bytes(int(v) for v in b), "little")


@pytest.mark.parametrize("shift,hshift,hbits", [(0, 0, 0), (4, 0, 0), (0, 0, 1), (4, 3, 1), (0, 4, 2), (4, 6, 2),
                                                (0, 7, 1)])
def test_inline_ptx_matches_jnp_twin(shift, hshift, hbits):
    rng = np.random.default_rng()
    qs = rng.integers(0, 256, (64, 4), dtype=np.uint8)
    qh = rng.integers(0, 256, (64, 4), dtype=np.uint8)
    twin = np.asarray(matmul_triton._Codes(use_asm=False).code(
        jnp.asarray(qs), shift, jnp.asarray(qh) if hbits else None, hshift, hbits)).view(np.uint32)
    asm = matmul_triton.code_asm(shift, hshift, hbits)
    for row in range(qs.shape[0]):
        got = _emulate_ptx(asm, [_pack(qs[row])] + ([_pack(qh[row])] if hbits else []))
        assert got == twin[row].tolist(), (row, qs[row], qh[row])


def test_inline_ptx_signed_bytes():
    qs = np.arange(-128, 128, dtype=np.int8).reshape(-1, 4)
    twin = np.asarray(matmul_triton._Codes(use_asm=False).signed_byte(jnp.asarray(qs))).view(np.uint32)
    for row in range(qs.shape[0]):
        got = _emulate_ptx(matmul_triton.SIGNED_BYTE_ASM, [_pack(qs[row].view(np.uint8))])
        assert got == twin[row].tolist(), (row, qs[row])
