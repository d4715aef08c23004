"""The PTX instruction mix of the Mosaic GPU matmul's K-step loop (static counts): Q4_0, or with
`--format` a Q6_K split at load.

The decode kernel is bound by instruction issue (bench/results, sixth session), so what each K
step executes per thread is the figure to cut. This compiles one call of the kernel with Mosaic
GPU's PTX dump on (`MOSAIC_GPU_DUMP_PTX`, `MOSAIC_GPU_DUMP_PTXAS`, `MOSAIC_GPU_DUMP_TO`; the
H200's image has no nvdisasm, so no SASS), finds the largest loop in each dumped kernel (the
code between a label and the backward branch to it: the pipeline's K steps) and counts its
instructions by opcode (with their type suffixes: `cvt.f32.bf16` apart from `cvt.rn.bf16.f32`),
inline asm included (the kernel's lop3s and wgmmas are written as PTX).
PTX is not what runs (ptxas fuses and schedules it), but an f32 round trip or a missing lop3
shows in it.

    python3 bench/kernel_mix.py --shape 22016x4096 --m 8 [--keep] --out "$OUT"

GPU only (a Hopper GPU: the kernel is compiled, then run once). Writes `kernel-mix-<stamp>.json`
{"gpu", "jax", "shape", "m", "kernels": [{"file", "instructions", "opcodes", "loop":
{"instructions", "opcodes"}, "ptxas"}]} (`ptxas`: its log, registers and spills).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # bench/http.py would shadow the standard library's http
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LABEL = re.compile(r"^([$\w.]+):(?!:)\s*")  # not the `::` of `shared::cluster`
PREDICATE = re.compile(r"^@!?%?\w+\s+")  # `@%p1 `, `@!%p2 `, and inline asm's own `@P1 `


def parse(ptx: str) -> tuple[list[str], dict[str, int], list[tuple[int, str]]]:
    """Instructions (opcodes) in order, each label's index (of the instruction after it), and the
    branches (index, target label). A line may hold several statements (LLVM prints an inline
    asm block as it was written, often on one line inside braces); directives and declarations
    (`.reg`, `.loc`) are not instructions; labels inside an inline asm block are its own (the
    same names recur in every copy of the block)."""
    instructions, labels, branches = [], {}, []
    block, in_asm = 0, False
    for raw in ptx.splitlines():
        if "begin inline asm" in raw:
            block, in_asm = block + 1, True
        elif "end inline asm" in raw:
            in_asm = False

        def scoped(name: str) -> str:
            return f"{block}:{name}" if in_asm else name

        for stmt in raw.split("//")[0].split(";"):
            stmt = stmt.strip().strip("{}").strip()
            while m := LABEL.match(stmt):
                labels[scoped(m.group(1))] = len(instructions)
                stmt = stmt[m.end():]
            if not stmt or stmt[0] == ".":
                continue
            text = PREDICATE.sub("", stmt)
            op = text.split()[0]
            if op.startswith("bra"):
                branches.append((len(instructions), scoped(text.split()[-1])))
            instructions.append(op)
    return instructions, labels, branches


def largest_loop(instructions, labels, branches) -> list[str]:
    """The instructions of the longest backward branch's span (empty if none)."""
    best: list[str] = []
    for at, target in branches:
        start = labels.get(target)
        if start is not None and start <= at and at + 1 - start > len(best):
            best = instructions[start : at + 1]
    return best


def mix(ops: list[str]) -> dict[str, int]:
    return dict(collections.Counter(ops).most_common())


def summarize(path: pathlib.Path) -> dict:
    instructions, labels, branches = parse(path.read_text(errors="replace"))
    loop = largest_loop(instructions, labels, branches)
    log = path.with_suffix(".ptxas")
    return {"file": path.name, "instructions": len(instructions), "opcodes": mix(instructions),
            "loop": {"instructions": len(loop), "opcodes": mix(loop)},
            "ptxas": log.read_text(errors="replace")[-2000:] if log.exists() else None}


def _q6_k_split(fmt: str, layers: int, n: int, k: int):
    """A stack of random Q6_K matrices split at load into `fmt` ("q6_k_split" or "q6_k_split6")."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import q6_k_split, quant

    keys = jax.random.split(jax.random.key(2), 4)
    shape = (layers, n)
    planes = {"ql": jax.random.randint(keys[0], (*shape, k // 2), 0, 256, jnp.int32).astype(jnp.uint8),
              "qh": jax.random.randint(keys[1], (*shape, k // 4), 0, 256, jnp.int32).astype(jnp.uint8),
              # Q6_K's usual scale range, as bench/kernels.py draws it
              "sc": jax.random.randint(keys[2], (*shape, k // 16), -32, 32, jnp.int32).astype(jnp.int8),
              "d": jax.random.uniform(keys[3], (*shape, k // 256), jnp.float32, 1e-4, 5e-3).astype(jnp.float16)}
    split = q6_k_split.split_q6_k6 if fmt == "q6_k_split6" else q6_k_split.split_q6_k
    return jax.jit(split)(quant.QuantizedTensor(planes, "q6_k", (n, k)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="22016x4096", help="NxK of the weight")
    ap.add_argument("--format", default="q4_0", choices=("q4_0", "q6_k_split", "q6_k_split6"),
                    help="the weight's format: Q4_0, or a random Q6_K split at load (8-bit or 6-bit codes)")
    ap.add_argument("--m", type=int, default=8, help="rows of x")
    ap.add_argument("--keep", action="store_true", help="copy the dumped PTX next to the JSON (with --out)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    dump = pathlib.Path(tempfile.mkdtemp(prefix="kernel-mix-"))
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)

    import jax
    import jax.numpy as jnp

    from bench import common
    from bench.matmul_ablation import random_q4_0_stack
    from pallas_kernels import matmul_mgpu

    n, k = (int(v) for v in args.shape.split("x"))
    w = random_q4_0_stack(jax.random.key(0), 2, n, k) if args.format == "q4_0" else _q6_k_split(args.format, 2, n, k)
    x = jax.random.normal(jax.random.key(1), (args.m, k), jnp.float32).astype(jnp.bfloat16)
    jax.block_until_ready(matmul_mgpu.qmatmul_mgpu(x, w, layer=1))
    files = sorted(dump.rglob("*.ptx"))
    kernels = [summarize(p) for p in files]
    for kern in kernels:
        top = ", ".join(f"{op} {c}" for op, c in list(kern["loop"]["opcodes"].items())[:14])
        print(f"{kern['file']}: {kern['instructions']} instructions; largest loop {kern['loop']['instructions']}: {top}")
    if not kernels:
        print("no PTX dumped; files:", [p.name for p in dump.rglob("*")])
    if args.out:
        stamp = common.timestamp()
        path = common.result_path(args.out, "kernel-mix", stamp)
        common.write_json(path, {**common.device_info(), "shape": args.shape, "format": args.format, "m": args.m,
                                 "kernels": kernels})
        print("wrote", path)
        if args.keep:
            for p in files:
                (path.parent / f"{path.stem}-{p.name}").write_text(p.read_text(errors="replace"))
    shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
