"""What the engine tests share: building requests, reading streams to their end, waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time

from scheduler.types import GenerationRequest, StreamEvent


@dataclasses.dataclass
class Result:
    events: list[StreamEvent]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def final(self) -> StreamEvent:
        return self.events[-1]


def req(prompt: str | list[int], max_tokens: int = 5, **kw) -> GenerationRequest:
    tokens = tuple(prompt.encode()) if isinstance(prompt, str) else tuple(prompt)
    return GenerationRequest(request_id=kw.pop("request_id", "r"), prompt_tokens=tokens, max_tokens=max_tokens, **kw)


async def collect(stream) -> Result:
    events = [event async for event in stream]
    assert events[-1].finish_reason is not None
    assert all(e.finish_reason is None for e in events[:-1])
    return Result(events)


def run(coro, timeout: float = 10.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def expected_text(last: str, n: int) -> str:
    return "".join(chr(ord(last) + i + 1) for i in range(n))


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


def engine_thread_is_blocked_on_inbox(engine) -> bool:
    frame = sys._current_frames().get(engine._thread.ident)
    names = []
    while frame is not None:
        names.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return any(fn.endswith("queue.py") and name == "get" for fn, name in names)


async def collect_one(engine, request) -> Result:
    return await collect(engine.submit(request))
