"""llama-server's slot routes: `GET /slots` (each slot's state) and `POST /slots/{id}?action=`
save, restore or erase (an idle slot's cached prompt to a file in `--slot-save-path` and back:
scheduler/slot_files.py says what is kept and what a file holds).

A save or restore reads or writes the cache between the engine's steps and the file on a worker
thread, so other requests keep streaming meanwhile. Errors: 400 for a bad action, slot, filename
or file (saved from another model or setup), 404 for a file that does not exist, 409 for a busy
slot (not waited for, unlike llama-server, which defers the action), 501 without
`--slot-save-path` or where the model runner cannot read its cache (several processes), 503
while the engine is not ready, 500 where the file system refuses (permissions, a full disk).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from scheduler import slot_files
from scheduler.types import SLOT_PARAMS, EngineUnavailableError, RequestValidationError, SlotBusyError
from server.errors import SERVER_ERROR, ApiError, invalid, json_response
from server.generation import unavailable
from server.samplers import llama_params


async def slots(request: Request) -> Response:
    """llama-server's `GET /slots`: each slot, idle or with its request's progress and sampling
    settings (no prompt or output text), and `n_cached`, the prompt tokens it keeps for reuse (what
    a save writes); `?fail_on_no_slot=1`: a 503 when none is idle."""
    engine, ready = request.app.state.holder.require_ready()
    stats = engine.stats()
    busy = {info.slot: info for info in stats.slot_infos()}
    if "fail_on_no_slot" in request.query_params and len(busy) >= stats.num_slots:  # any value, as llama-server
        raise unavailable("no slot available")
    speculative = bool(ready.info.get("draft_max"))
    out = []
    for slot in range(stats.num_slots):
        entry: dict[str, Any] = {"id": slot, "n_ctx": ready.limits.max_context, "speculative": speculative,
                                 "is_processing": slot in busy,
                                 "n_cached": stats.cached[slot] if slot < len(stats.cached) else 0}
        info = busy.get(slot)
        if info is not None:
            params = llama_params(dict(zip(SLOT_PARAMS, info.params)))
            entry.update({
                # (not the request's id: a Responses API id in it would open the stored response)
                "id_task": info.task,
                "n_prompt_tokens": info.prompt_tokens,
                "n_prompt_tokens_processed": info.prompt_done - info.prompt_cached,
                "n_prompt_tokens_cache": info.prompt_cached,
                "params": {**params, "n_predict": info.limit},
                "next_token": [{"has_next_token": True, "n_remain": info.limit - info.generated,
                                "n_decoded": info.generated}],
            })
        out.append(entry)
    return json_response(out)


async def slot_action(request: Request) -> Response:
    """llama-server's `POST /slots/{id_slot}?action=save|restore|erase`, the first two with
    `{"filename": ...}`: a plain name in `--slot-save-path`."""
    directory = request.app.state.config.slot_save_path
    if directory is None:
        raise ApiError(501, "this server does not support slot actions: start it with --slot-save-path",
                       type="not_supported_error", code="not_supported")
    raw_slot, action = request.path_params["id_slot"], request.query_params.get("action")
    if not (raw_slot.isascii() and raw_slot.isdigit() and len(raw_slot) <= 9):
        raise invalid(f"invalid slot id {raw_slot!r}: want a slot number", "id_slot")
    try:
        slot_files.check_action(action)
        path = None
        if action != "erase":
            body = await request.json() if (await request.body()).strip() else {}
            name = body.get("filename") if isinstance(body, dict) else None
            path = os.path.join(directory, slot_files.check_filename(name))
    except RequestValidationError as e:
        raise invalid(str(e), e.field) from None
    except ValueError as e:  # the body is not JSON
        raise invalid(f"malformed JSON: {e}", None) from None
    engine, _ = request.app.state.holder.require_ready()
    try:
        return json_response(await asyncio.to_thread(engine.slot_action, action, int(raw_slot), path))
    except RequestValidationError as e:
        raise invalid(str(e), e.field) from None
    except FileNotFoundError as e:
        if action != "restore":
            raise ApiError(500, f"cannot write the slot file: {e}", type=SERVER_ERROR) from None
        raise ApiError(404, f"no slot file {os.path.basename(path or '')!r} in the slot save path", param="filename",
                       code="not_found") from None
    except SlotBusyError as e:
        raise ApiError(409, str(e), param="id_slot", code="slot_busy") from None
    except NotImplementedError as e:
        raise ApiError(501, str(e), type="not_supported_error", code="not_supported") from None
    except EngineUnavailableError as e:
        raise unavailable(str(e) or "the engine is not available") from None
    except OSError as e:  # the directory's permissions, a full disk: the server's to mend
        raise ApiError(500, f"the slot file could not be {'written' if action == 'save' else 'read'}: {e}",
                       type=SERVER_ERROR) from None
