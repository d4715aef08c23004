"""Loading and health, metrics, tokenize/detokenize, models, and clients that leave early."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Awaitable, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from model.step_types import SamplingParams
from scheduler.types import SlotInfo
from server import metrics
from server.app import EngineHolder, create_app
from server.config import ServerConfig
from tests.server.fakes import BOS, MODEL_NAME, FakeEngine, client_for, make_app, tok

pytestmark = pytest.mark.anyio


class _ObservedHolder(EngineHolder):
    """Lets a test await the loader thread's reports, which arrive on the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        self.changed.set()

    def mark_ready(self) -> None:
        super().mark_ready()
        self.changed.set()

    def fail(self, message: str) -> None:
        super().fail(message)
        self.changed.set()

    async def next_change(self) -> None:
        async with asyncio.timeout(10):
            await self.changed.wait()
        self.changed.clear()


async def test_health_follows_the_engine(engine: FakeEngine) -> None:
    app = make_app(None)
    holder: EngineHolder = app.state.holder
    async with client_for(app) as c:
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        holder.attach(engine)  # built, still warming up
        assert (await c.get("/health")).status_code == 503
        holder.mark_ready()
        r = await c.get("/health")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "ok" and body["model"] == "fake-model" and body["slots"] == 2
        assert body["kernels"] == {"attention": "reference"} and body["max_context"] == 64
        engine.state = "failed"
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "failed", "error": "device lost"})
        assert (await c.get("/v1/health")).status_code == 503


async def test_loader_thread_and_shutdown() -> None:
    engine = FakeEngine()
    engine.ready_gate = threading.Event()
    holder = _ObservedHolder()
    app = create_app(ServerConfig(model_name=MODEL_NAME), holder, engine_factory=lambda: engine)
    async with app.router.lifespan_context(app), client_for(app) as c:
        await holder.next_change()  # attached
        assert (await c.get("/health")).json() == {"status": "loading"}
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 503
        engine.ready_gate.set()
        await holder.next_change()  # ready
        assert engine.is_started
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200
        assert not engine.is_shut_down
    assert engine.is_shut_down


async def test_load_failure_shows_on_health() -> None:
    def factory() -> FakeEngine:
        raise FileNotFoundError("no such model")

    holder = _ObservedHolder()
    app = create_app(ServerConfig(model_name=MODEL_NAME), holder, engine_factory=factory)
    async with app.router.lifespan_context(app), client_for(app) as c:
        await holder.next_change()
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "failed", "error": "FileNotFoundError: no such model"})
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "no such model" in r.json()["error"]["message"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    assert (await client.get("/nope")).status_code == 404
    assert (await client.get("/v1/responses/resp_none")).status_code == 404  # a templated route, by its template
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    http = "pallas_http_requests_total"
    assert m[(http, (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))] == 1
    assert m[(http, (("method", "GET"), ("route", "other"), ("status", "404")))] == 1
    assert m[(http, (("method", "GET"), ("route", "/v1/responses/{response_id}"), ("status", "404")))] == 1
    assert m[("pallas_time_to_first_token_seconds_count", ())] == 1
    assert m[("pallas_time_to_first_token_seconds_sum", ())] == pytest.approx(0.02)
    assert m[("pallas_inter_token_latency_seconds_count", ())] == 10  # 11 tokens
    assert m[("pallas_request_duration_seconds_count", ())] == 1
    assert m[("pallas_request_queue_seconds_count", ())] == 1
    assert m[("pallas_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert m[("pallas_engine_ready", ())] == 1
    assert m[("pallas_slots", ())] == 2
    assert m[("pallas_slots_busy", ())] == 0
    assert m[("pallas_slot_occupancy", ())] == 0
    assert m[("pallas_requests_running", ())] == 0 and m[("pallas_requests_waiting", ())] == 0
    assert m[("pallas_requests_rejected_total", ())] == 0
    assert m[("pallas_prompt_tokens_total", ())] == 2
    assert m[("pallas_generation_tokens_total", ())] == 7
    assert m[("pallas_prompt_tokens_cached_total", ())] == 5
    # the HTTP layer's share: every generation request is admitted; only streamed ones have frames
    assert m[("pallas_http_admit_seconds_count", ())] == 1
    assert m[("pallas_http_time_to_first_frame_seconds_count", ())] == 0
    admitted = m[("pallas_http_admit_seconds_sum", ())]
    async with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        assert resp.status_code == 200 and (await resp.aread()).endswith(b"data: [DONE]\n\n")
    m = _samples((await client.get("/metrics")).text)
    assert m[("pallas_http_admit_seconds_count", ())] == 2
    assert m[("pallas_http_time_to_first_frame_seconds_count", ())] == 1
    admit = m[("pallas_http_admit_seconds_sum", ())] - admitted  # the streamed request's, within its first frame's
    assert 0 < admitted and 0 < admit <= m[("pallas_http_time_to_first_frame_seconds_sum", ())]


async def test_metrics_without_an_engine_and_per_app_registries() -> None:
    apps = [make_app(None), make_app(None)]  # a second app must not collide with the first
    async with client_for(apps[1]) as c:
        m = _samples((await c.get("/metrics")).text)
    assert m[("pallas_engine_ready", ())] == 0 and m[("pallas_slots", ())] == 0


async def test_gc_pauses_are_in_the_metrics_by_generation(client: httpx.AsyncClient) -> None:
    import gc

    def full_collections() -> tuple[float, float]:
        return m[("pallas_gc_pause_seconds_count", (("generation", "2"),))], m[("pallas_gc_pause_seconds_sum", (("generation", "2"),))]

    m = _samples((await client.get("/metrics")).text)
    before = full_collections()
    gc.collect()
    gc.collect()
    m = _samples((await client.get("/metrics")).text)
    count, total = full_collections()
    assert count >= before[0] + 2 and total > before[1]  # (a collection of the scrape's own may add to them)
    bounds = [*map(repr, metrics.GC_BUCKETS), "+Inf"]
    for generation in "012":  # cumulative buckets, never decreasing
        cumulative = [m[("pallas_gc_pause_seconds_bucket", (("generation", generation), ("le", le)))] for le in bounds]
        assert cumulative == sorted(cumulative)
    assert metrics.gc_pauses() is metrics.gc_pauses() and gc.callbacks.count(metrics.gc_pauses().callback) == 1
    assert not any(name.startswith("pallas_engine_gc") for name, _ in m)  # the engine runs in this process


def test_the_engine_process_gc_pauses_are_in_the_metrics() -> None:
    """Where the engine runs in a process of its own, its GC snapshots (scheduler/engine_process.py)
    are exported beside the server's own."""
    counts = ((3, 1) + (0,) * (len(metrics.GC_BUCKETS) - 1), (0,) * (len(metrics.GC_BUCKETS) + 1),
              (0,) * len(metrics.GC_BUCKETS) + (1,))
    m = _samples(metrics.Metrics(lambda: None, lambda: (counts, (0.0002, 0.0, 2.0))).render()[0].decode())
    name = "pallas_engine_gc_pause_seconds"
    assert m[(f"{name}_count", (("generation", "0"),))] == 4 and m[(f"{name}_sum", (("generation", "0"),))] == 0.0002
    assert m[(f"{name}_bucket", (("generation", "0"), ("le", repr(metrics.GC_BUCKETS[0]))))] == 3
    assert m[(f"{name}_bucket", (("generation", "2"), ("le", "1.0")))] == 0  # one collection over a second
    assert m[(f"{name}_count", (("generation", "2"),))] == 1


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == MODEL_NAME and entry["object"] == "model" and entry["owned_by"] == "pallas-serve"
    assert (await client.get("/models")).json()["data"][0]["id"] == MODEL_NAME


async def test_props_as_llama_server_has_them(engine: FakeEngine) -> None:
    app = make_app(None)
    async with client_for(app) as c:
        assert (await c.get("/props")).status_code == 503  # loading
        app.state.holder.attach(engine)
        app.state.holder.mark_ready()
        body = (await c.get("/props")).json()
    assert body["default_generation_settings"]["n_ctx"] == engine.max_context == 64
    assert body["default_generation_settings"]["params"]["temperature"] == 1.0  # OpenAI's default, as parsed
    params = body["default_generation_settings"]["params"]
    assert (params["repeat_last_n"], params["mirostat"], params["dry_multiplier"]) == (64, 0, 0.0)  # /completion's
    assert body["total_slots"] == 2 and body["model_path"] == MODEL_NAME
    assert body["chat_template"] == engine.tokenizer.chat_template
    assert (body["bos_token"], body["eos_token"]) == ("<s>", "</s>")
    assert body["modalities"] == {"vision": False, "audio": False} and body["build_info"].startswith("pallas-serve ")
    assert (body["tool_call_parser"], body["reasoning_format"]) == (None, "none")


async def test_slots_as_llama_server_has_them(engine: FakeEngine) -> None:
    app = make_app(None)
    async with client_for(app) as c:
        assert (await c.get("/slots")).status_code == 503  # loading
        app.state.holder.attach(engine)
        app.state.holder.mark_ready()
        idle = (await c.get("/slots")).json()
        assert (await c.get("/slots?fail_on_no_slot=1")).status_code == 200  # one is idle
        params = SlotInfo.params_of(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                                   repetition_penalty=1.1, frequency_penalty=0.5, xtc_probability=0.5))
        engine.busy_slots = ((1, 7, 10, 6, 2, 3, 20, params),)
        busy = (await c.get("/slots")).json()
        engine.busy_slots += ((0, 9, 4, 4, 0, 1, 8, SlotInfo.params_of(SamplingParams(seed=5))),)
        full = await c.get("/slots?fail_on_no_slot")
    assert idle == [{"id": i, "n_ctx": 64, "speculative": False, "is_processing": False, "n_cached": 0} for i in range(2)]
    assert busy[0] == idle[0]
    assert busy[1] == {
        "id": 1, "n_ctx": 64, "speculative": False, "is_processing": True, "n_cached": 0, "id_task": 7,
        "n_prompt_tokens": 10, "n_prompt_tokens_processed": 4, "n_prompt_tokens_cache": 2,
        "params": {"temperature": 0.7, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": 40, "top_p": 0.9,
                   "min_p": 0.05, "typical_p": 1.0, "top_n_sigma": 0.0, "xtc_probability": 0.5, "xtc_threshold": 0.1,
                   "repeat_penalty": 1.1, "presence_penalty": 0.0, "frequency_penalty": 0.5, "repeat_last_n": None, "dry_multiplier": 0.0,
                   "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
                   "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0, "mirostat_tau": 5.0,
                   "mirostat_eta": 0.1, "seed": -1, "n_predict": 20},
        "next_token": [{"has_next_token": True, "n_remain": 17, "n_decoded": 3}]}
    assert full.status_code == 503 and "no slot available" in full.json()["error"]["message"]


async def test_apply_template(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    r = await client.post("/apply-template", json={"messages": messages})
    assert r.json() == {"prompt": "<s><|system|>S\n<|user|>Hi\n<|assistant|>"}
    r = await client.post("/apply-template", json={"messages": messages, "add_generation_prompt": False})
    assert r.json() == {"prompt": "<s><|system|>S\n<|user|>Hi\n"}
    assert (await client.post("/apply-template", json={"messages": []})).status_code == 400
    assert engine.requests == []  # nothing generated


async def test_tokenize_and_detokenize(client: httpx.AsyncClient) -> None:
    async def tokens(body: dict[str, Any]) -> Any:
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert await tokens({"content": "Hi"}) == tok("Hi")  # add_special defaults to false
    assert await tokens({"content": "Hi", "add_special": True}) == [BOS, *tok("Hi")]
    assert await tokens({"prompt": "<s>"}) == [BOS]  # parse_special defaults to true
    assert await tokens({"content": "<s>", "parse_special": False}) == tok("<s>")
    assert await tokens({"content": "Hi", "with_pieces": True}) == [
        {"id": tok("H")[0], "piece": "H"},
        {"id": tok("i")[0], "piece": "i"},
    ]
    assert await tokens({"content": "é", "with_pieces": True}) == [
        {"id": tok("é")[0], "piece": [0xC3]},  # not whole UTF-8: bytes, as llama-server
        {"id": tok("é")[1], "piece": [0xA9]},
    ]
    r = await client.post("/detokenize", json={"tokens": [BOS, *tok("Hi")]})
    assert r.json() == {"content": "<s>Hi"}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"content": ""}


# ----------------------------------------------------------------------------- clients leaving


LeaveWhen = Callable[[list[dict], asyncio.Event], Awaitable[None]]


async def _call(app: Starlette, body: dict[str, Any], leave_when: LeaveWhen) -> list[dict]:
    """Drives the ASGI app by hand: sends `body`, then reports a disconnect once
    `leave_when(sent, progress)` returns; `progress` is set on every message the app sends."""
    sent: list[dict] = []
    progress = asyncio.Event()
    is_body_read = False

    async def receive() -> dict:
        nonlocal is_body_read
        if not is_body_read:
            is_body_read = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave_when(sent, progress)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        progress.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }
    async with asyncio.timeout(10):
        await app(scope, receive, send)
    return sent


async def test_client_leaving_a_stream_cancels_its_requests(app: Starlette, engine: FakeEngine) -> None:
    engine.hold = True  # each request sends "H", then keeps running until cancelled

    async def after_first_delta(sent: list[dict], progress: asyncio.Event) -> None:
        while not any(b'"text":"H"' in m.get("body", b"") for m in sent):
            progress.clear()
            await progress.wait()

    sent = await _call(app, {"prompt": "x", "stream": True, "n": 2}, after_first_delta)
    assert sent[0]["status"] == 200
    assert [s.is_cancelled for s in engine.streams] == [True, True]
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
    async with client_for(app) as c:
        m = _samples((await c.get("/metrics")).text)
    assert m[("pallas_requests_finished_total", (("finish_reason", "cancelled"),))] == 2


async def test_client_leaving_a_non_streaming_request_cancels_it(app: Starlette, engine: FakeEngine) -> None:
    engine.hold = True
    engine.submitted = asyncio.Event()

    async def after_submit(sent: list[dict], progress: asyncio.Event) -> None:
        assert engine.submitted is not None
        await engine.submitted.wait()

    sent = await _call(app, {"prompt": "x"}, after_submit)
    assert engine.streams[0].is_cancelled
    assert sent[0]["status"] == 499  # never reaches the client; recorded in metrics

