"""The Starlette app: routes, middleware, and the engine as the event loop sees it.

HTTP answers before the model has loaded. `create_app(engine_factory=...)` starts a loader
thread at startup that builds the engine (`engine_factory()`, which loads the GGUF), starts it
and waits for its warm-up; results reach the event loop through `loop.call_soon_threadsafe`, so
`EngineHolder` is only ever touched on the loop thread. Until then /health says "loading" and
generation routes answer 503. Tests attach a fake engine to the holder directly.

Request path: middleware (`server/asgi.py`: HTTP metrics, 500 boundary, CORS, body limit, API
key) -> route ->
`server/openai_api.py` (parse) -> `server/prompts.py` (tokenize, check) ->
`server/generation.py` (submit, stream or collect). `/v1/responses` (server/responses_api.py)
and `/v1/messages` (server/messages_api.py) become chat requests, llama-server's `/completion`
(server/llama_api.py) a completion request, as does its `/infill` (server/infill.py), and
follow the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import math
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from model.chat_template import render_chat
from scheduler.gc_pauses import GcSnapshot
from scheduler.requests import RequestTiming
from scheduler.types import Constraint, EngineStats, GenerationRequest
from server import embeddings_api, llama_api, messages_api, reasoning, responses_api, slots_api, tool_calls
from server import infill as infill_api
from server.asgi import ApiKeyAuth, BodyLimit, ErrorBoundary, EventStreamResponse, HttpMetricsMiddleware, unless_disconnected
from server.config import ServerConfig
from server.errors import ApiError, error_response, invalid, json_response
from server.generation import Generation, collect, sse_frames, unavailable
from server.metrics import Metrics
from server.openai_api import ChatRenderer, CompletionRenderer, Fields, ParsedRequest, parse_chat, parse_completion
from server.prompts import ModelLimits, PreparedPrompt, bos_eos_text, prepare
from server.prompts import count as count_prompt
from server.prompts import render as render_prompt
from server.replies import ReplyFormat
from server.samplers import sampling_settings

if TYPE_CHECKING:
    from scheduler.engine import Engine

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed request"; recorded in metrics only


# ----------------------------------------------------------------------------- engine holder


@dataclasses.dataclass(frozen=True)
class ReadyState:
    info: dict[str, Any]
    limits: ModelLimits
    chat_template: str | None  # the GGUF's; None: none (chat answers 400 unless --chat-template)


class EngineHolder:
    """The engine, its load error, and what it reported once ready. Event loop thread only."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.ready: ReadyState | None = None
        self.load_error: str | None = None
        self._observers: list[Callable[[RequestTiming], None]] = []

    def add_timing_observer(self, observer: Callable[[RequestTiming], None]) -> None:
        """Registers `observer` with the engine, now or when one is attached."""
        self._observers.append(observer)
        if self.engine is not None:
            self.engine.add_observer(observer)

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        for observer in self._observers:
            engine.add_observer(observer)

    def mark_ready(self) -> None:
        if self.engine is None:
            raise RuntimeError("mark_ready before attach")
        info = dict(self.engine.info())
        tokenizer = self.engine.tokenizer
        limits = ModelLimits(
            max_context=int(info["max_context"]),
            vocab_size=int(tokenizer.vocab_size),
            max_top_logprobs=int(info.get("max_top_logprobs", 20)),
            max_logit_bias=info.get("max_logit_bias"),
        )
        self.ready = ReadyState(info=info, limits=limits, chat_template=tokenizer.chat_template)
        log.info("engine ready: %s", json.dumps(info, default=str))

    def fail(self, message: str) -> None:
        self.load_error = message

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def engine_gc(self) -> GcSnapshot | None:
        """The engine process's GC pauses; None where the engine runs in this process."""
        gc_pauses = getattr(self.engine, "gc_pauses", None)
        return gc_pauses() if gc_pauses is not None else None

    def require_ready(self) -> tuple[Engine, ReadyState]:
        if self.load_error is not None:
            raise unavailable(f"the model failed to load: {self.load_error}")
        if self.engine is None or self.ready is None:
            raise ApiError(503, "the model is loading", type="unavailable_error", code="model_loading")
        return self.engine, self.ready

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.load_error is not None:
            return 503, {"status": "failed", "error": self.load_error}
        if self.engine is None:
            return 503, {"status": "loading"}
        st = self.engine.stats()
        if st.state == "ready" and self.ready is not None:
            info = self.ready.info
            return 200, {
                "status": "ok",
                "model": info.get("model"),
                "slots": st.num_slots,
                "slots_busy": st.slots_busy,
                "requests_running": st.requests_running,
                "requests_waiting": st.requests_waiting,
                "max_context": self.ready.limits.max_context,
                "kernels": info.get("kernels"),
                "engine": info,
            }
        if st.state in ("loading", "ready"):
            return 503, {"status": "loading"}
        return 503, {"status": st.state, "error": st.error}


def _load_engine(factory: Callable[[], Engine], holder: EngineHolder, loop: asyncio.AbstractEventLoop) -> None:
    """Loader thread: build, start, warm up; report each stage to the loop thread."""

    def post(fn: Callable[..., None], *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop has closed: the server is gone
            return False

    try:
        engine = factory()
    except Exception as e:
        log.exception("loading the model failed")
        post(holder.fail, f"{type(e).__name__}: {e}")
        return
    if not post(holder.attach, engine):
        engine.shutdown()
        return
    try:
        engine.start()
        is_ready = engine.wait_ready()
    except Exception as e:
        log.exception("starting the engine failed")
        post(holder.fail, f"{type(e).__name__}: {e}")
        return
    if is_ready:
        post(holder.mark_ready)
    else:
        log.error("the engine failed during warm-up: %s", engine.stats().error)


# ----------------------------------------------------------------------------- routes


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """A JSON number, refused where it is beyond a double's range (1e400 would read as inf, which
    no JSON we write back can hold)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _check_unicode(value: Any) -> None:
    """Lone surrogates (\\ud800 escapes) would break the tokenizer and our UTF-8 output."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid("the request contains invalid Unicode (a lone surrogate)", None) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise invalid("the request body is empty; send a JSON object", None)
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise invalid(f"malformed JSON: {e}", None) from None
    _check_unicode(body)
    return body


async def _submit(request: Request, parsed: ParsedRequest, response_id: str, entered: float,
                  request_fields: dict[str, Any] | None = None) -> Generation:
    """A parsed request's prompts prepared and its engine requests submitted (the chat and
    completion endpoints', and the Responses API's as a chat request); `request_fields`: more
    of the engine requests' fields."""
    state = request.app.state
    config: ServerConfig = state.config
    engine, ready = state.holder.require_ready()
    template = config.chat_template or ready.chat_template
    if parsed.forces_call:
        parsed = _force_calls(parsed, config, template, engine.tokenizer)
    prompts = prepare(parsed, engine.tokenizer, ready.limits, template, render_chat)
    gen = Generation(engine, parsed, prompts, response_id, _reply_format(parsed, config, template, prompts),
                     request_fields)
    # taken before the submit: the engine's own TTFT clock starts as the request reaches it (in
    # its process or thread), and this handler may run on only later, so an end taken after
    # the submit would count that time twice
    await gen.compile_constraint()
    submitted = time.perf_counter()
    gen.submit_all()
    state.metrics.http_admit.observe(submitted - entered)
    return gen


async def _finished(request: Request, gen: Generation, work: Any, response_id: str) -> Any:
    """What a non-streamed request's `work` (a coroutine reading its generation) returns, or None
    where the client left first; its engine requests are cancelled either way."""
    try:
        is_done, result = await unless_disconnected(request.receive, work)
    finally:
        gen.cancel()
    if not is_done or result is None:
        log.info("client left before %s finished", response_id)
        return None
    return result


def _first_frame_timer(request: Request, entered: float) -> Callable[[], None]:
    metrics: Metrics = request.app.state.metrics
    return lambda: metrics.http_first_frame.observe(time.perf_counter() - entered)


async def _generate(request: Request, parse: Callable[[Any, int], ParsedRequest]) -> Response:
    entered = time.perf_counter()
    config: ServerConfig = request.app.state.config
    parsed = parse(await _json_body(request), config.max_choices)
    response_id = ("chatcmpl-" if parsed.is_chat else "cmpl-") + uuid.uuid4().hex
    gen = await _submit(request, parsed, response_id, entered)
    renderer_cls = ChatRenderer if parsed.is_chat else CompletionRenderer
    renderer = renderer_cls(
        response_id,
        int(time.time()),
        parsed.model or config.model_name,
        request.app.state.holder.engine.tokenizer.token_bytes,
        include_usage=parsed.include_usage,
        logprobs=parsed.logprobs is not None,
        echo_logprobs=parsed.logprobs if parsed.echo else None,
        prompt_logprobs=parsed.prompt_logprobs,
        token_ids=parsed.return_token_ids,
    )
    if parsed.stream:
        frames = sse_frames(gen, renderer, parsed.include_usage, on_first_token=_first_frame_timer(request, entered))
        return EventStreamResponse(frames, on_close=gen.cancel)  # type: ignore[return-value]
    results = await _finished(request, gen, collect(gen), response_id)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return json_response(renderer.response(results, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, served as a chat request (server/responses_api.py)."""
    entered = time.perf_counter()
    state = request.app.state
    config: ServerConfig = state.config
    store: responses_api.ResponseStore = state.responses
    wanted = responses_api.to_chat(await _json_body(request), store)
    response_id = responses_api.new_id("resp_")
    try:
        parsed = parse_chat(wanted.chat_body, 1)
        gen = await _submit(request, parsed, response_id, entered)
    except ApiError as e:  # named as the Responses request names the field
        raise responses_api.renamed(e) from None
    tokenizer = state.holder.engine.tokenizer
    builder = responses_api.ResponseBuilder(response_id, parsed.model or config.model_name, wanted,
                                            tokenizer.token_bytes, lambda text: len(tokenizer.encode(text, add_bos=False)))

    def keep(b: responses_api.ResponseBuilder) -> None:
        if b.request.store:
            store.put(b.response_id, b.stored())

    if parsed.stream:
        frames = responses_api.event_frames(gen, builder, keep, on_first_token=_first_frame_timer(request, entered))
        return EventStreamResponse(frames, on_close=gen.cancel)  # type: ignore[return-value]
    body = await _finished(request, gen, responses_api.whole(gen, builder), response_id)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    keep(builder)
    return json_response(body)


async def create_message(request: Request) -> Response:
    """Anthropic's Messages API, served as a chat request (server/messages_api.py); its errors in
    Anthropic's shape."""
    entered = time.perf_counter()
    state = request.app.state
    try:
        parsed = parse_chat(messages_api.to_chat(await _json_body(request)), 1)
        message_id = messages_api.message_id()
        gen = await _submit(request, parsed, message_id, entered)
    except ApiError as e:  # (in Anthropic's shape on this route: server.errors.error_response)
        raise messages_api.renamed(e) from None
    tokenizer = state.holder.engine.tokenizer
    builder = messages_api.MessageBuilder(message_id, parsed.model or state.config.model_name, parsed.stop,
                                          (*tokenizer.eog_ids, *parsed.stop_token_ids), lambda ids: tokenizer.decode(ids))
    if parsed.stream:
        frames = messages_api.event_frames(gen, builder, gen.prompt_tokens, on_first_token=_first_frame_timer(request, entered))
        return EventStreamResponse(frames, on_close=gen.cancel)  # type: ignore[return-value]
    body = await _finished(request, gen, messages_api.whole(gen, builder), message_id)
    return json_response(body) if body is not None else Response(status_code=CLIENT_CLOSED)


async def native_completion(request: Request) -> Response:
    """llama-server's native completion API (server/llama_api.py), served as a completion request."""
    entered = time.perf_counter()
    return await _native(request, await _json_body(request), entered)


async def infill(request: Request) -> Response:
    """llama-server's fill-in-the-middle (server/infill.py), served as `/completion` is."""
    entered = time.perf_counter()
    state = request.app.state
    engine, ready = state.holder.require_ready()
    # (off the event loop, as the embeddings' inputs: an editor's request carries other files too)
    body = await asyncio.to_thread(infill_api.to_completion_body, await _json_body(request), engine.tokenizer,
                                   ready.limits.max_context, state.config.spm_infill)
    return await _native(request, body, entered)


async def _native(request: Request, body: Any, entered: float) -> Response:
    state = request.app.state
    config: ServerConfig = state.config
    engine, ready = state.holder.require_ready()
    tokenizer = engine.tokenizer
    response_id = "cmpl-" + uuid.uuid4().hex
    native = None
    try:
        native = llama_api.to_completion(body, tokenizer.encode, bos_eos_text(tokenizer)[0],
                                         ready.limits.max_top_logprobs)
        parsed = parse_completion(native.body, config.max_choices)
        gen = await _submit(request, parsed, response_id, entered, native.request_fields)
    except ApiError as e:  # named as llama.cpp's fields name it
        raise (llama_api.renamed(e, native.names) if native is not None else e) from None
    builder = llama_api.NativeBuilder(parsed, native, parsed.model or config.model_name, tokenizer)
    if parsed.stream:
        frames = llama_api.event_frames(gen, builder, on_first_token=_first_frame_timer(request, entered))
        return EventStreamResponse(frames, on_close=gen.cancel)  # type: ignore[return-value]
    result = await _finished(request, gen, llama_api.whole(gen, builder), response_id)
    return json_response(result) if result is not None else Response(status_code=CLIENT_CLOSED)


async def count_message_tokens(request: Request) -> Response:
    """Anthropic's token count of a Messages request's prompt, as the chat template renders it."""
    state = request.app.state
    try:
        body = await _json_body(request)
        if isinstance(body, dict):
            body = {**body, "max_tokens": 1}  # (required by a request, not by its count)
        parsed = parse_chat(messages_api.to_chat(body), 1)
        engine, ready = state.holder.require_ready()
        template = state.config.chat_template or ready.chat_template
        n = count_prompt(parsed, engine.tokenizer, template, render_chat)
    except ApiError as e:
        raise messages_api.renamed(e) from None
    return json_response({"input_tokens": n})


def _stored_response(request: Request) -> tuple[str, responses_api.ResponseStore]:
    response_id = request.path_params["response_id"]
    store: responses_api.ResponseStore = request.app.state.responses
    if store.get(response_id) is None:
        raise ApiError(404, f"no stored response has the id {response_id!r}", param="response_id", code="not_found")
    return response_id, store


async def get_response(request: Request) -> Response:
    response_id, store = _stored_response(request)
    return json_response(store.get(response_id).response)  # type: ignore[union-attr]


async def delete_response(request: Request) -> Response:
    response_id, store = _stored_response(request)
    store.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _force_calls(parsed: ParsedRequest, config: ServerConfig, template: str | None, tokenizer: Any) -> ParsedRequest:
    """tool_choice "required" or a named function: the reply held to calls in the template's
    format (server/tool_calls.py's forced_grammar)."""
    parser = tool_calls.resolve(config.tool_call_parser, template)
    mistral_open = tool_calls.control_token(tokenizer, tool_calls.MISTRAL_OPEN) if parser == "mistral" else None
    try:
        grammar = tool_calls.forced_grammar(parser, parsed.template_kwargs["tools"], parsed.forced_function,
                                            parsed.parallel_tool_calls, mistral_open)
    except ValueError as e:
        raise invalid(str(e), "tool_choice") from None
    return dataclasses.replace(parsed, constraint=Constraint("lark", grammar, "tool_choice"))


def _reply_format(parsed: ParsedRequest, config: ServerConfig, template: str | None,
                  prompts: list[PreparedPrompt]) -> ReplyFormat:
    """How a chat request's replies are read for thoughts and tool calls (server/replies.py); a
    constrained reply is what its grammar allows, read for calls only where they were forced."""
    if not parsed.is_chat:
        return ReplyFormat()
    return ReplyFormat(
        thoughts=parsed.constraint is None and reasoning.resolve(
            parsed.reasoning_format or config.reasoning_format, template),
        opens_thought=prompts[0].opens_thought,
        tool_parser=tool_calls.resolve(config.tool_call_parser, template) if parsed.tool_calls else None,
        parallel_tool_calls=parsed.parallel_tool_calls,
    )


async def completions(request: Request) -> Response:
    def parse(body: Any, max_choices: int) -> ParsedRequest:  # a suffix: FIM prompts (server/infill.py)
        if isinstance(body, dict) and body.get("suffix"):
            engine, ready = request.app.state.holder.require_ready()
            body = infill_api.completion_with_suffix(body, engine.tokenizer, ready.limits.max_context,
                                                     request.app.state.config.spm_infill)
        return parse_completion(body, max_choices)

    return await _generate(request, parse)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, parse_chat)


async def embeddings(request: Request) -> Response:
    """OpenAI's embeddings (server/embeddings_api.py)."""
    entered = time.perf_counter()
    parsed = embeddings_api.parse(await _json_body(request))
    state = request.app.state
    engine, ready = state.holder.require_ready()
    info, limits = ready.info, ready.limits
    size = info.get("embedding_length")
    if parsed.dimensions is not None and size is not None and parsed.dimensions > size:
        raise invalid(f"'dimensions' must be at most the model's {size}", "dimensions")
    # (off the event loop: a batch of 2,048 texts, and its response, would stall every stream)
    tokens = await asyncio.to_thread(embeddings_api.tokens_of, parsed, engine.tokenizer, limits.max_context,
                                     limits.vocab_size)
    pooling = state.config.pooling if state.config.pooling != "auto" else info.get("pooling") or "last"
    response_id = "embd-" + uuid.uuid4().hex
    requests = [GenerationRequest(f"{response_id}-{i}", ids, 0, pooling=pooling) for i, ids in enumerate(tokens)]
    state.metrics.http_admit.observe(time.perf_counter() - entered)
    work = embeddings_api.embed(engine, requests, max(1, int(info.get("num_slots", 1))))
    is_done, pooled = await unless_disconnected(request.receive, work)
    if not is_done or pooled is None:
        log.info("client left before %s finished", response_id)
        return Response(status_code=CLIENT_CLOSED)
    body = await asyncio.to_thread(embeddings_api.respond, parsed, pooled, sum(map(len, tokens)),
                                   state.config.model_name, response_id)
    return Response(body, media_type="application/json")


async def health(request: Request) -> Response:
    state = request.app.state
    status, body = state.holder.health()
    if status == 200:
        body.update(_reply_parsers(state.config, state.config.chat_template or state.holder.ready.chat_template))
    return json_response(body, status=status)


def _reply_parsers(config: ServerConfig, template: str | None) -> dict[str, Any]:
    """How chat replies are read for tool calls and thoughts with the template served."""
    return {
        "tool_call_parser": tool_calls.resolve(config.tool_call_parser, template),
        "reasoning_format": "deepseek" if reasoning.resolve(config.reasoning_format, template) else "none",
    }


async def props(request: Request) -> Response:
    """llama-server's /props, which chat front ends (llama.cpp's web UI among them) read for the
    context size, the slots, the model and its chat template; 503 while the model loads."""
    state = request.app.state
    config: ServerConfig = state.config
    engine, ready = state.holder.require_ready()
    template = config.chat_template or ready.chat_template
    bos, eos = bos_eos_text(engine.tokenizer)
    defaults = parse_chat({"messages": [{"role": "user", "content": ""}]}, 1).sampling  # a request's defaults
    # n_predict -1: up to the context; repeat_last_n: /completion's window (the OpenAI endpoints
    # count their penalties as OpenAI does unless a request names one)
    params = {"n_predict": -1, **sampling_settings(defaults), "repeat_last_n": llama_api.REPEAT_LAST_N}
    return json_response({
        "default_generation_settings": {"n_ctx": ready.limits.max_context, "params": params},
        "total_slots": engine.stats().num_slots,
        "model_path": config.model_name,
        "chat_template": template or "",
        "bos_token": bos,
        "eos_token": eos,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"pallas-serve {_version()}",
        **_reply_parsers(config, template),
    })


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("pallas-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "source"


def _model_entry(state: Any) -> dict[str, Any]:
    ready = state.holder.ready
    return {
        "id": state.config.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "pallas-serve",
        "meta": ready.info if ready is not None else None,
    }


async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [_model_entry(request.app.state)]})


async def model(request: Request) -> Response:
    """OpenAI's model retrieval (`client.models.retrieve`): the model served, by its exact name."""
    name = request.path_params["model_id"]
    if name != request.app.state.config.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{request.app.state.config.model_name!r}", param="model", code="model_not_found")
    return json_response(_model_entry(request.app.state))


async def apply_template(request: Request) -> Response:
    """llama-server's /apply-template: a chat request's prompt as the chat template renders it
    (the same fields as /v1/chat/completions), without generating."""
    state = request.app.state
    parsed = parse_chat(await _json_body(request), state.config.max_choices)
    engine, ready = state.holder.require_ready()
    template = state.config.chat_template or ready.chat_template
    return json_response({"prompt": render_prompt(parsed, engine.tokenizer, template, render_chat)})


async def tokenize(request: Request) -> Response:
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    fields = Fields(body)
    name = "content" if "content" in body else "prompt"
    content = fields.string(name)
    if content is None:
        raise invalid("'content' (a string) is required", "content")
    add_special = fields.boolean("add_special", False)
    parse_special = fields.boolean("parse_special", True)
    with_pieces = fields.boolean("with_pieces", False)
    engine, _ = request.app.state.holder.require_ready()
    tokenizer = engine.tokenizer
    # add_special: the model's own BOS policy (None); otherwise never a BOS.
    try:
        tokens = tokenizer.encode(content, add_bos=None if add_special else False, parse_special=parse_special)
    except ValueError as e:  # e.g. a byte the vocabulary cannot represent
        raise invalid(f"cannot tokenize the content: {e}", name) from None
    if add_special and getattr(tokenizer, "add_eos", False):  # (llama.cpp's: the file's add_eos_token)
        tokens = [*tokens, tokenizer.eos_id]
    if with_pieces:
        return json_response({"tokens": [{"id": t, "piece": _piece(tokenizer.token_bytes(t))} for t in tokens]})
    return json_response({"tokens": list(tokens)})


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's with_pieces: the text, or the bytes when they are not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(request: Request) -> Response:
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("'tokens' must be an array of token ids", "tokens")
    engine, ready = request.app.state.holder.require_ready()
    if any(not 0 <= t < ready.limits.vocab_size for t in tokens):
        raise invalid(f"token ids must be in [0, {ready.limits.vocab_size})", "tokens")
    return json_response({"content": engine.tokenizer.decode(tokens, skip_special=False)})


async def metrics(request: Request) -> Response:
    payload, content_type = request.app.state.metrics.render()
    return Response(payload, headers={"Content-Type": content_type})


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    error = ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return error_response(error, request.url.path)


ROUTES = (
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/models/{model_id:path}", model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/completions", completions, methods=["POST"]),
    Route("/completion", native_completion, methods=["POST"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/responses/{response_id}", get_response, methods=["GET"]),
    Route("/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/embeddings", embeddings, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/props", props, methods=["GET"]),
    Route("/slots", slots_api.slots, methods=["GET"]),
    Route("/slots/{id_slot}", slots_api.slot_action, methods=["POST"]),
)


def create_app(
    config: ServerConfig,
    holder: EngineHolder | None = None,
    *,
    engine_factory: Callable[[], Engine] | None = None,
) -> Starlette:
    """`engine_factory`: called on a loader thread at startup; None when the caller attaches one."""
    holder = holder or EngineHolder()
    app_metrics = Metrics(holder.stats, holder.engine_gc)
    holder.add_timing_observer(app_metrics.observe)
    middleware = [
        Middleware(HttpMetricsMiddleware, metrics=app_metrics, routes=ROUTES),
        Middleware(ErrorBoundary),
        # Browser front ends call from another origin; the API key still guards the routes.
        Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]),
        Middleware(BodyLimit, max_bytes=config.max_body_bytes),
    ]
    if config.api_key is not None:
        middleware.append(Middleware(ApiKeyAuth, api_key=config.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if engine_factory is not None:
            loop = asyncio.get_running_loop()
            # Daemon: a load still running at exit must not keep the process alive.
            threading.Thread(
                target=_load_engine, args=(engine_factory, holder, loop), name="engine-loader", daemon=True
            ).start()
        yield
        engine = holder.engine
        if engine is not None:
            log.info("shutting the engine down")
            await asyncio.to_thread(engine.shutdown, config.engine_shutdown_timeout_s)

    app = Starlette(
        routes=list(ROUTES),
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.holder = holder
    app.state.metrics = app_metrics
    app.state.responses = responses_api.ResponseStore()
    app.state.started = int(time.time())
    return app
