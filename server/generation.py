"""The engine requests behind one HTTP request, and their events as SSE frames or one response.

`Generation.submit_all` submits one `GenerationRequest` per (prompt, choice) on the event loop
thread; a refusal cancels those already submitted and becomes an `ApiError` (429, 400, 503)
before any response byte is sent. `Generation.events` merges the `RequestStream`s; `sse_frames`
renders them as `data: {json}` frames ending in `data: [DONE]`, `collect` gathers them for a
non-streaming response. `Generation.cancel` (called in a `finally` by `server/app.py`) cancels
every unfinished request, so a client that goes away frees its slots.

An engine request that ends in "error", "timeout" or a "cancelled" the client did not ask for
fails the whole HTTP request: streams get a `data: {"error": ...}` frame then `[DONE]`;
non-streaming requests get 500 (engine error while it still serves), 503 (the engine stopped or
failed, e.g. shutdown; or cancelled by the server) or 504 (the request's deadline passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from scheduler.types import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_TIMEOUT,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestValidationError,
    StreamEvent,
)
from server.errors import RATE_LIMIT, SERVER_ERROR, TIMEOUT, UNAVAILABLE, ApiError, error_body, invalid, json_bytes
from server.openai_api import ChatRenderer, ChoiceResult, ParsedRequest, Renderer, render_timings
from server.prompts import PreparedPrompt
from server.replies import ReplyFormat, ReplyReader, read as read_reply
from server.tool_calls import CallArgs, CallStart, ToolCall

if TYPE_CHECKING:
    from scheduler.engine import Engine, RequestStream

log = logging.getLogger(__name__)

MAX_SEED = 2**63
DONE_FRAME = b"data: [DONE]\n\n"


@dataclasses.dataclass
class _Choice:
    index: int  # in the response: prompt_index * n + i
    prompt: PreparedPrompt
    stream: RequestStream
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those the engine reused from its prompt cache
    is_finished: bool = False


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type=UNAVAILABLE, code="unavailable")


class Generation:
    def __init__(self, engine: Engine, parsed: ParsedRequest, prompts: list[PreparedPrompt], response_id: str,
                 reply_format: ReplyFormat = ReplyFormat(), request_fields: dict[str, Any] | None = None) -> None:
        self._engine = engine
        self._request_fields = request_fields or {}  # more GenerationRequest fields (llama-server's line stops)
        self._parsed = parsed
        self._prompts = prompts
        self._response_id = response_id
        self.choices: list[_Choice] = []
        self.reply_format = reply_format  # chat: thoughts and tool calls read out of each reply

    def _request(self, prompt: PreparedPrompt, index: int, i: int) -> GenerationRequest:
        sampling = self._parsed.sampling
        if sampling.seed is not None and i:
            # n > 1 with a seed: distinct but reproducible seeds; choice 0 keeps the seed given.
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % MAX_SEED)
        return GenerationRequest(
            request_id=f"{self._response_id}-{index}",
            prompt_tokens=prompt.tokens,
            max_tokens=prompt.max_tokens,
            sampling=sampling,
            stop=self._parsed.stop,
            stop_token_ids=self._parsed.stop_token_ids,
            ignore_eos=self._parsed.ignore_eos,
            logprobs=self._parsed.logprobs is not None,
            cache_prompt=self._parsed.cache_prompt,
            cache_salt=self._parsed.cache_salt,
            constraint=self._parsed.constraint,
            # chat returns the prompt's scores once, beside the choices: its first choice scores it
            prompt_logprobs=self._parsed.scores_prompt if i == 0 or not self._parsed.is_chat else None,
            **self._request_fields,
        )

    async def compile_constraint(self) -> None:
        """A constrained request's grammar compiled on a worker thread, into the engine's kept
        grammars, so that `submit_all` on the event loop only copies it (a large schema takes a
        tenth of a second to compile, which would stall every other stream); a grammar that does
        not compile is a 400 here."""
        compile_constraint = getattr(self._engine, "compile_constraint", None)
        if self._parsed.constraint is None or compile_constraint is None:
            return
        try:
            await asyncio.to_thread(compile_constraint, self._parsed.constraint)
        except RequestValidationError as e:
            raise invalid(str(e), e.field) from None
        except EngineUnavailableError as e:
            raise unavailable(str(e) or "the engine is not available") from None

    def submit_all(self) -> None:
        n = self._parsed.n
        try:
            for p, prompt in enumerate(self._prompts):
                for i in range(n):
                    index = p * n + i
                    stream = self._engine.submit(self._request(prompt, index, i))
                    self.choices.append(_Choice(index, prompt, stream))
        except QueueFullError as e:
            self.cancel()
            raise rate_limited(e) from None
        except RequestValidationError as e:
            self.cancel()
            # prompt logprobs asked for by echo with logprobs, not by the field of that name
            field = "echo" if e.field == "prompt_logprobs" and self._parsed.prompt_logprobs is None else e.field
            raise invalid(str(e), field) from None
        except EngineUnavailableError as e:
            self.cancel()
            raise unavailable(str(e) or "the engine is not available") from None
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancels every unfinished engine request; safe to call more than once."""
        for choice in self.choices:
            if not choice.is_finished:
                choice.is_finished = True
                choice.stream.cancel()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.tokens) for p in self._prompts)  # once per prompt, whatever n is

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Per prompt, the most any of its choices reused (its tokens are counted once too)."""
        most: dict[int, int] = {}
        for c in self.choices:
            key = id(c.prompt)
            most[key] = max(most.get(key, 0), c.cached_tokens)
        return sum(most.values())

    def _record(self, choice: _Choice, event: StreamEvent) -> None:
        choice.completion_tokens += len(event.token_ids)
        if event.finish_reason is not None:
            choice.is_finished = True
            if event.completion_tokens:  # the engine's count is authoritative
                choice.completion_tokens = event.completion_tokens
            choice.cached_tokens = event.cached_tokens

    async def events(self) -> AsyncIterator[tuple[_Choice, StreamEvent]]:
        """Events of all choices as they arrive, each choice ending with its final event."""
        if len(self.choices) == 1:
            choice = self.choices[0]
            async for event in choice.stream:
                self._record(choice, event)
                yield choice, event
                if event.finish_reason is not None:
                    return
            raise RuntimeError(f"request {choice.stream.request_id} ended without a finish_reason")
        queue: asyncio.Queue[tuple[_Choice, StreamEvent | BaseException | None]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for event in choice.stream:
                    queue.put_nowait((choice, event))
                    if event.finish_reason is not None:
                        return
                queue.put_nowait((choice, None))
            except Exception as e:  # surfaced in the consumer, with its traceback
                queue.put_nowait((choice, e))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            remaining = len(self.choices)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    raise RuntimeError(f"request {choice.stream.request_id} ended without a finish_reason")
                if isinstance(item, BaseException):
                    raise item
                self._record(choice, item)
                yield choice, item
                if item.finish_reason is not None:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()

    def finish_error(self, event: StreamEvent) -> ApiError | None:
        """The error an abnormal final event becomes; None for "stop" and "length"."""
        return engine_finish_error(self._engine, event)


def matched_stop(stop: tuple[str, ...], token_ids: list[int], eog_ids: tuple[int, ...],
                 decode: Callable[[list[int]], str]) -> str | None:
    """The stop string that ended a reply which finished "stop", or None where a stop token (in
    `eog_ids`) or no stop string did: the engine cut the reply at the first stop string that
    ended in its last token (not an earlier one, which min_tokens passed over)."""
    if not stop or not token_ids or token_ids[-1] in eog_ids:
        return None
    text, tail = decode(token_ids), len(decode(token_ids[:-1]))
    found = [(i, s) for s in stop if (i := text.find(s, max(0, tail - len(s)))) >= 0]
    return min(found)[1] if found else None


def rate_limited(e: QueueFullError) -> ApiError:
    """A full queue's 429, with its Retry-After."""
    retry = str(max(1, math.ceil(e.retry_after_s)))
    return ApiError(429, str(e), type=RATE_LIMIT, code="rate_limit_exceeded", headers={"Retry-After": retry})


def engine_finish_error(engine: Any, event: StreamEvent) -> ApiError | None:
    """`finish_error`, but an engine error while the engine is not ready (a shutdown, a failed
    engine) is the service's fault, not the request's: a 503."""
    if event.finish_reason == FINISH_ERROR and engine.stats().state != "ready":
        return unavailable(f"generation stopped: {event.error or 'the engine is unavailable'}")
    return finish_error(event)


def finish_error(event: StreamEvent) -> ApiError | None:
    """The error an abnormal final event becomes, whatever the engine's state."""
    if event.finish_reason == FINISH_ERROR:
        return ApiError(500, f"generation failed: {event.error or 'engine error'}", type=SERVER_ERROR, code="engine_error")
    if event.finish_reason == FINISH_TIMEOUT:
        return ApiError(504, event.error or "generation passed the server's deadline", type=TIMEOUT, code="timeout")
    if event.finish_reason == FINISH_CANCELLED:
        return unavailable(event.error or "the request was cancelled by the server")
    return None


def sse_frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def typed_sse_frame(obj: dict[str, Any]) -> bytes:
    """A frame of the Responses and Messages APIs' streams: an `event:` line naming the object's type."""
    return b"event: " + obj["type"].encode() + b"\n" + sse_frame(obj)


async def sse_frames(gen: Generation, renderer: Renderer, include_usage: bool,
                     on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response. Errors after the headers went out become a frame.
    `on_first_token` is called as the first frame holding a token is handed over."""
    try:
        readers = {} if gen.reply_format.is_plain else {c.index: _StreamedReply(gen.reply_format.reader(stream_args=True))
                                                        for c in gen.choices}
        # a choice whose echoed prompt has its logprobs starts once they come, with its first event
        scored = renderer.echo_logprobs is not None
        starting = {c.index for c in gen.choices} if scored else set()
        for choice in gen.choices if not scored else ():
            for chunk in renderer.start_chunks(choice.index, choice.prompt.echo_text):
                yield sse_frame(chunk)
        async with contextlib.aclosing(gen.events()) as events:
            async for choice, event in events:
                if choice.index in starting:
                    starting.discard(choice.index)
                    for chunk in renderer.start_chunks(choice.index, choice.prompt.echo_text, choice.prompt.tokens,
                                                       event.prompt_logprobs) if gen.finish_error(event) is None else ():
                        yield sse_frame(chunk)
                reader = readers.get(choice.index)
                if reader is not None:  # a chat request's: its renderer is a ChatRenderer
                    chunks = reader.chunks(renderer, choice.index, event)  # type: ignore[arg-type]
                elif event.text or event.logprobs:
                    chunks = [renderer.delta_chunk(choice.index, event.text, event.logprobs)]
                else:
                    chunks = []
                for chunk in chunks:
                    frame = sse_frame(chunk)
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    yield frame
                if event.finish_reason is None:
                    continue
                error = abnormal_end(gen, choice, event)
                if error is not None:
                    yield sse_frame(error.body())
                    yield DONE_FRAME
                    return
                reason = event.finish_reason
                if reader is not None and reader.reader.num_calls and reason == "stop":
                    reason = "tool_calls"
                chunk = renderer.finish_chunk(choice.index, reason)
                if event.timings is not None:  # llama-server's, on a choice's last chunk
                    chunk["timings"] = render_timings(event.timings)
                yield sse_frame(chunk)
        if include_usage:
            yield sse_frame(renderer.usage_chunk(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
        yield DONE_FRAME
    except Exception:
        log.exception("streaming response %s failed", renderer.response_id)
        gen.cancel()
        yield sse_frame(error_body("internal error while streaming", type=SERVER_ERROR, code="internal_error"))
        yield DONE_FRAME


async def collect(gen: Generation) -> list[ChoiceResult]:
    """All choices of a non-streaming response, in index order; raises `ApiError` on failure."""
    results = {c.index: ChoiceResult(index=c.index, prompt_tokens=c.prompt.tokens) for c in gen.choices}
    texts: dict[int, list[str]] = {c.index: [c.prompt.echo_text] for c in gen.choices}
    async with contextlib.aclosing(gen.events()) as events:
        async for choice, event in events:
            texts[choice.index].append(event.text)
            results[choice.index].logprobs.extend(event.logprobs)
            results[choice.index].token_ids.extend(event.token_ids)
            if event.prompt_logprobs:
                results[choice.index].prompt_logprobs = event.prompt_logprobs
            if event.finish_reason is not None:
                error = abnormal_end(gen, choice, event)
                if error is not None:
                    raise error
                results[choice.index].finish_reason = event.finish_reason
                results[choice.index].timings = event.timings
    for index, result in results.items():
        result.text = "".join(texts[index])
        if not gen.reply_format.is_plain:
            reply = read_reply(gen.reply_format, result.text)
            result.text, result.reasoning, result.tool_calls = reply.content, reply.reasoning, reply.tool_calls
            if result.tool_calls and result.finish_reason == "stop":
                result.finish_reason = "tool_calls"
    return [results[i] for i in sorted(results)]


async def reply_parts(gen: Generation, stream_args: bool = False
                      ) -> AsyncIterator[tuple[StreamEvent, list[Any], ReplyReader]]:
    """A one-choice request's events, each with the parts its reply reader makes of it (thoughts,
    text, calls, `stream_args`: a call's arguments as they arrive; with the final event, what
    the reader held) and the reader. An abnormal end raises its `ApiError` after its parts (which
    come with the event's finish_reason cleared)."""
    reader = gen.reply_format.reader(stream_args)
    async with contextlib.aclosing(gen.events()) as events:
        async for choice, event in events:
            parts = reader.feed(event.text) if event.text else []
            if event.finish_reason is None:
                yield event, parts, reader
                continue
            parts += reader.finish()
            error = abnormal_end(gen, choice, event)
            if error is None:
                yield event, parts, reader
                return
            yield dataclasses.replace(event, finish_reason=None), parts, reader
            raise error


class _StreamedReply:
    """A streamed chat choice's text through its `ReplyReader`: thought, content and call deltas
    (a call's head, then its arguments as they arrive, or, for a call read whole, all of it in
    one), each token's logprobs sent with the first chunk after it (or with the choice's end)."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self._logprobs: list[Any] = []
        self._calls_sent = 0  # the next call's index in the choice's tool_calls
        self._open_index: dict[str, int] = {}  # a streamed call's id -> its index

    def chunks(self, renderer: ChatRenderer, index: int, event: StreamEvent) -> list[dict[str, Any]]:
        self._logprobs.extend(event.logprobs)
        parts = self.reader.feed(event.text) if event.text else []
        if event.finish_reason is not None:
            parts += self.reader.finish()
        out = []
        for part in parts:
            logprobs, self._logprobs = tuple(self._logprobs), []
            if isinstance(part, CallStart):
                self._open_index[part.id] = self._calls_sent
                head = ToolCall(part.name, "", part.id)
                out.append(renderer.tool_call_chunk(index, head, self._calls_sent, logprobs))
                self._calls_sent += 1
            elif isinstance(part, CallArgs):
                out.append(renderer.tool_args_chunk(index, self._open_index[part.id], part.text, logprobs))
            elif isinstance(part, ToolCall):
                if part.streamed:  # its head and arguments went out already
                    self._logprobs = list(logprobs)
                    continue
                out.append(renderer.tool_call_chunk(index, part, self._calls_sent, logprobs))
                self._calls_sent += 1
            elif part[0] == "reasoning":
                out.append(renderer.reasoning_chunk(index, part[1], logprobs))
            else:
                out.append(renderer.delta_chunk(index, part[1], logprobs))
        if event.finish_reason is not None and self._logprobs:
            out.append(renderer.delta_chunk(index, "", tuple(self._logprobs)))
            self._logprobs = []
        return out


def abnormal_end(gen: Generation, choice: _Choice, event: StreamEvent) -> ApiError | None:
    """For a final event: the error it ends the HTTP request with (other choices cancelled)."""
    error = gen.finish_error(event)
    if error is not None:
        log.warning("request %s ended with %s: %s", choice.stream.request_id, event.finish_reason, error.message)
        gen.cancel()
    return error
