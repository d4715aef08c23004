"""llama.cpp's samplers beyond OpenAI's fields, which every completion endpoint takes as
llama-server does (its chat and completion endpoints read them from the body too), and
llama-server's names for a request's sampling settings (`/props`, `/slots`, `/completion`'s
`generation_settings`)."""

from __future__ import annotations

import math
from typing import Any

from model.step_types import SamplingParams
from scheduler.types import SLOT_PARAMS
from server.errors import invalid


MAX_BREAKERS = 32  # DRY's sequence breakers a request may name
MAX_BREAKER_CHARS = 64
# the fields below, by name (the other APIs pass them on to the chat parser)
FIELDS = ("repeat_last_n", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
          "dynatemp_exponent", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
          "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta")
# upper bounds that keep every value finite in float32 arithmetic, far past any useful setting
_MOST = 1e4
_MOST_LENGTH = 2**30


def parse_llama_samplers(fields: Any) -> dict[str, Any]:
    """`SamplingParams`' llama.cpp samplers from a request's `fields` (server.openai_api.Fields),
    each off by default; a value out of range is a 400 naming the field."""
    breakers = fields.raw("dry_sequence_breakers")
    if breakers is None:
        breakers = SamplingParams.dry_sequence_breakers
    elif not (isinstance(breakers, list) and len(breakers) <= MAX_BREAKERS and all(
            isinstance(b, str) and 0 < len(b) <= MAX_BREAKER_CHARS for b in breakers)):
        raise invalid(f"'dry_sequence_breakers' must be an array of at most {MAX_BREAKERS} non-empty strings of at "
                      f"most {MAX_BREAKER_CHARS} characters", fields.prefix + "dry_sequence_breakers")
    return dict(
        # llama.cpp's window for the three penalties (absent: OpenAI's and vLLM's counts)
        penalty_last_n=fields.integer("repeat_last_n", None, -1, _MOST_LENGTH),
        dry_multiplier=fields.number("dry_multiplier", 0.0, 0.0, _MOST),
        dry_base=fields.number("dry_base", 1.75, 1.0, _MOST),
        dry_allowed_length=fields.integer("dry_allowed_length", 2, 0, _MOST_LENGTH),
        dry_penalty_last_n=fields.integer("dry_penalty_last_n", -1, -1),  # -1: the whole context
        dry_sequence_breakers=tuple(breakers),
        mirostat=fields.integer("mirostat", 0, 0, 2),
        mirostat_tau=fields.number("mirostat_tau", 5.0, 0.0, _MOST),
        mirostat_eta=fields.number("mirostat_eta", 0.1, 0.0, _MOST),
        typical_p=fields.number("typical_p", 1.0, 0.0, 1.0, lo_open=True),
        top_n_sigma=fields.number("top_n_sigma", 0.0, -math.inf, _MOST),  # <= 0: off (llama.cpp's -1)
        xtc_probability=fields.number("xtc_probability", 0.0, 0.0, 1.0),
        xtc_threshold=fields.number("xtc_threshold", 0.1, 0.0, 1.0),  # > 0.5: off
        dynatemp_range=fields.number("dynatemp_range", 0.0, 0.0, _MOST),
        dynatemp_exponent=fields.number("dynatemp_exponent", 1.0, 0.0, _MOST),
    )


def llama_params(values: dict[str, Any]) -> dict[str, Any]:
    """SLOT_PARAMS' values by llama-server's names (`repeat_penalty`; seed -1: random)."""
    out = dict(values)
    out["repeat_penalty"] = out.pop("repetition_penalty")
    out["repeat_last_n"] = out.pop("penalty_last_n")
    out["seed"] = -1 if out["seed"] is None else out["seed"]
    out["dry_sequence_breakers"] = list(out["dry_sequence_breakers"])
    return out


def sampling_settings(sampling: SamplingParams) -> dict[str, Any]:
    """A request's sampling settings by llama-server's names."""
    return llama_params({name: getattr(sampling, name) for name in SLOT_PARAMS})
