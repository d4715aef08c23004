"""POST /v1/embeddings: OpenAI's embeddings API over the served model, as llama-server's
`--embeddings` and vLLM's pooling runner give it.

Each input is one engine request with `pooling` set and max_tokens 0: its prompt is prefilled
whole in scored chunks, whose programs also pool the last layer's normed hidden states (the rows
the output head reads; model/runner.py), and its one event carries the mean over the prompt's tokens or
the last token's (`--pooling`; the GGUF's `{arch}.pooling_type` where it names one, else last,
vLLM's default for a decoder). Here the vector is cut to `dimensions` and normalized
(`embd_normalize`, llama-server's: Euclidean by default) and rendered as floats or base64.

A request may carry many inputs (OpenAI takes 2,048; LangChain sends up to 1,000 at once): at
most as many as the engine has slots are in the engine at a time, the next submitted as one
ends, so a large batch neither fills the waiting queue (the others' 429s) nor is refused for
its size. A full queue at the first input is the request's 429; later, the batch waits for its
own inputs to make room, or up to QUEUE_WAIT_S for the others' where none of its own is left.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from typing import Any

import numpy as np

from scheduler.types import EngineUnavailableError, GenerationRequest, QueueFullError, RequestValidationError, StreamEvent
from server.errors import SERVER_ERROR, ApiError, invalid, json_bytes
from server.generation import engine_finish_error, rate_limited, unavailable
from server.openai_api import Fields, parse_prompts

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
QUEUE_WAIT_S = 30.0  # how long a batch waits for the others' requests to leave room in the queue
POLL_S = 0.05
ENCODINGS = ("float", "base64")
MAX_P_NORM = 64  # embd_normalize's largest p-norm (a larger one overflows: use 0, the max-abs scaling)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[str | tuple[int, ...], ...]
    model: str | None
    encoding_format: str  # one of ENCODINGS
    dimensions: int | None  # the first this many of the vector's values, then normalized
    norm: int  # llama-server's embd_normalize: -1 none, 0 max-abs to int16's range, 1 taxicab, 2 Euclidean, p > 2
    add_special: bool  # vLLM's add_special_tokens: the model's BOS (and EOS where its file asks) around text inputs
    truncate: int | None  # vLLM's truncate_prompt_tokens: keep the last this many tokens; -1 the context's most


def parse(body: Any) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    fields = Fields(body)
    inputs = parse_prompts(fields.raw("input"), "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"'input' has {len(inputs)} items; at most {MAX_INPUTS} per request", "input")
    encoding = fields.string("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise invalid(f"'encoding_format' must be one of {', '.join(ENCODINGS)}", "encoding_format")
    norm = fields.integer("embd_normalize", 2, lo=-1, hi=MAX_P_NORM)
    if not fields.boolean("normalize", True):  # vLLM's
        norm = -1
    truncate = fields.integer("truncate_prompt_tokens", None, lo=-1)
    if truncate == 0:
        raise invalid("'truncate_prompt_tokens' must be -1 (the context) or at least 1", "truncate_prompt_tokens")
    return EmbeddingRequest(
        inputs=inputs,
        model=fields.string("model"),
        encoding_format=encoding,
        dimensions=fields.integer("dimensions", None, lo=1),
        norm=norm,
        add_special=fields.boolean("add_special_tokens", True),
        truncate=truncate,
    )


def tokens_of(parsed: EmbeddingRequest, tokenizer: Any, max_context: int, vocab_size: int) -> list[tuple[int, ...]]:
    """Each input's tokens: text with the model's special tokens as llama.cpp adds them (BOS by
    the file's policy; EOS where it says add_eos_token, unless the text already ends in it), token
    ids as given; `truncate_prompt_tokens` keeps the last tokens of the text, its special tokens
    counted in (vLLM's); no longer than the context less one position."""
    most = max_context - 1  # (as any prompt: a position is left for the token its prefill samples)
    keep = None if parsed.truncate is None else min(most if parsed.truncate == -1 else parsed.truncate, most)
    eos = tokenizer.eos_id if parsed.add_special and getattr(tokenizer, "add_eos", False) else None
    bos = tokenizer.encode("", add_bos=None) if parsed.add_special else []  # the file's BOS policy
    out = []
    for i, item in enumerate(parsed.inputs):
        name = "input" if len(parsed.inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid("the input is an empty string", name)
            try:
                body = tokenizer.encode(item, add_bos=False, parse_special=True)
            except ValueError as e:
                raise invalid(f"cannot tokenize the input: {e}", name) from None
            tail = [eos] if eos is not None and body[-1:] != [eos] else []
            if keep is not None:
                body = body[max(0, len(body) - max(0, keep - len(bos) - len(tail))):]
            ids = [*bos, *body, *tail][-keep:] if keep is not None else [*bos, *body, *tail]
        else:
            ids = list(item)
            if max(ids) >= vocab_size:
                raise invalid(f"token ids must be in [0, {vocab_size})", name)
            if keep is not None:
                ids = ids[-keep:]
        if not ids:
            raise invalid("the input is empty (no tokens)", name)
        if len(ids) > most:
            raise invalid(f"the input has {len(ids)} tokens; this server embeds at most {most} "
                          "(truncate_prompt_tokens cuts it)", name)
        out.append(tuple(ids))
    return out


def finish(vector: np.ndarray, dimensions: int | None, norm: int) -> np.ndarray:
    """The pooled vector cut to `dimensions` and normalized as llama.cpp's
    common_embd_normalize does (`norm`: -1 none, 0 max-abs scaled to 32,760, 1 taxicab, 2
    Euclidean, p > 2 the p-norm)."""
    v = np.asarray(vector, np.float64)[:dimensions]
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = np.abs(v).max(initial=0.0) / 32760.0
    elif norm == 2:
        total = float(np.sqrt(np.sum(v * v)))
    else:
        total = float(np.sum(np.abs(v) ** norm) ** (1.0 / norm))
    return (v / total if total > 0 else v * 0.0).astype(np.float32)


def respond(parsed: EmbeddingRequest, pooled: list[np.ndarray], prompt_tokens: int, model: str,
            response_id: str) -> bytes:
    """The response body: each vector finished (`finish`) and rendered (`render`), as JSON bytes;
    meant for a worker thread (2,048 vectors of 4,096 floats are about 160 MB of JSON)."""
    vectors = [finish(v, parsed.dimensions, parsed.norm) for v in pooled]
    return json_bytes(render(parsed, vectors, prompt_tokens, model, response_id))


def render(parsed: EmbeddingRequest, vectors: list[np.ndarray], prompt_tokens: int, model: str,
           response_id: str) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        value: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode() if parsed.encoding_format == "base64"
                      else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": parsed.model or model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


async def _final(stream: Any) -> StreamEvent:
    async for event in stream:
        if event.finish_reason is not None:
            return event
    raise RuntimeError(f"request {stream.request_id} ended without a finish_reason")


async def embed(engine: Any, requests: list[GenerationRequest], window: int) -> list[np.ndarray]:
    """The pooled vector of each request, at most `window` of them in the engine at a time;
    whatever is still running when this ends (an error, the client gone) is cancelled."""
    out: list[np.ndarray | None] = [None] * len(requests)
    running: dict[asyncio.Task, tuple[int, Any]] = {}
    nxt, waited_since = 0, None
    try:
        while nxt < len(requests) or running:
            while nxt < len(requests) and len(running) < window:
                try:
                    stream = engine.submit(requests[nxt])
                except QueueFullError as e:
                    if nxt == 0 or (not running and waited_since is not None
                                    and time.monotonic() - waited_since > QUEUE_WAIT_S):
                        raise rate_limited(e) from None
                    waited_since = waited_since or time.monotonic()
                    break
                except RequestValidationError as e:
                    name = "input" if len(requests) == 1 else f"input[{nxt}]"
                    raise invalid(str(e), name if e.field == "prompt" else e.field) from None
                except EngineUnavailableError as e:
                    raise unavailable(str(e) or "the engine is not available") from None
                waited_since = None
                running[asyncio.ensure_future(_final(stream))] = (nxt, stream)
                nxt += 1
            if not running:  # the queue is full of the others' requests: wait for room
                await asyncio.sleep(POLL_S)
                continue
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            waited_since = None  # room of its own: the wait for the others' starts over
            for task in done:
                i, _ = running.pop(task)
                event = task.result()
                error = engine_finish_error(engine, event)
                if error is not None:
                    raise error
                if event.embedding is None or not np.isfinite(event.embedding).all():
                    what = "no embedding" if event.embedding is None else "an embedding with NaN or infinite values"
                    raise ApiError(500, f"the engine returned {what}", type=SERVER_ERROR, code="engine_error")
                out[i] = event.embedding
    finally:
        for task, (_, stream) in running.items():
            task.cancel()
            stream.cancel()
    return [v for v in out if v is not None]

