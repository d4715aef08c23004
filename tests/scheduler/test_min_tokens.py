"""min_tokens (vLLM's) in the engine over the fake model: the request's stop tokens become its
banned tokens (SamplingParams.min_tokens_ids, which the model's sampler enforces: see
tests/model/test_sampling.py), and stop strings wait for min_tokens tokens too."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from model.step_types import SamplingParams
from scheduler.requests import with_min_tokens_bans
from scheduler.types import Constraint, RequestValidationError
from tests.scheduler.conftest import EOS
from tests.scheduler.streams import collect_one, req, run


def test_stop_tokens_become_the_banned_tokens(make_engine):
    request = req("a", 5, sampling=SamplingParams(min_tokens=2), stop_token_ids=(70, 9))
    assert with_min_tokens_bans(request, frozenset({EOS})).sampling.min_tokens_ids == (9, 70, EOS)
    ignoring = dataclasses.replace(request, ignore_eos=True)
    assert with_min_tokens_bans(ignoring, frozenset({EOS})).sampling.min_tokens_ids == (9, 70)
    assert with_min_tokens_bans(req("a", 5), frozenset({EOS})).sampling.min_tokens_ids == ()
    engine, model = make_engine()
    run(collect_one(engine, request))
    (setup,) = model.plans[0].setups
    assert setup.sampling.min_tokens == 2 and setup.sampling.min_tokens_ids == (9, 70, EOS)


def test_stop_strings_wait_for_min_tokens(make_engine):
    """The fake model answers "a" with "bcdefg...": a stop string complete before min_tokens tokens
    is passed over; one completed after stops as ever."""
    engine, _ = make_engine()
    plain = run(collect_one(engine, req("a", 6, stop=("c",))))
    late = run(collect_one(engine, req("a", 6, stop=("c",), sampling=SamplingParams(min_tokens=3))))
    after = run(collect_one(engine, req("a", 6, stop=("e",), sampling=SamplingParams(min_tokens=2))))
    # the min_tokens-th token ("d") ends none either: a stop token could come only after it
    at = run(collect_one(engine, req("a", 6, stop=("d",), sampling=SamplingParams(min_tokens=3))))
    # one that starts within the first min_tokens tokens and ends after them matches whole
    across = run(collect_one(engine, req("a", 6, stop=("cde",), sampling=SamplingParams(min_tokens=3))))
    assert (plain.text, plain.final.finish_reason) == ("b", "stop")
    assert (late.text, late.final.finish_reason) == ("bcdefg", "length")
    assert (after.text, after.final.finish_reason) == ("bcd", "stop")
    assert (at.text, at.final.finish_reason) == ("bcdefg", "length")
    assert (across.text, across.final.finish_reason) == ("b", "stop")


@pytest.mark.parametrize("kwargs, match", [
    (dict(constraint=Constraint("regex", "[a-z]+")), "constrained"),
    (dict(max_tokens=2), "exceeds the 2 tokens"),
    (dict(sampling=SamplingParams(min_tokens=3, logit_bias=tuple((t, 1.0) for t in range(4)))), "logit_bias"),
])
def test_min_tokens_refusals(make_engine, kwargs, match):
    engine, _ = make_engine(max_logit_bias=4)
    request = dataclasses.replace(req("a", 5, sampling=SamplingParams(min_tokens=3)), **kwargs)
    with pytest.raises(RequestValidationError, match=match):
        engine.submit(request, loop=asyncio.new_event_loop())
