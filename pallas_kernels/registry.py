"""Kernel registry: op name -> ordered implementations; one is chosen per op at start-up.

Kernel modules register their implementations explicitly at import (`register`); the engine
calls `choose` once per op while it starts (optionally forced by a flag), logs the choice and
calls the returned function from then on; `describe` feeds /health. There is no fallback at
call time: a chosen implementation that fails raises.

An implementation raises `NotImplementedError(reason)` for input it cannot take; `choose`
detects that by tracing it on each of `probes` (`jax.eval_shape`: nothing is compiled or run),
and picks the first that takes them all.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax

logger = logging.getLogger(__name__)


def _probe(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Traces fn on args without compiling; Python scalars (scales, windows) stay static."""
    is_static = [isinstance(a, (int, float, bool, str)) for a in args]
    dynamic = [a for a, st in zip(args, is_static) if not st]

    def call(*dyn: Any) -> Any:
        it = iter(dyn)
        return fn(*[a if st else next(it) for a, st in zip(args, is_static)])

    jax.eval_shape(call, *dynamic)


def always_available() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable[..., Any]
    is_available: Callable[[], bool]  # e.g. lambda: jax.default_backend() == "gpu"
    priority: int  # higher is tried first; ties keep registration order


class Registry:
    def __init__(self) -> None:
        self._impls: dict[str, list[Implementation]] = {}
        self._chosen: dict[str, Implementation] = {}

    def register(
        self,
        op: str,
        impl_name: str,
        fn: Callable[..., Any],
        *,
        is_available: Callable[[], bool] = always_available,
        priority: int = 0,
    ) -> None:
        impls = self._impls.setdefault(op, [])
        if any(impl.name == impl_name for impl in impls):
            raise ValueError(f"op {op!r} already has an implementation named {impl_name!r}")
        impls.append(Implementation(impl_name, fn, is_available, priority))
        impls.sort(key=lambda impl: -impl.priority)  # stable: ties keep registration order

    def implementations(self, op: str) -> tuple[Implementation, ...]:
        if op not in self._impls:
            raise KeyError(f"unknown op {op!r}; registered ops: {sorted(self._impls)}")
        return tuple(self._impls[op])

    def choose(
        self, op: str, forced: str | None = None, probes: Sequence[Sequence[Any]] = ()
    ) -> Callable[..., Any]:
        """Picks op's implementation: `forced` by name, else the first available one that takes
        every args tuple of `probes` (arrays or jax.ShapeDtypeStruct pytrees). Records, logs and
        returns it."""
        impls = self.implementations(op)
        if forced is not None:
            by_name = {impl.name: impl for impl in impls}
            if forced not in by_name:
                raise ValueError(f"op {op!r} has no implementation {forced!r}; known: {list(by_name)}")
            impl = by_name[forced]
            if not impl.is_available():
                raise ValueError(
                    f"implementation {forced!r} of op {op!r} is not available on backend {jax.default_backend()!r}"
                )
            if probes:
                try:
                    for args in probes:
                        _probe(impl.fn, args)
                except NotImplementedError as e:
                    raise NotImplementedError(
                        f"forced implementation {forced!r} of op {op!r} cannot take this input: {e}"
                    ) from e
            return self._record(op, impl, "forced")
        reasons = []
        for impl in impls:
            if not impl.is_available():
                reasons.append(f"{impl.name}: not available on {jax.default_backend()}")
                continue
            try:
                for args in probes:
                    _probe(impl.fn, args)
            except NotImplementedError as e:
                reasons.append(f"{impl.name}: {e}")
                continue
            return self._record(op, impl, "; ".join(reasons) or "first available")
        raise RuntimeError(f"no implementation of op {op!r} can run here: {'; '.join(reasons)}")

    def _record(self, op: str, impl: Implementation, why: str) -> Callable[..., Any]:
        self._chosen[op] = impl
        logger.info("kernel %s: %s (%s)", op, impl.name, why)
        return impl.fn

    def chosen(self, op: str) -> Callable[..., Any]:
        if op not in self._chosen:
            raise KeyError(f"no implementation chosen for op {op!r}; call choose() at start-up")
        return self._chosen[op].fn

    def describe(self) -> dict[str, str]:
        """{op: chosen implementation name}, for /health."""
        return {op: impl.name for op, impl in sorted(self._chosen.items())}


# The process-wide registry that kernel modules register into.
_REGISTRY = Registry()
register = _REGISTRY.register
implementations = _REGISTRY.implementations
choose = _REGISTRY.choose
chosen = _REGISTRY.chosen
describe = _REGISTRY.describe
