"""llama-server's slot actions over HTTP (server/slots_api.py) against the fake engine: the
route's parsing, the file's place in --slot-save-path, and the engine's refusals as HTTP errors.
What the actions do is tests/scheduler/test_slot_files.py's, and test_e2e.py's with the model."""

from __future__ import annotations

import os

import pytest

from scheduler.types import EngineUnavailableError, RequestValidationError, SlotBusyError
from tests.server.fakes import FakeEngine, client_for, make_app

pytestmark = pytest.mark.anyio


async def test_without_a_slot_save_path_the_actions_are_not_supported(engine: FakeEngine) -> None:
    async with client_for(make_app(engine)) as c:
        r = await c.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    assert engine.slot_calls == []


async def test_save_restore_and_erase_reach_the_engine_with_the_files_path(engine: FakeEngine, tmp_path) -> None:
    engine.cached = (512, 0)
    async with client_for(make_app(engine, slot_save_path=str(tmp_path))) as c:
        saved = await c.post("/slots/0?action=save", json={"filename": "chat.bin"})
        restored = await c.post("/slots/1?action=restore", json={"filename": "chat.bin"})
        erased = await c.post("/slots/0?action=erase")
        listed = (await c.get("/slots")).json()
    assert saved.status_code == restored.status_code == erased.status_code == 200
    assert saved.json()["n_saved"] == 512 and saved.json()["filename"] == "chat.bin"
    assert restored.json()["n_restored"] == 512 and erased.json() == {"id_slot": 0, "n_erased": 512}
    path = os.path.join(str(tmp_path), "chat.bin")
    assert engine.slot_calls == [("save", 0, path), ("restore", 1, path), ("erase", 0, None)]
    assert [s["n_cached"] for s in listed] == [512, 0]


@pytest.mark.parametrize("url, body, param", [
    ("/slots/0?action=load", {"filename": "a.bin"}, "action"),
    ("/slots/0", {"filename": "a.bin"}, "action"),
    ("/slots/x?action=save", {"filename": "a.bin"}, "id_slot"),
    ("/slots/-1?action=save", {"filename": "a.bin"}, "id_slot"),
    ("/slots/\u00b2?action=save", {"filename": "a.bin"}, "id_slot"),
    ("/slots/" + "9" * 5000 + "?action=save", {"filename": "a.bin"}, "id_slot"),
    ("/slots/0?action=save", {"filename": "../a.bin"}, "filename"),
    ("/slots/0?action=save", {"filename": ".a"}, "filename"),
    ("/slots/0?action=restore", {}, "filename"),
    ("/slots/0?action=restore", ["a.bin"], "filename"),
])
async def test_bad_actions_slots_and_names_are_400_before_the_engine(engine: FakeEngine, tmp_path, url, body,
                                                                     param) -> None:
    async with client_for(make_app(engine, slot_save_path=str(tmp_path))) as c:
        r = await c.post(url, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.slot_calls == []


async def test_malformed_json_is_400(engine: FakeEngine, tmp_path) -> None:
    async with client_for(make_app(engine, slot_save_path=str(tmp_path))) as c:
        r = await c.post("/slots/0?action=save", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("error, action, status", [
    (SlotBusyError("slot 0 is busy: a request is running in it"), "save", 409),
    (RequestValidationError("a.bin was saved from another model", field="filename"), "restore", 400),
    (RequestValidationError("slot 9 does not exist", field="id_slot"), "save", 400),
    (FileNotFoundError(2, "No such file"), "restore", 404),
    (FileNotFoundError(2, "No such file"), "save", 500),
    (PermissionError(13, "Permission denied"), "save", 500),
    (NotImplementedError("this engine's model runner cannot save or restore slots"), "save", 501),
    (EngineUnavailableError("the engine is shutting down"), "restore", 503),
])
async def test_the_engines_refusals_are_http_errors(engine: FakeEngine, tmp_path, error, action, status) -> None:
    engine.slot_error = error
    async with client_for(make_app(engine, slot_save_path=str(tmp_path))) as c:
        r = await c.post(f"/slots/0?action={action}", json={"filename": "a.bin"})
        after = await c.get("/health")
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert after.status_code == 200  # the server goes on


async def test_the_actions_need_the_api_key(engine: FakeEngine, tmp_path) -> None:
    async with client_for(make_app(engine, slot_save_path=str(tmp_path), api_key="k")) as c:
        refused = await c.post("/slots/0?action=erase")
        allowed = await c.post("/slots/0?action=erase", headers={"Authorization": "Bearer k"})
    assert (refused.status_code, allowed.status_code) == (401, 200)
    assert engine.slot_calls == [("erase", 0, None)]
