"""What the Mosaic GPU matmul's folded weights cost in correctness on a real model: the
teacher-forced comparison with llama.cpp's recorded token streams (as
tests/model/test_llama_cpp_agreement.py makes it), on the CPU path, once with the split matrices
as they are and once with every matrix of a format with offsets (`q4_k_split.OFFSET_FORMS`:
Q4_K, Q4_1, Q5_K, Q5_1 split at load) replaced by the bf16 weights the folded kernel computes
(`q4_k_split.folded_dequantize`: scale and offset rounded to bf16, then the weight), which is
what the GPU's prefill kernel runs and, since the thirty-fifth session, its decode kernel for
those formats. The CPU keeps f32 activations, so this isolates the weights' rounding (the GPU
also rounds x to bf16). A tied output matrix is folded for the output head only; the token
embedding stays exact, as the GPU's lookup is.

    python bench/fold_agreement.py [--model PATH] [--fixture tests/fixtures/generation_smollm2.json]
        [--cases N] [--max-context C] [--out DIR]

Per setting: top-1 agreement with llama.cpp, agreement on its decisive steps, the logit |diff|
over llama.cpp's top-10 (p50, p99, max), seconds; and the folded logits against the exact ones
(same top-1, largest |diff|). Writes bench/results/fold-agreement-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys
import time
import types

if __package__ in (None, ""):
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

from bench import common  # noqa: E402
from bench.kv_dtype_agreement import (  # noqa: E402
    FIXTURE, against_base, against_llama_cpp, finish, forced_logits, parse_agreement_args, result_record)

log = logging.getLogger("bench.fold_agreement")


def folded_params(params):
    """`params` with every matrix of an `OFFSET_FORMS` format as bf16 weights of the folded
    kernel's values (and a tied output matrix of such a format folded as `output`)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import q4_k_split
    from pallas_kernels.quant import QuantizedTensor

    def fold(w):
        if not isinstance(w, QuantizedTensor) or w.fmt not in q4_k_split.OFFSET_FORMS:
            return w
        return QuantizedTensor({"w": q4_k_split.folded_dequantize(w).astype(jnp.bfloat16)}, "bf16", w.shape)

    layers, output = jax.tree_util.tree_map(fold, (params.layers, params.output),
                                            is_leaf=lambda x: isinstance(x, QuantizedTensor))
    if output is None and params.embed.fmt in q4_k_split.OFFSET_FORMS:
        output = fold(params.embed)
    return dataclasses.replace(params, layers=layers, output=output)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, help="a GGUF (default: the server's default model)")
    args, cases = parse_agreement_args(ap, argv, FIXTURE)
    from model.config import EngineConfig
    from model.kernels import choose_kernels
    from model.loader import load_model
    from server.default_model import default_model_path

    model_path = args.model or default_model_path()
    stamp = common.timestamp()
    path_out = common.result_path(args.out, "fold-agreement", stamp)
    engine_cfg = EngineConfig(num_slots=8, max_context=args.max_context, split_q4_k="on", split_q5_k="on",
                              split_legacy="on", split_q6_k="off")
    t0 = time.perf_counter()
    model = load_model(model_path, engine_cfg)
    formats = sorted({op for op in model.kernel_names if op.startswith("matmul[")})
    results, logits = {}, {}
    for name in ("split", "split_folded"):
        params, kernels = model.params, model.kernels
        if name == "split_folded":
            params = folded_params(model.params)
            kernels, _ = choose_kernels({}, model.config, params, engine_cfg)
        view = types.SimpleNamespace(config=model.config, kernels=kernels, params=params)  # what forced_logits reads
        logits[name] = forced_logits(view, cases, "float32", args.max_context)
        results[name] = {**against_llama_cpp(cases, logits[name]), "seconds": round(time.perf_counter() - t0, 1)}
        log.info("%s: %s", name, results[name])
        t0 = time.perf_counter()
    results["matmuls"] = formats
    results["split_folded_vs_split"] = against_base(logits["split"], logits["split_folded"])
    return finish(path_out, result_record("fold-agreement", stamp, model_path, args.fixture, cases,
                                          args.max_context, results))


if __name__ == "__main__":
    sys.exit(main())
