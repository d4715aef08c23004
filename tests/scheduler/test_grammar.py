"""Constrained decoding (scheduler/grammar.py): llguidance's masks over our vocabulary, and the
engine over the fake model, which takes the first allowed token at or after its usual pick
(tests/scheduler/conftest.py): a constrained request's text is what its grammar forces from
there, and a request beside it is untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scheduler import grammar
from scheduler.types import Constraint, QueueFullError, RequestValidationError
from tests.scheduler.conftest import EOS, VOCAB, ByteTokenizer, FakeModel
from tests.scheduler.streams import collect, collect_one, req, run


def schema(value) -> Constraint:
    return Constraint("json_schema", json.dumps(value), "response_format")


def allowed_tokens(row: np.ndarray) -> set[int]:
    return {t for t, ok in enumerate(grammar.allowed(row, range(VOCAB))) if ok}


# ---- the grammar over a vocabulary ----


def test_a_json_schema_allows_exactly_its_objects():
    vocab = grammar.Vocabulary(ByteTokenizer())
    assert vocab.num_words == -(-VOCAB // 32)
    m = vocab.matcher(schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                              "additionalProperties": False}))
    assert allowed_tokens(m.mask()) <= {ord("{"), ord(" "), ord("\n"), ord("\t"), ord("\r")}
    assert ord("{") in allowed_tokens(m.mask())
    for ch in '{"a": 1':
        assert ord(ch) in allowed_tokens(m.mask()), ch
        m.consume(ord(ch))
        assert not m.is_stopped
    row = m.mask()
    assert ord("}") in allowed_tokens(row) and ord("x") not in allowed_tokens(row) and EOS not in allowed_tokens(row)
    m.consume(ord("}"))
    assert m.is_stopped  # the object is closed: nothing may follow
    with pytest.raises(RuntimeError, match="does not allow"):
        vocab.matcher(schema({"type": "integer"})).consume(ord("x"))


def _takes(vocab: grammar.Vocabulary, constraint: Constraint, text: str) -> bool:
    m = vocab.matcher(constraint)
    for ch in text.encode():
        if ch not in allowed_tokens(m.mask()):
            return False
        m.consume(ch)
    return m.is_stopped


@pytest.mark.parametrize("x_guidance, takes", [
    # llama.cpp's whitespace: none, one space, or one or two newlines and up to 20 spaces or tabs
    (None, [True, True, True, True, False, False, False]),
    ({"whitespace_flexible": False, "whitespace_pattern": None}, [False, True, False, False, False, False, False]),
    ({"whitespace_pattern": "[ ]*"}, [True, True, False, False, True, True, False]),
    ({"whitespace_flexible": True}, [True] * 7),  # llguidance's own: any run of whitespace
    ({"lenient": True}, [True, True, True, True, False, False, False]),  # says nothing of whitespace
])
def test_json_whitespace_is_bounded_unless_the_schema_says_otherwise(x_guidance, takes):
    vocab = grammar.Vocabulary(ByteTokenizer())
    value = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
             "additionalProperties": False}
    if x_guidance is not None:
        value["x-guidance"] = x_guidance
    texts = ['{"a": 1}', '{"a":1}', '{\n  "a": 1\n}', '{\n\n\t"a": 1}', '{' + " " * 21 + '"a": 1}',
             '{  "a": 1}', '{\n\n\n"a": 1}']
    assert [_takes(vocab, schema(value), t) for t in texts] == takes


def test_a_grammar_that_may_end_allows_the_end_of_generation_token():
    m = grammar.Vocabulary(ByteTokenizer()).matcher(Constraint("regex", "[a-z]+", "guided_regex"))
    assert EOS not in allowed_tokens(m.mask())  # at least one letter first
    m.consume(ord("q"))
    assert allowed_tokens(m.mask()) == set(range(ord("a"), ord("z") + 1)) | {EOS}
    assert 257 not in allowed_tokens(m.mask())  # another control token: never grammar text


def test_a_model_vocabulary_wider_than_the_tokenizer_never_allows_the_padding():
    vocab = grammar.Vocabulary(ByteTokenizer(), vocab_size=300)
    row = vocab.matcher(Constraint("choice", '["ab"]')).mask()
    assert row.shape == (vocab.num_words,) == (10,)
    assert {t for t, ok in enumerate(grammar.allowed(row, range(320))) if ok} == {ord("a")}


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", '{"type": "bogus"}', "response_format"), "invalid JSON schema"),
    (Constraint("json_schema", "{not json", "json_schema"), "invalid JSON schema"),
    (Constraint("regex", "[0-9", "guided_regex"), "invalid regular expression"),
    (Constraint("gbnf", 'root ::= undefined-rule', "grammar"), "invalid GBNF grammar"),
    (Constraint("lark", "start: nothing_here", "structured_outputs.grammar"), "invalid Lark grammar"),
    (Constraint("choice", '"not a list"', "guided_choice"), "invalid choice list"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(constraint, message):
    with pytest.raises(RequestValidationError, match=message) as err:
        grammar.Vocabulary(ByteTokenizer()).matcher(constraint)
    assert err.value.field == constraint.field


def test_constraint_kinds_are_checked():
    with pytest.raises(ValueError, match="kind"):
        Constraint("yaml", "a: 1")


# ---- the engine ----


def test_a_constrained_request_follows_its_grammar_and_ends_when_it_is_complete(make_engine):
    engine, _ = make_engine()
    # the fake's picks from 'a': the first allowed at or after 'b', then after each token
    result = run(collect_one(engine, req("hello a", max_tokens=20, constraint=Constraint("regex", "[0-9]{3}-x"))))
    assert result.text == "012-x"
    assert result.final.finish_reason == "stop" and result.final.completion_tokens == 5


def test_a_choice_and_a_grammar_that_ends_on_the_end_of_generation_token(make_engine):
    engine, _ = make_engine()
    choice = run(collect_one(engine, req("m", max_tokens=9, constraint=Constraint("choice", '["yes", "no"]'))))
    assert (choice.text, choice.final.finish_reason) == ("no", "stop")
    letters = run(collect_one(engine, req("a", max_tokens=40, constraint=Constraint("regex", "[a-z]+"))))
    # after 'z' the first allowed token counting on is EOS: the grammar may end there
    assert letters.text == "bcdefghijklmnopqrstuvwxyz" and letters.final.finish_reason == "stop"
    assert letters.tokens[-1] == EOS
    cut = run(collect_one(engine, req("a", max_tokens=3, constraint=Constraint("regex", "[a-z]+"))))
    assert (cut.text, cut.final.finish_reason) == ("bcd", "length")


def test_a_true_schema_is_any_json_value_with_bounded_whitespace():
    vocab = grammar.Vocabulary(ByteTokenizer())
    constraint = Constraint("json_schema", "true", "guided_json")
    assert _takes(vocab, constraint, '[1, "a"]') and _takes(vocab, constraint, '{"x": null}')
    assert not _takes(vocab, constraint, "[" + " " * 25 + "1]")


def test_masks_of_several_matchers_are_each_ones_own_and_a_failed_grammar_its_alone(monkeypatch, caplog):
    """grammar.masks (llguidance's threads for several): each row is what the matcher's own
    mask() gives; a grammar that failed is an exception in its place, the others unharmed."""
    vocab = grammar.Vocabulary(ByteTokenizer())
    constraints = [Constraint("regex", "[a-c]{5}"), Constraint("regex", "x[0-9]+"), schema({"type": "integer"}),
                   Constraint("regex", "[a-c]{5}")]
    batch = [vocab.matcher(c) for c in constraints]
    alone = [vocab.matcher(c) for c in constraints]
    for i, token in ((0, ord("a")), (1, ord("x")), (3, ord("b"))):  # the third keeps its first mask cached
        for m in (batch[i], alone[i]):
            m.mask()
            m.consume(token)
    broken = vocab.matcher(Constraint("regex", "[a-c]{5}"))
    with pytest.raises(RuntimeError):
        broken.consume(ord("z"))
    batched = []
    par = grammar.llguidance.numpy.fill_next_token_bitmask_par
    monkeypatch.setattr(grammar.llguidance.numpy, "fill_next_token_bitmask_par",
                        lambda ex, pairs, rows: (batched.append(len(pairs)), par(ex, pairs, rows)))
    rows = grammar.masks([*batch[:2], broken, *batch[2:]])
    assert batched == [4]  # one call for all but the one whose first mask was known
    assert "one by one" not in caplog.text  # that call gave them (no fallback)
    assert isinstance(rows[2], Exception)
    for row, m in zip(rows[:2] + rows[3:], alone):
        np.testing.assert_array_equal(row, m.mask())
    assert allowed_tokens(rows[0]) == {ord("a"), ord("b"), ord("c")}
    assert allowed_tokens(rows[1]) == set(range(ord("0"), ord("9") + 1))


def test_without_clears_only_the_named_tokens_unless_none_would_be_left():
    row = np.zeros((-(-VOCAB // 32),), np.uint32)
    for t in (5, 31, 40, 63, 64):
        row[t // 32] |= np.uint32(1 << (t % 32))
    row = row.view(np.int32)
    assert allowed_tokens(grammar.without(row, [31, 63, 1000, -1])) == {5, 40, 64}
    assert allowed_tokens(row) == {5, 31, 40, 63, 64}  # the row given is untouched
    only = grammar.without(row, [5, 31, 40, 63, 64])
    assert only is row  # nothing would be left: the row as it was


def test_ignore_eos_keeps_a_grammar_that_may_end_going_until_it_must_end(make_engine):
    """With ignore_eos the end-of-generation tokens leave the mask where the grammar allows
    others (llama.cpp's ignore_eos), so `[a-z]+` runs to max_tokens; a grammar complete after its
    choice ends there all the same."""
    engine, _ = make_engine()
    letters = run(collect_one(engine, req("a", max_tokens=30, ignore_eos=True,
                                          constraint=Constraint("regex", "[a-z]+"))))
    # after 'z' the first allowed token counting on is no longer EOS but, around the vocabulary, 'a'
    assert letters.text == "bcdefghijklmnopqrstuvwxyzabcde" and letters.final.finish_reason == "length"
    assert EOS not in letters.tokens
    choice = run(collect_one(engine, req("m", max_tokens=9, ignore_eos=True,
                                         constraint=Constraint("choice", '["yes", "no"]'))))
    assert (choice.text, choice.final.finish_reason) == ("no", "stop")


@pytest.mark.parametrize("defers, parts", [(False, False), (True, False), (True, True)],
                         ids=["reads-first", "deferred", "deferred-in-parts"])
def test_a_constrained_request_samples_every_step_and_leaves_its_neighbours_alone(make_engine, defers, parts):
    """Beside unconstrained requests it still gets a token each step, only in one-step plans, and
    the others' tokens are theirs: the engine reads the token in flight before planning, or with
    a model that defers allowed tokens plans the step at once and supplies its rows after."""
    model = FakeModel(decode_steps=(1, 4), defers_allowed=defers, parts=parts)
    engine, _ = make_engine(model)
    free = [req(f"hello {c}", max_tokens=12, request_id=f"free-{c}") for c in "ab"]
    constrained = req("x", max_tokens=12, request_id="c", constraint=Constraint("regex", "[a-c]{12}"))

    async def both():
        import asyncio

        streams = [engine.submit(r) for r in (free[0], constrained, free[1])]
        return await asyncio.gather(*(collect(s) for s in streams))

    a, c, b = run(both())
    assert (a.text, b.text) == ("bcdefghijklm", "cdefghijklmn")
    assert c.text == "abcabcabcabc" and c.final.finish_reason == "stop"
    slot = next(s for p in model.plans for s, _ in p.allowed)
    constrained_plans = [p for p in model.plans if any(s == slot for s, _ in p.allowed) or slot in p.deferred]
    assert len(constrained_plans) == 12  # its prompt's last chunk, then 11 decodes
    # deferred: every decode planned while the token before (the first: the prompt's) was in flight
    assert sum(slot in p.deferred for p in constrained_plans) == (11 if defers else 0)
    assert all(p.num_decode_steps == 1 for p in constrained_plans)
    first = model.plans.index(constrained_plans[0])
    decodes = [p for p in model.plans[first + 1:first + 12]]
    assert all(slot in p.decode_slots for p in decodes)  # no step skipped while a token was in flight
    alone_engine, _ = make_engine()
    assert run(collect_one(alone_engine, free[0])).text == a.text


def test_a_bad_constraint_is_refused_at_submit_and_takes_no_place(make_engine):
    engine, _ = make_engine(max_queue=0)
    bad = req("a", constraint=Constraint("regex", "[", "guided_regex"))
    for _ in range(20):
        with pytest.raises(RequestValidationError) as err:
            run(collect_one(engine, bad))
        assert err.value.field == "guided_regex"
    results = [run(collect_one(engine, req("a", max_tokens=2))) for _ in range(3)]
    assert all(r.text == "bc" for r in results)
    assert not isinstance(results[0], QueueFullError)


def test_without_a_vocabulary_constrained_requests_are_refused_and_the_rest_served(make_engine):
    class NoBytes(ByteTokenizer):
        eos_id = None
        eog_ids = frozenset()

    from scheduler.engine import Engine
    from model.config import EngineConfig
    from tests.scheduler.conftest import ByteDetokenizer

    model = FakeModel()
    engine = Engine(lambda: model, NoBytes(), EngineConfig(num_slots=8, max_context=256, prefill_chunks=(4, 8),
                                                           prefill_budget=16, max_top_logprobs=3, gc_freeze=False),
                    detokenizer_factory=ByteDetokenizer)
    engine.start()
    try:
        assert engine.wait_ready(10)
        assert engine.info()["constrained_decoding"] is False
        with pytest.raises(RequestValidationError, match="constrained decoding is not available"):
            run(collect_one(engine, req("a", constraint=Constraint("choice", '["x"]'))))
        assert run(collect_one(engine, req("a", max_tokens=2, ignore_eos=True))).text == "bc"
    finally:
        engine.shutdown(10)


def test_a_grammar_that_compiles_but_cannot_start_is_refused_at_submit():
    """llguidance compiles a rule that never ends, then fails at its first mask: the vocabulary
    computes that mask when it compiles, so the request is refused (400), not failed later."""
    vocab = grammar.Vocabulary(ByteTokenizer())
    with pytest.raises(RequestValidationError, match="invalid GBNF grammar") as err:
        vocab.matcher(Constraint("gbnf", "root ::= x\nx ::= x", "grammar"))
    assert err.value.field == "grammar"


def test_a_grammar_is_compiled_once_and_each_request_gets_its_own_state():
    vocab = grammar.Vocabulary(ByteTokenizer())
    c = Constraint("regex", "(ab|cd)x")
    a, b = vocab.matcher(c), vocab.matcher(c)
    assert len(vocab._compiled) == 1
    assert allowed_tokens(a.mask()) == allowed_tokens(b.mask()) == {ord("a"), ord("c")}
    a.consume(ord("a"))
    assert allowed_tokens(a.mask()) == {ord("b")}
    assert allowed_tokens(b.mask()) == {ord("a"), ord("c")}  # untouched by a's token
    b.consume(ord("c"))
    assert allowed_tokens(b.mask()) == {ord("d")}


def test_a_grammar_failing_in_the_engine_ends_its_request_and_frees_its_place(make_engine, monkeypatch):
    """Where a grammar fails while its request is admitted (its first mask raising), the request
    ends with an error, and the requests waiting behind it are admitted at once: the step with its
    slot set up still runs, so nothing waits for an unrelated wake-up (one slot here)."""
    engine, _ = make_engine(FakeModel(num_slots=1), max_queue=4)

    class Broken(grammar.Matcher):
        def mask(self):
            raise RuntimeError("the grammar failed: on purpose")

    real = engine._vocabulary.matcher
    monkeypatch.setattr(engine._vocabulary, "matcher",
                        lambda c: Broken(None, 9) if c.source == "broken" else real(c))

    async def both():
        import asyncio

        broken = engine.submit(req("a", constraint=Constraint("regex", "broken")))
        after = engine.submit(req("hello a", max_tokens=3, request_id="after", timeout_s=5))
        return await asyncio.gather(collect(broken), collect(after))

    broken, after = run(both())
    assert broken.final.finish_reason == "error" and "on purpose" in broken.final.error
    assert after.text == "bcd" and after.final.finish_reason == "length"


def test_compile_constraint_keeps_the_grammar_for_the_submit(make_engine):
    engine, _ = make_engine()
    with pytest.raises(RequestValidationError):
        engine.compile_constraint(Constraint("regex", "[", "guided_regex"))
    c = Constraint("choice", '["yes", "no"]')
    engine.compile_constraint(c)
    assert list(engine._vocabulary._compiled) == [(c.kind, c.source)]
    assert run(collect_one(engine, req("m", max_tokens=5, constraint=c))).text == "no"
    assert len(engine._vocabulary._compiled) == 1


def test_a_deferred_request_that_ends_leaves_the_step_it_was_planned_in_running(make_engine):
    """A constrained request that stops (here on a stop string) while its next step is already
    dispatched: that step gets every token for it (its output is discarded) and the others
    decode on; a second constrained request after it starts from its own grammar."""
    model = FakeModel(defers_allowed=True)
    engine, _ = make_engine(model)

    async def both():
        import asyncio

        free = engine.submit(req("hello a", max_tokens=10, request_id="free"))
        stopped = engine.submit(req("x", max_tokens=12, stop=("c",), constraint=Constraint("regex", "[a-c]{12}")))
        return await asyncio.gather(collect(free), collect(stopped))

    free, stopped = run(both())
    assert (free.text, stopped.text, stopped.final.finish_reason) == ("bcdefghijk", "ab", "stop")
    again = run(collect_one(engine, req("x", max_tokens=12, constraint=Constraint("regex", "[a-c]{2}z"))))
    assert again.text == "abz"
