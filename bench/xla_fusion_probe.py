"""Which forms of a residual add plus RMS norm does XLA compile into how many kernels? A question
for the decode step, where XLA makes two kernels of each add of a matmul's split-K partials and
the norm after it (the add's result is also the residual the layer goes on with).

    python bench/xla_fusion_probe.py [--verbose] [--out FILE]

A chain of 3 layers, each: x + the sum of S = 4 partials [S, M, E] (M = 8, E = 4096), a norm
in one of five forms, a split-K bf16 dot giving the next partials (a stand-in for the Mosaic
matmul: a kernel XLA does not fuse into). Prints per form the entry computation's fusions and
custom calls, as compiled for this backend (nothing is run):
- current: the norm in the model's order, then the Mosaic Q4_0 kernels' x order as a transpose;
- current_gather: the same order as a gather;
- plain: no order (a residual stream kept in the x order);
- deferred: no order, the norm's row scale applied to the dot's output instead of its input
  (x * w rounded to bf16 before the dot, rsqrt(mean(x^2)) after it);
- deferred_t: deferred, with the transpose.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

if __package__ in (None, ""):  # run as a script: bench/ on sys.path would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

M, E, S, L = 8, 4096, 4, 3
PERM = np.arange(E).reshape(E // 32, 16, 2).swapaxes(1, 2).reshape(E)


def gemm_split(h, w):  # h [M, E] bf16, w [S, E/S, E] -> partials [S, M, E] f32
    hs = h.reshape(M, S, E // S).transpose(1, 0, 2)
    return jnp.einsum("smk,skn->smn", hs, w, preferred_element_type=jnp.float32)


def rms(x, w, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def transposed(h):
    return h.reshape(M, E // 32, 16, 2).swapaxes(2, 3).reshape(M, E)


def current(x, p, w):
    xn = x + p.sum(0)
    return xn, transposed(rms(xn, w).astype(jnp.bfloat16)), None


def current_gather(x, p, w):
    xn = x + p.sum(0)
    return xn, jnp.take(rms(xn, w).astype(jnp.bfloat16), jnp.asarray(PERM), axis=1), None


def plain(x, p, w):
    xn = x + p.sum(0)
    return xn, rms(xn, w).astype(jnp.bfloat16), None


def deferred(x, p, w):
    xn = x + p.sum(0)
    return xn, (xn * w).astype(jnp.bfloat16), jax.lax.rsqrt(jnp.mean(xn * xn, -1, keepdims=True) + 1e-5)


def deferred_t(x, p, w):
    xn, h, r = deferred(x, p, w)
    return xn, transposed(h), r


def chain(form):
    def f(x, p, ws, gs):
        for i in range(L):
            x, h, r = form(x, p, gs[i])
            p = gemm_split(h, ws[i])
            if r is not None:
                p = p * r[None]
        return x + p.sum(0)
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verbose", action="store_true", help="print each kernel's HLO line")
    ap.add_argument("--out", default=None, help="also write what is printed to this file")
    args = ap.parse_args()
    spec = (jax.ShapeDtypeStruct((M, E), jnp.float32), jax.ShapeDtypeStruct((S, M, E), jnp.float32),
            jax.ShapeDtypeStruct((L, S, E // S, E), jnp.bfloat16), jax.ShapeDtypeStruct((L, E), jnp.float32))
    lines = [f"jax {jax.__version__}, {jax.devices()[0].device_kind}"]
    for form in (current, current_gather, plain, deferred, deferred_t):
        text = jax.jit(chain(form)).lower(*spec).compile().as_text()
        entry = text[text.index("ENTRY"):]
        entry = entry[:entry.index("\n}\n")] if "\n}\n" in entry else entry
        kernels = [ln.strip() for ln in entry.splitlines() if " fusion(" in ln or "custom-call(" in ln]
        lines.append(f"{form.__name__:16s} {len(kernels):3d} kernels for {L} layers")
        if args.verbose:
            lines += ["    " + re.sub(r", metadata=.*", "", ln)[:160] for ln in kernels]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
