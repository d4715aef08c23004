"""A request's stream of `StreamEvent`s and its way from the engine thread to the event loop.

`Engine.submit` (scheduler/engine.py) makes a `RequestStream` on the event-loop thread; the
engine thread hands it events with `call_soon_threadsafe` (`_hand_over`: a processed step's
events for all of a loop's streams in one wake-up, JetStream's async_multifuture pattern), and a
cancel travels back to the engine's inbox as `_Cancel`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from scheduler.types import StreamEvent

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Cancel:
    seq: int



class RequestStream:
    """Async iterator of one request's `StreamEvent`s; the last one has `finish_reason` set.

    Created by `Engine.submit` on the event-loop thread. The engine thread hands events to the
    loop with `call_soon_threadsafe` (`_hand_over`): a processed step's events for all of a loop's
    streams in one call, any other event alone (`_push`); everything else runs on the loop.
    """

    def __init__(self, request_id: str, seq: int, loop: asyncio.AbstractEventLoop, inbox: Any, tag: Any = None) -> None:
        self.request_id = request_id
        self.tag = tag  # the submitter's own key (scheduler/engine_process.py's request key)
        self._seq = seq
        self._loop = loop
        self._inbox = inbox
        self._events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._is_final_queued = False  # loop thread: the final event is in `_events`
        self._is_exhausted = False  # loop thread: the final event was returned
        self._is_cancelled = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._is_exhausted:
            raise StopAsyncIteration
        event = await self._events.get()
        if event.finish_reason is not None:
            self._is_exhausted = True
        return event

    def cancel(self) -> None:
        """Thread-safe and idempotent; the engine frees the slot before its next step."""
        if not self._is_cancelled:
            self._is_cancelled = True
            self._inbox.put(_Cancel(self._seq))

    async def aclose(self) -> None:
        self.cancel()

    def _push(self, event: StreamEvent) -> None:
        """Engine thread: hands one event to the loop."""
        _hand_over(self._loop, [(self, event)])

    def _deliver(self, event: StreamEvent) -> None:
        """Loop thread. Anything after the final event (a racing duplicate end) is dropped."""
        if self._is_final_queued:
            return
        self._is_final_queued = event.finish_reason is not None
        self._events.put_nowait(event)


def _deliver_all(items: list[tuple[RequestStream, StreamEvent]]) -> None:
    """Loop thread: events for streams of this loop, in the order they were made."""
    for stream, event in items:
        stream._deliver(event)


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, StreamEvent]]) -> None:
    """Engine thread: events to their streams' loop in one wake-up. A closed loop means the
    clients are gone: the events are dropped."""
    try:
        loop.call_soon_threadsafe(_deliver_all, items)
    except RuntimeError:
        log.debug("event loop closed; %d events dropped", len(items))
