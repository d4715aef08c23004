"""Slot files: llama-server's slot actions (`POST /slots/{id}?action=save|restore|erase`, with
`--slot-save-path`) over the engine's prompt cache.

What a slot holds between requests is its prompt cache entry (scheduler/prompt_cache.py): the
tokens of the whole prompt chunks prefilled there, from position 0, and their keys and values in
the KV cache. "save" writes them to a file; "restore" writes a file's back into an idle slot, so
that a later request whose prompt starts with those tokens reuses them (it is placed there, or
copied from there, as for any cached prefix); "erase" makes the slot forget them. A busy slot is
refused (`SlotBusyError`), not waited for. As with the prompt cache, only whole chunks are kept,
so a restored prefix holds what a cold prefill at the same chunk size would write there.

The caller's thread (a server worker thread, or the engine process's command thread) does the
file's reading and writing; the engine thread only reads or writes the cache between steps
(`Engine.slot_action`, its `_slot_command`; the runner's side is model/slot_snapshot.py).

A file is numpy's .npz (uncompressed, no pickles): `meta` (JSON as bytes: the format, the layout
it was saved from, the request's `cache_salt`), `tokens` [n] int32 and `keys`, `values` [L, n, K, D]
in the cache's dtype, stored as unsigned integers of its width (numpy's format has no bfloat16;
the runner takes them back as such).
A file restores only into an engine of the same layout: the model (its name and shape), the
cache's dtype and the largest prompt chunk. It is written beside its final name and renamed, so a
reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import zipfile
from typing import Any, Callable

import numpy as np

from scheduler.types import RequestValidationError

ACTIONS = ("save", "restore", "erase")
FORMAT = "pallas-serve slot file 1"
_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")

# ask(action, slot, data) -> the engine thread's result (Engine._ask_slot)
Ask = Callable[[str, int, Any], Any]
# stage(tokens, keys, values) -> what the engine thread writes (the runner's `stage_slot`)
Stage = Callable[[np.ndarray, np.ndarray, np.ndarray], Any]


def check_filename(name: Any) -> str:
    """A slot file's name as a request gives it: a plain file name in the save directory."""
    if not isinstance(name, str) or not _FILENAME.fullmatch(name):
        raise RequestValidationError(
            f"invalid filename {name!r}: want 1 to 200 letters, digits, '.', '_' or '-', not starting with '.' "
            "or '-' (a name in the server's --slot-save-path)", field="filename")
    return name


def check_action(action: Any) -> str:
    if action not in ACTIONS:
        raise RequestValidationError(f"unknown slot action {action!r}: want one of {', '.join(ACTIONS)}",
                                     field="action")
    return action


def perform(action: str, slot: int, path: str | None, layout: dict[str, Any], max_context: int, ask: Ask,
            stage: Stage | None = None) -> dict:
    """One slot action, as llama-server answers it; `layout`: the engine's (`write`)."""
    check_action(action)
    if action == "erase":
        return {"id_slot": slot, "n_erased": ask("erase", slot, None)}
    if path is None:
        raise RequestValidationError(f"a slot {action} needs a filename", field="filename")
    started = time.perf_counter()
    name = os.path.basename(path)
    if action == "save":
        tokens, salt, rows = ask("save", slot, None)
        num = len(tokens)
        shape = (layout["num_layers"], num, layout["num_kv_heads"], layout["head_dim"])
        keys, values = ((_to_host(rows[0], num), _to_host(rows[1], num)) if rows is not None else
                        (np.zeros(shape, np.dtype(f"u{_width(layout)}")),) * 2)
        del rows  # (the device's copy: not held while the file is written)
        written = write(path, layout, tokens, salt, keys, values)
        return {"id_slot": slot, "filename": name, "n_saved": num, "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - started) * 1e3}}
    tokens, salt, keys, values, read = load(path, layout, max_context)
    staged = stage(tokens, keys, values) if stage is not None and len(tokens) else (tokens, keys, values)
    del keys, values
    num = ask("restore", slot, (tokens, salt, staged))
    return {"id_slot": slot, "filename": name, "n_restored": num, "n_read": read,
            "timings": {"restore_ms": (time.perf_counter() - started) * 1e3}}


def _to_host(layers: tuple, num: int) -> np.ndarray:
    """Per-layer device arrays [span, K, D] -> [L, num, K, D] on the host, copied a layer at a time
    (the engine thread, in this process, runs between the copies) into one array (no second
    host copy of the whole slot)."""
    first = np.asarray(layers[0])
    out = np.empty((len(layers), num, *first.shape[1:]), first.dtype)
    out[0] = first[:num]
    for i in range(1, len(layers)):
        out[i] = np.asarray(layers[i])[:num]
    return out


def _width(layout: dict[str, Any]) -> int:
    return int(layout["kv_itemsize"])


def write(path: str, layout: dict[str, Any], tokens: np.ndarray, salt: str, keys: np.ndarray,
          values: np.ndarray) -> int:
    """Writes a slot file; returns its size in bytes."""
    meta = json.dumps({"format": FORMAT, "layout": layout, "cache_salt": salt}).encode()
    as_int = np.dtype(f"u{_width(layout)}")
    # one of its own per save (two saves to a name may race), never a valid name (a leading dot)
    handle, temp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".slot-", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as f:
            np.savez(f, meta=np.frombuffer(meta, np.uint8), tokens=np.asarray(tokens, np.int32),
                     keys=keys.view(as_int), values=values.view(as_int))
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return os.path.getsize(path)


def load(path: str, layout: dict[str, Any], max_context: int) -> tuple[np.ndarray, str, np.ndarray, np.ndarray, int]:
    """(tokens, cache_salt, keys, values, the file's size) of a slot file saved from an engine of
    this `layout`; RequestValidationError for anything else. FileNotFoundError where none is."""
    name = os.path.basename(path)
    with open(path, "rb") as f:  # (OSError as it comes: a missing file, the directory's permissions)
        size = os.fstat(f.fileno()).st_size
        try:
            with np.load(f, allow_pickle=False) as npz:
                meta = json.loads(bytes(npz["meta"]).decode())
                tokens, keys, values = npz["tokens"], npz["keys"], npz["values"]
        except (ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
            raise RequestValidationError(f"{name} is not a slot file ({type(e).__name__}: {e})",
                                         field="filename") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RequestValidationError(f"{name} is not a slot file of this server's format ({FORMAT!r})",
                                     field="filename")
    saved = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
    differ = [f"{key} {saved.get(key)!r} (here {layout[key]!r})" for key in layout if saved.get(key) != layout[key]]
    if differ:
        raise RequestValidationError(f"{name} was saved from another model or engine setup: {'; '.join(differ)}",
                                     field="filename")
    num = tokens.shape[0] if tokens.ndim == 1 else -1
    shape = (layout["num_layers"], num, layout["num_kv_heads"], layout["head_dim"])
    as_int = np.dtype(f"u{_width(layout)}")
    if (tokens.dtype != np.int32 or num < 0 or keys.shape != shape or values.shape != shape
            or keys.dtype != as_int or values.dtype != as_int):
        raise RequestValidationError(f"{name}: its arrays do not have the shapes its layout gives", field="filename")
    if num % layout["prefill_chunk"] or num >= max_context or (num and not 0 <= tokens.min() <= tokens.max() <
                                                                 layout["vocab_size"]):
        raise RequestValidationError(f"{name}: {num} tokens, not whole chunks of {layout['prefill_chunk']} "
                                     f"below the context of {max_context} in the vocabulary", field="filename")
    salt = meta.get("cache_salt", "")
    return tokens, salt if isinstance(salt, str) else "", keys, values, size
