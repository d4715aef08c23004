"""A kernel call lowered once per process and shape, whatever program calls it.

JAX lowers a Pallas kernel again in every top-level program that calls it: its cache of lowered
primitives lives in one module's lowering. The engine compiles a dozen step programs at start (a
decode program per decode-steps count and context bucket, a prefill program per chunk size and
bucket) that call the same matmul kernels, and on the H200 with jax 0.11.2 a Mosaic GPU kernel
took about 1.5 s to lower (most of it Mosaic's layout inference): 11.1 of a 7B Q4_K_M decode
program's 12.5 s of lowering, all under the GIL, so that lowering is what compile threads wait
on (bench/results, fifteenth session).

`LoweredOnce(fn)` calls `fn(x, w, layer=..., **options)` through a `jax.export` of it, made once
per input shapes and dtypes (`w`'s tree included) and static keyword options (such as the Mosaic
matmul's `gather_x`) and kept for the process; a program that calls it again
inlines the exported module instead of lowering the kernel. The export runs with JAX's forward
compatibility rules off (the exported module is never serialized, only called in this process),
so the kernels in it are byte for byte those of a direct call (a test compares them).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import export

try:  # not public: jax.config.update would set it for every thread
    from jax._src.config import export_ignore_forward_compatibility as _ignore_forward_compat
except ImportError:  # pragma: no cover - a jax without the option
    _ignore_forward_compat = None


def available() -> bool:
    return _ignore_forward_compat is not None


class LoweredOnce:
    """`fn(x, w, layer=..., **options)` (a matmul implementation) through exports of it, one per
    input shapes and options (static, hashable), for `platform` ("cuda"). Other attributes are
    fn's (the implementation's optional protocol, e.g. `takes_gather_x`)."""

    def __init__(self, fn: Callable[..., jax.Array], platform: str) -> None:
        if not available():
            raise NotImplementedError("this jax has no jax_export_ignore_forward_compatibility option")
        self.fn = fn
        self.platform = platform
        self.exports: dict[Any, export.Exported] = {}
        self._lock = threading.Lock()  # compile threads build programs concurrently

    def __getattr__(self, name: str) -> Any:
        if name == "fn":  # not set yet
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __call__(self, x: jax.Array, w: Any, layer: jax.Array | int | None = None, **options: Any) -> jax.Array:
        args = (x, w) if layer is None else (x, w, jnp.asarray(layer, jnp.int32))
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((leaf.shape, jnp.dtype(leaf.dtype)) for leaf in leaves), tuple(sorted(options.items())))
        with self._lock:
            exported = self.exports.get(key)
            if exported is None:
                exported = self.exports[key] = self._export(args, options)
        return exported.call(*args)

    def _export(self, args: tuple, options: dict[str, Any]) -> export.Exported:
        fn = self.fn
        if len(args) == 2:
            jitted = jax.jit(lambda x, w: fn(x, w, layer=None, **options))
        else:
            jitted = jax.jit(lambda x, w, layer: fn(x, w, layer=layer, **options))
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        with _ignore_forward_compat(True):
            return export.export(jitted, platforms=[self.platform])(*specs)
