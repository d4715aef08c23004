"""Chooses the kernel for each op once at start-up (registry order, or forced by
`--kernels op=impl,...`) and binds them into the `Kernels` the forward pass is compiled with."""

from __future__ import annotations

from typing import Mapping

# Importing the kernel modules registers their implementations.
import pallas_kernels.attention  # noqa: F401
import pallas_kernels.matmul  # noqa: F401
import pallas_kernels.matmul_ggml  # noqa: F401
from model.forward import Kernels
from pallas_kernels import registry

OPS = ("matmul", "embed", "attention_decode", "attention_prefill")


def choose_kernels(forced: Mapping[str, str]) -> tuple[Kernels, dict[str, str]]:
    unknown = sorted(set(forced) - set(OPS))
    if unknown:
        raise ValueError(f"--kernels names unknown ops {unknown}; ops are {list(OPS)}")
    fns = {op: registry.choose(op, forced.get(op)) for op in OPS}
    return Kernels(**fns), {op: registry.describe()[op] for op in OPS}
