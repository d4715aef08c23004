"""Slot actions (scheduler/slot_files.py) over the fake model with `context_tokens`, whose tokens
hash every cached position: a saved slot restored into another slot, or into another engine,
gives a later prompt its prefix with a cold engine's tokens; what the file holds is what decides
them; busy slots, bad files and bad names are refused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from scheduler import slot_files
from scheduler.types import Constraint, EngineUnavailableError, RequestValidationError, SlotBusyError
from tests.scheduler.streams import collect, collect_one, req, run, wait_until

HISTORY = bytes(range(65, 84))  # 19 tokens: SECOND reuses two whole chunks of 8 of what FIRST leaves
FIRST, SECOND = HISTORY + b"+first", HISTORY + b"-second one"  # FIRST: 25 tokens, three chunks kept


def _tokens(engine, prompt: bytes, **kw):
    return run(collect_one(engine, req(list(prompt), max_tokens=6, **kw)))


def _saved(make_engine, fake_model_cls, path) -> tuple[dict, object]:
    """An engine whose slot 1 held FIRST's chunks, saved to `path`: (the answer, the engine)."""
    engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    run(collect_one(engine, req("zz", max_tokens=2, request_id="other")))  # slot 0
    _tokens(engine, FIRST)  # slot 1
    assert engine.stats().cached == (0, 24)
    return engine.slot_action("save", 1, str(path)), engine


def test_a_slot_saved_erased_and_restored_elsewhere_serves_its_prefix_with_cold_tokens(make_engine, fake_model_cls,
                                                                                      tmp_path):
    answer, engine = _saved(make_engine, fake_model_cls, tmp_path / "s.bin")
    assert answer["id_slot"] == 1 and answer["filename"] == "s.bin" and answer["n_saved"] == 24
    assert answer["n_written"] == (tmp_path / "s.bin").stat().st_size and answer["timings"]["save_ms"] >= 0
    assert [engine.slot_action("erase", s)["n_erased"] for s in (0, 1)] == [0, 24]
    assert engine.stats().cached == (0, 0)
    restored = engine.slot_action("restore", 0, str(tmp_path / "s.bin"))
    assert restored["n_restored"] == 24 and restored["n_read"] == answer["n_written"]
    assert engine.stats().cached == (24, 0)  # as of the answer
    cold, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True), prompt_cache=False)
    warm = _tokens(engine, SECOND)
    assert warm.final.cached_tokens == 16 and warm.tokens == _tokens(cold, SECOND).tokens


def test_a_restore_into_a_new_engine_serves_the_prefix(make_engine, fake_model_cls, tmp_path):
    """As after a restart: the file is all the new engine has of that prefix."""
    _saved(make_engine, fake_model_cls, tmp_path / "s.bin")
    fresh, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    assert fresh.slot_action("restore", 1, str(tmp_path / "s.bin"))["n_restored"] == 24
    cold, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True), prompt_cache=False)
    warm = _tokens(fresh, SECOND)
    assert warm.final.cached_tokens == 16 and warm.tokens == _tokens(cold, SECOND).tokens


def test_the_files_keys_are_what_the_prefix_holds(make_engine, fake_model_cls, tmp_path):
    """The negative control: the same file with other keys and values gives other tokens, so the
    tokens above came from the file's contents."""
    _saved(make_engine, fake_model_cls, tmp_path / "s.bin")
    with np.load(tmp_path / "s.bin") as npz:
        arrays = dict(npz)
    layout = json.loads(bytes(arrays["meta"]).decode())["layout"]
    keys = arrays["keys"].view(np.float32).copy()
    keys[0, 3] = 90.0  # position 3 held 'D'
    slot_files.write(str(tmp_path / "t.bin"), layout, arrays["tokens"], "", keys, keys + 0.5)
    fresh, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    fresh.slot_action("restore", 1, str(tmp_path / "t.bin"))
    cold, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True), prompt_cache=False)
    warm = _tokens(fresh, SECOND)
    assert warm.final.cached_tokens == 16 and warm.tokens != _tokens(cold, SECOND).tokens


def test_a_restored_prefix_keeps_its_cache_salt(make_engine, fake_model_cls, tmp_path):
    engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    _tokens(engine, FIRST, cache_salt="tenant-a")
    slot = engine.stats().cached.index(24)
    engine.slot_action("save", slot, str(tmp_path / "s.bin"))
    fresh, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    fresh.slot_action("restore", 0, str(tmp_path / "s.bin"))
    assert _tokens(fresh, SECOND, cache_salt="tenant-b").final.cached_tokens == 0
    assert _tokens(fresh, SECOND, cache_salt="tenant-a").final.cached_tokens == 16


def test_an_empty_slot_saves_and_restores_nothing(make_engine, fake_model_cls, tmp_path):
    engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    assert engine.slot_action("save", 0, str(tmp_path / "e.bin"))["n_saved"] == 0
    assert engine.slot_action("restore", 1, str(tmp_path / "e.bin"))["n_restored"] == 0
    assert engine.slot_action("erase", 1)["n_erased"] == 0


def test_a_busy_slot_is_refused_and_the_request_goes_on(make_engine, fake_model_cls, tmp_path):
    engine, _ = make_engine(fake_model_cls(num_slots=2, step_delay=0.01))

    async def main():
        stream = engine.submit(req("ab", max_tokens=100))
        await asyncio.to_thread(wait_until, lambda: engine.stats().slots_busy == 1)
        busy = engine.stats().slot_infos()[0].slot
        assert (await asyncio.to_thread(engine.slot_action, "save", 1 - busy, str(tmp_path / "idle.bin")))["n_saved"] == 0
        for action, name in (("save", "busy.bin"), ("restore", "idle.bin"), ("erase", None)):
            with pytest.raises(SlotBusyError, match=f"slot {busy} is busy"):
                await asyncio.to_thread(engine.slot_action, action, busy, name and str(tmp_path / name))
        assert engine.stats().slots_busy == 1  # (refused while it ran)
        return await collect(stream)

    result = run(main())
    assert result.final.finish_reason == "length" and result.tokens == list(range(99, 199))
    assert not (tmp_path / "busy.bin").exists()


def test_slot_actions_wait_for_a_deferred_steps_rows(make_engine, fake_model_cls, tmp_path):
    """A constrained request's step samples once the host supplies its rows, and that sampling
    writes slot state: the fake model refuses a slot action in between; the engine runs its
    actions after the supply."""
    engine, _ = make_engine(fake_model_cls(num_slots=3, defers_allowed=True, context_tokens=True, step_delay=0.002))
    _tokens(engine, FIRST)
    slot = engine.stats().cached.index(24)

    async def main():
        stream = engine.submit(req("x", max_tokens=40, constraint=Constraint("regex", "[a-c]{40}")))
        for i in range(6):
            await asyncio.to_thread(engine.slot_action, "save", slot, str(tmp_path / f"s{i}.bin"))
            await asyncio.to_thread(engine.slot_action, "restore", slot, str(tmp_path / f"s{i}.bin"))
        return await collect(stream)

    result = run(main())
    assert result.final.error is None and len(result.tokens) == 40  # (the grammar ends there: "stop")


def test_bad_actions_slots_and_files_are_refused(make_engine, fake_model_cls, tmp_path):
    engine, _ = make_engine(fake_model_cls(num_slots=2, context_tokens=True))
    with pytest.raises(RequestValidationError, match="unknown slot action 'load'"):
        engine.slot_action("load", 0, str(tmp_path / "s.bin"))
    with pytest.raises(RequestValidationError, match="slot 2 does not exist"):
        engine.slot_action("erase", 2)
    with pytest.raises(RequestValidationError, match="needs a filename"):
        engine.slot_action("save", 0)
    with pytest.raises(FileNotFoundError):
        engine.slot_action("restore", 0, str(tmp_path / "missing.bin"))
    (tmp_path / "junk.bin").write_bytes(b"not a zip")
    with pytest.raises(RequestValidationError, match="junk.bin is not a slot file"):
        engine.slot_action("restore", 0, str(tmp_path / "junk.bin"))
    _tokens(engine, FIRST)
    slot = engine.stats().cached.index(24)
    engine.slot_action("save", slot, str(tmp_path / "s.bin"))
    # another chunk size: the file restores only where chunks fall where they fell
    other, _ = make_engine(fake_model_cls(num_slots=2, prefill_chunks=(4,), context_tokens=True), prefill_budget=8)
    with pytest.raises(RequestValidationError, match=r"another model or engine setup: prefill_chunk 8 \(here 4\)"):
        other.slot_action("restore", 0, str(tmp_path / "s.bin"))
    # its arrays cut short
    with np.load(tmp_path / "s.bin") as npz:
        arrays = dict(npz)
    arrays["keys"] = arrays["keys"][:, :8]
    np.savez(tmp_path / "cut.npz", **arrays)
    with pytest.raises(RequestValidationError, match="do not have the shapes"):
        engine.slot_action("restore", 0, str(tmp_path / "cut.npz"))
    assert engine.stats().cached.count(24) == 1  # nothing restored by the refusals


def test_a_model_that_cannot_read_its_cache_or_an_engine_without_a_prompt_cache(make_engine, fake_model_cls, tmp_path):
    class Opaque(fake_model_cls):
        read_slot = None

    engine, _ = make_engine(Opaque(num_slots=2))
    with pytest.raises(NotImplementedError, match="cannot save or restore slots"):
        engine.slot_action("save", 0, str(tmp_path / "s.bin"))
    assert engine.slot_action("erase", 0)["n_erased"] == 0  # (bookkeeping only)
    uncached, _ = make_engine(fake_model_cls(num_slots=2), prompt_cache=False)
    for action in ("save", "erase"):
        with pytest.raises(RequestValidationError, match="the prompt cache is off"):
            uncached.slot_action(action, 0, str(tmp_path / "s.bin"))
    assert uncached.stats().cached == ()
    stopped, _ = make_engine(fake_model_cls(num_slots=2))
    stopped.shutdown(10)
    with pytest.raises(EngineUnavailableError):
        stopped.slot_action("erase", 0)


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "../up", "a/b", "a\\b", "x" * 201, None, 7, "sp ace"])
def test_a_filename_is_a_plain_name(name):
    with pytest.raises(RequestValidationError, match="invalid filename"):
        slot_files.check_filename(name)


def test_a_filename_may_have_dots_dashes_and_underscores(tmp_path):
    assert slot_files.check_filename("slot_1.v2-final.bin") == "slot_1.v2-final.bin"
    longest = slot_files.check_filename("x" * 200)  # and the longest is written, beside its temporary file
    layout = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "kv_itemsize": 4}
    rows = np.zeros((1, 0, 1, 1), np.float32)
    assert slot_files.write(str(tmp_path / longest), layout, np.zeros((0,), np.int32), "", rows, rows) > 0
    assert [p.name for p in tmp_path.iterdir()] == [longest]


def test_a_bf16_file_holds_the_bits(tmp_path):
    """numpy's format has no bfloat16: the file keeps its bits as uint16, which the runner views back."""
    import ml_dtypes

    layout = {"arch": "llama", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "vocab_size": 100,
              "kv_dtype": "bfloat16", "kv_itemsize": 2, "model": "m", "prefill_chunk": 4}
    keys = np.random.default_rng(0).standard_normal((2, 8, 1, 4)).astype(ml_dtypes.bfloat16)
    tokens = np.arange(8, dtype=np.int32)
    size = slot_files.write(str(tmp_path / "b.bin"), layout, tokens, "salt", keys, -keys)
    got_tokens, salt, got_keys, got_values, read = slot_files.load(str(tmp_path / "b.bin"), layout, max_context=64)
    assert read == size and salt == "salt" and np.array_equal(got_tokens, tokens)
    assert got_keys.dtype == np.uint16 and np.array_equal(got_keys.view(ml_dtypes.bfloat16), keys)
    assert np.array_equal(got_values.view(ml_dtypes.bfloat16), -keys)
    with pytest.raises(RequestValidationError, match="below the context of 8"):
        slot_files.load(str(tmp_path / "b.bin"), layout, max_context=8)
    with pytest.raises(RequestValidationError, match="vocab_size 100 \\(here 50\\)"):
        slot_files.load(str(tmp_path / "b.bin"), {**layout, "vocab_size": 50}, max_context=64)
