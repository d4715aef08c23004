"""Kernel registry: ordering, forced choice, availability, NotImplementedError handling."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import registry

SPEC = (jax.ShapeDtypeStruct((4, 8), jnp.float32),)


def reference(x):
    return x * 2.0


def fast(x):
    return x * 2.0


def fussy(x):
    if x.shape[0] % 16:
        raise NotImplementedError("needs rows in multiples of 16")
    return x * 2.0


def broken(x):
    raise TypeError("a bug, not a refusal")


def make() -> registry.Registry:
    reg = registry.Registry()
    reg.register("op", "reference", reference)
    reg.register("op", "fussy", fussy, priority=20)
    reg.register("op", "fast", fast, priority=10)
    reg.register("op", "gpu_only", fast, is_available=lambda: False, priority=30)
    return reg


def test_order_and_availability(caplog):
    reg = make()
    assert [i.name for i in reg.implementations("op")] == ["gpu_only", "fussy", "fast", "reference"]
    with caplog.at_level(logging.INFO, logger="pallas_kernels.registry"):
        assert reg.choose("op") is fussy  # without probe args only availability counts
        assert reg.choose("op", probes=[SPEC]) is fast  # fussy refuses 4 rows
    assert "fussy: needs rows in multiples of 16" in caplog.text
    assert reg.describe() == {"op": "fast"}
    assert reg.chosen("op") is fast


def test_forced():
    reg = make()
    assert reg.choose("op", forced="reference", probes=[SPEC]) is reference
    assert reg.describe() == {"op": "reference"}
    with pytest.raises(ValueError, match="no implementation 'nope'.*known"):
        reg.choose("op", forced="nope")
    with pytest.raises(ValueError, match="not available"):
        reg.choose("op", forced="gpu_only")
    with pytest.raises(NotImplementedError, match="multiples of 16"):
        reg.choose("op", forced="fussy", probes=[SPEC])


def test_no_silent_fallback_at_call_time():
    reg = make()
    fn = reg.choose("op", forced="fussy")
    with pytest.raises(NotImplementedError):
        fn(jnp.ones((4, 8)))  # the chosen kernel's refusal reaches the caller
    assert reg.describe() == {"op": "fussy"}


def test_probe_does_not_hide_bugs():
    reg = registry.Registry()
    reg.register("op", "broken", broken, priority=1)
    reg.register("op", "reference", reference)
    with pytest.raises(TypeError, match="a bug"):
        reg.choose("op", probes=[SPEC])


def test_errors():
    reg = make()
    with pytest.raises(ValueError, match="already has"):
        reg.register("op", "fast", fast)
    with pytest.raises(KeyError, match="unknown op"):
        reg.choose("other")
    with pytest.raises(KeyError, match="no implementation chosen"):
        reg.chosen("op")
    reg.register("lonely", "gpu_only", fast, is_available=lambda: False)
    with pytest.raises(RuntimeError, match="no implementation of op 'lonely'"):
        reg.choose("lonely")


def test_choose_takes_the_first_implementation_accepting_every_probe():
    reg = make()
    rows16 = (jax.ShapeDtypeStruct((16, 8), jnp.float32),)
    assert reg.choose("op", probes=[rows16]) is fussy  # highest available priority that takes it
    assert reg.choose("op", probes=[rows16, SPEC]) is fast  # fussy refuses the second probe
    assert reg.choose("op", probes=[SPEC, rows16]) is fast  # order does not matter


def test_forced_implementation_must_accept_every_probe():
    reg = make()
    rows16 = (jax.ShapeDtypeStruct((16, 8), jnp.float32),)
    assert reg.choose("op", "fussy", probes=[rows16]) is fussy
    with pytest.raises(NotImplementedError, match="forced implementation 'fussy'"):
        reg.choose("op", "fussy", probes=[rows16, SPEC])
