"""Few, small transfers between the host and the step programs.

Each host-to-device or device-to-host copy of a small array costs far more than its bytes: on
the H200 the runtime stages each through its own host callbacks, so a chain of them adds
hundreds of microseconds ahead of a prompt's program and behind it (bench/results, thirty-second
session: a lone 512-token prompt's TTFT 21.9 ms against 18.0 ms of program). So the runner
sends a pytree of small arrays as one buffer of 32-bit words, unpacked on the device
(`pack_words`, `unpack_words`), returns each program's outputs as one array, and has its
prefill programs write theirs into pinned host memory themselves (`host_outputs`), a copy
inside the program's stream instead of one the host starts after it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

# (the pytree's structure, ((shape, dtype) of each leaf, ...)): static, hashable
WordsLayout = tuple[Any, tuple[tuple[tuple[int, ...], np.dtype], ...]]


def pack_words(tree: Any) -> tuple[np.ndarray, WordsLayout]:
    """A pytree of host arrays of 4-byte dtypes as one int32 vector and the layout that
    `unpack_words` takes back."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs, parts = [], []
    for leaf in leaves:
        a = np.ascontiguousarray(leaf)
        if a.dtype.itemsize != 4:
            raise TypeError(f"pack_words takes 4-byte dtypes only, not {a.dtype}")
        specs.append((tuple(a.shape), a.dtype))
        parts.append(a.reshape(-1).view(np.int32))
    words = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return words, (treedef, tuple(specs))


def words_size(layout: WordsLayout) -> int:
    """The words `pack_words` gave for `layout`."""
    return sum(math.prod(shape) for shape, _ in layout[1])


def unpack_words(words: jax.Array, layout: WordsLayout) -> Any:
    """`pack_words`'s pytree from its int32 vector (traceable: bit casts and slices)."""
    treedef, specs = layout
    leaves, at = [], 0
    for shape, dtype in specs:
        n = math.prod(shape)
        piece = words[at:at + n]
        at += n
        leaves.append(jax.lax.bitcast_convert_type(piece, dtype).reshape(shape))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def host_outputs(mesh: Mesh | None) -> Any:
    """The sharding that puts a step's outputs in pinned host memory (replicated over `mesh`),
    or None where the default device has no such memory."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return None
    if mesh is None:
        return SingleDeviceSharding(device, memory_kind="pinned_host")
    return NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
