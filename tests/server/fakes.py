"""A fake engine and tokenizer with hand-computable output, shaped like `scheduler.engine.Engine`
and `model.tokenizer.Tokenizer` (after JetStream's mock_engine).

Tokenizer: byte level. Id 0 <pad>, 1 <s> (BOS, added by default), 2 </s> (EOS), 3 + b for byte b.
Engine: every request generates `reply` ("Hello world" by default) one character per event (one
token per UTF-8 byte); the last character's event carries the finish reason. Stop strings cut
the reply before the first match ("stop"); max_tokens cuts it after max_tokens characters
("length"; replies in tests that use it are ASCII). Token i (0-based) has logprob -(i + 1) / 10
and alternatives [(id, lp), (id + 1, lp - 1), ...].
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import json
from typing import Any, Callable

import httpx
import numpy as np
from starlette.applications import Starlette

from scheduler.requests import RequestTiming
from scheduler.types import (
    EngineStats,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    StreamEvent,
    Timings,
    TokenLogprob,
)
from server.app import EngineHolder, create_app
from server.config import ServerConfig

PAD, BOS, EOS = 0, 1, 2
SPECIALS = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}
BYTE_OFFSET = 3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tok(text: str) -> list[int]:
    """Ids of `text` without BOS."""
    return [BYTE_OFFSET + b for b in text.encode()]


class FakeTokenizer:
    vocab_size = 256 + BYTE_OFFSET
    bos_id = BOS
    eos_id = EOS
    eog_ids = (EOS,)

    add_bos = True

    def __init__(self, chat_template: str | None = CHAT_TEMPLATE) -> None:
        self.chat_template = chat_template
        self.fim_ids: dict[str, int] = {}  # none: /infill answers 501 (a test may give some)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        ids = [BOS] if add_bos is None or add_bos else []
        rest = text
        while rest:
            special = next((i for i, s in SPECIALS.items() if parse_special and rest.startswith(s)), None)
            if special is not None:
                ids.append(special)
                rest = rest[len(SPECIALS[special]) :]
            else:
                ids.extend(tok(rest[0]))
                rest = rest[1:]
        return ids

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i in SPECIALS:
                out.append(pending.decode("utf-8", "replace"))
                pending.clear()
                if not skip_special:
                    out.append(SPECIALS[i])
            else:
                pending.append(i - BYTE_OFFSET)
        out.append(pending.decode("utf-8", "replace"))
        return "".join(out)

    def token_to_piece(self, token_id: int) -> str:
        return SPECIALS.get(token_id) or bytes([token_id - BYTE_OFFSET]).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return SPECIALS[token_id].encode() if token_id in SPECIALS else bytes([token_id - BYTE_OFFSET])


def logprob_of(i: int) -> float:
    return -(i + 1) / 10


def script_reply(request: GenerationRequest, reply: str) -> list[StreamEvent]:
    """The default script: `reply`, one character per event, cut by stop strings and max_tokens."""
    text, reason = reply, "stop"
    cuts = [text.find(s) for s in request.stop if s in text]
    if cuts:
        text = text[: min(cuts)]
    if len(text) > request.max_tokens:
        text, reason = text[: request.max_tokens], "length"
    events, i = [], 0
    for ch in text:  # a character is one token per UTF-8 byte; its text comes whole
        lps = []
        for token in tok(ch):
            top = tuple((token + j, logprob_of(i) - j) for j in range(request.sampling.top_logprobs))
            lps.append(TokenLogprob(token, logprob_of(i), top))
            i += 1
        events.append(StreamEvent(text=ch, token_ids=tuple(tok(ch)), logprobs=tuple(lps) if request.logprobs else ()))
    # llama-server's timings: the prompt in 20 ms, then 5 ms a token
    timings = Timings(prompt_n=len(request.prompt_tokens), cache_n=0, prompt_ms=20.0, predicted_n=i,
                      predicted_ms=5.0 * (i - 1) if i else None)
    final = dict(finish_reason=reason, prompt_tokens=len(request.prompt_tokens), completion_tokens=i, timings=timings)
    if events:
        events[-1] = dataclasses.replace(events[-1], **final)
    else:
        events.append(StreamEvent(**final))
    return events


EMBEDDING_LENGTH = 4


def fake_embedding(tokens: tuple[int, ...] | list[int], pooling: str) -> np.ndarray:
    """The fake engine's pooled vector of a prompt: its mean token id (mean) or last (last), its
    length, and two constants."""
    first = float(np.mean(tokens)) if pooling == "mean" else float(tokens[-1])
    return np.asarray([first, len(tokens), 3.0, -4.0], np.float32)


def embedding_event(request: GenerationRequest) -> StreamEvent:
    """An embedding request's one event (GenerationRequest.pooling)."""
    n = len(request.prompt_tokens)
    return StreamEvent(finish_reason="length", prompt_tokens=n,
                       embedding=fake_embedding(request.prompt_tokens, request.pooling),
                       timings=Timings(prompt_n=n, cache_n=0, prompt_ms=5.0, predicted_n=0, predicted_ms=None))


class FakeStream:
    def __init__(self, request_id: str, events: list[StreamEvent], hold: bool, on_cancel: Callable[[], None]) -> None:
        self.request_id = request_id
        self._on_cancel = on_cancel
        self.is_cancelled = False
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._is_done = False
        # hold: deliver the first event, then nothing until cancelled (a slow generation).
        for event in events[:1] if hold else events:
            self._queue.put_nowait(event)

    def cancel(self) -> None:
        if not self.is_cancelled:
            self.is_cancelled = True
            if not self._is_done:
                self._on_cancel()
                self._queue.put_nowait(StreamEvent(finish_reason="cancelled"))

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._is_done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.finish_reason is not None:
            self._is_done = True
        return event


class FakeEngine:
    def __init__(self, *, num_slots: int = 2, max_context: int = 64, max_top_logprobs: int = 5) -> None:
        self.tokenizer = FakeTokenizer()
        self.num_slots = num_slots
        self.max_context = max_context
        self.max_top_logprobs = max_top_logprobs
        self.state = "ready"
        self.reply = "Hello world"
        self.script: Callable[[GenerationRequest], list[StreamEvent]] | None = None
        self.hold = False
        self.queue_full_after: int | None = None  # submits accepted before QueueFullError
        self.submit_error: Exception | None = None
        self.submitted: asyncio.Event | None = None  # set on each submit, when a test provides it
        self.observers: list[Callable[[RequestTiming], None]] = []
        self.requests: list[GenerationRequest] = []
        self.streams: list[FakeStream] = []
        self.rejected = 0
        self.is_started = False
        self.is_shut_down = False
        self.ready_gate: threading.Event | None = None  # wait_ready blocks on it when set
        self.busy_slots: tuple[tuple, ...] = ()  # EngineStats.slots, as a test sets them
        self.cached: tuple[int, ...] = ()  # EngineStats.cached, as a test sets them
        self.slot_calls: list[tuple[str, int, str | None]] = []  # slot_action's arguments
        self.slot_error: Exception | None = None  # what slot_action raises, when set

    def start(self) -> None:
        self.is_started = True

    def wait_ready(self, timeout: float | None = None) -> bool:
        if self.ready_gate is not None and not self.ready_gate.wait(10):
            raise TimeoutError("the test never opened ready_gate")
        return self.state == "ready"

    def stats(self) -> EngineStats:
        running = sum(1 for s in self.streams if not s._is_done and not s.is_cancelled)
        return EngineStats(
            state=self.state,
            num_slots=self.num_slots,
            slots_busy=min(running, self.num_slots),
            requests_running=min(running, self.num_slots),
            requests_waiting=max(0, running - self.num_slots),
            requests_rejected_total=self.rejected,
            prompt_tokens_total=sum(len(r.prompt_tokens) for r in self.requests),
            generation_tokens_total=7,
            prompt_tokens_cached_total=5,
            error="device lost" if self.state == "failed" else None,
            slots=self.busy_slots,
            cached=self.cached,
        )

    def slot_action(self, action: str, slot: int, path: str | None = None) -> dict:
        """Records the call; raises `slot_error` or answers as the engine would for a slot of 512."""
        self.slot_calls.append((action, slot, path))
        if self.slot_error is not None:
            raise self.slot_error
        if action == "erase":
            return {"id_slot": slot, "n_erased": 512}
        name = path.rsplit("/", 1)[-1] if path else None
        count = "n_saved" if action == "save" else "n_restored"
        return {"id_slot": slot, "filename": name, count: 512, "timings": {f"{action}_ms": 1.0}}

    def add_observer(self, observer: Callable[[RequestTiming], None]) -> None:
        self.observers.append(observer)

    def _finished(self, request: GenerationRequest, reason: str, completion_tokens: int) -> None:
        """Tells observers, as the engine thread does: ttft 0.02 s, 0.005 s between tokens."""
        timing = RequestTiming(
            request_id=request.request_id,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=completion_tokens,
            queue_s=0.001,
            ttft_s=0.02 if completion_tokens else None,
            itl_s=(0.005,) * max(0, completion_tokens - 1),
            e2e_s=0.5,
        )
        for observer in self.observers:
            observer(timing)

    def info(self) -> dict[str, Any]:
        return {
            "model": "fake-model",
            "num_slots": self.num_slots,
            "max_context": self.max_context,
            "max_top_logprobs": self.max_top_logprobs,
            "kernels": {"attention": "reference"},
            "embedding_length": EMBEDDING_LENGTH,
            "pooling": None,
        }

    def submit(self, request: GenerationRequest) -> FakeStream:
        if self.submit_error is not None:
            raise self.submit_error
        if self.state != "ready":
            raise EngineUnavailableError(f"engine {self.state}")
        if self.queue_full_after is not None and len(self.requests) >= self.queue_full_after:
            self.rejected += 1
            raise QueueFullError(retry_after_s=2.5)
        self.requests.append(request)
        if self.script:
            events = self.script(request)
        elif request.pooling is not None:
            events = [embedding_event(request)]
        else:
            events = script_reply(request, self.reply)
        on_cancel = functools.partial(self._finished, request, "cancelled", 1)
        stream = FakeStream(request.request_id, events, self.hold, on_cancel)
        self.streams.append(stream)
        if not self.hold:
            final = events[-1]
            assert final.finish_reason is not None, "a script must end with a finish reason"
            self._finished(request, final.finish_reason, final.completion_tokens)
        if self.submitted is not None:
            self.submitted.set()
        return stream

    def shutdown(self, timeout: float | None = None) -> None:
        self.is_shut_down = True
        self.state = "stopped"


def parse_sse(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body: JSON objects, and the string "[DONE]"."""
    if not body.endswith("\n\n"):
        raise AssertionError(f"SSE body does not end with a blank line: {body[-40:]!r}")
    out: list[Any] = []
    for frame in body[:-2].split("\n\n"):
        if not frame.startswith("data: ") or "\n" in frame:
            raise AssertionError(f"bad SSE frame {frame!r}")
        data = frame[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def parse_typed_sse(body: str) -> list[dict[str, Any]]:
    """An SSE body of typed events (the Responses and Messages APIs'): each frame an `event:` line
    and a `data:` line whose object names the same type; no `[DONE]`."""
    assert body.endswith("\n\n") and "[DONE]" not in body
    out = []
    for frame in body[:-2].split("\n\n"):
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


MODEL_NAME = "fake.gguf"


def make_app(engine: FakeEngine | None, **config: Any) -> Starlette:
    """An app whose holder has `engine` attached and ready (nothing attached when None)."""
    holder = EngineHolder()
    if engine is not None:
        holder.attach(engine)  # type: ignore[arg-type]
        holder.mark_ready()
    return create_app(ServerConfig(model_name=MODEL_NAME, **config), holder)


def client_for(app: Starlette, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kwargs)
