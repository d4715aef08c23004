"""llama.cpp's samplers beyond OpenAI's fields, which every completion endpoint takes as
llama-server does (its chat and completion endpoints read them from the body too), and
llama-server's names for a request's sampling settings (`/props`, `/slots`, `/completion`'s
`generation_settings`)."""

from __future__ import annotations

import math
from typing import Any

from model.step_types import SamplingParams
from scheduler.types import SLOT_PARAMS


def parse_llama_samplers(fields: Any) -> dict[str, float]:
    """`SamplingParams`' llama.cpp samplers from a request's `fields` (server.openai_api.Fields),
    each off by default; a value out of range is a 400 naming the field."""
    return dict(
        typical_p=fields.number("typical_p", 1.0, 0.0, 1.0, lo_open=True),
        top_n_sigma=fields.number("top_n_sigma", 0.0, -math.inf, math.inf),  # <= 0: off (llama.cpp's -1)
        xtc_probability=fields.number("xtc_probability", 0.0, 0.0, 1.0),
        xtc_threshold=fields.number("xtc_threshold", 0.1, 0.0, 1.0),  # > 0.5: off
        dynatemp_range=fields.number("dynatemp_range", 0.0, 0.0, math.inf),
        dynatemp_exponent=fields.number("dynatemp_exponent", 1.0, 0.0, math.inf),
    )


def llama_params(values: dict[str, Any]) -> dict[str, Any]:
    """SLOT_PARAMS' values by llama-server's names (`repeat_penalty`; seed -1: random)."""
    out = dict(values)
    out["repeat_penalty"] = out.pop("repetition_penalty")
    out["seed"] = -1 if out["seed"] is None else out["seed"]
    return out


def sampling_settings(sampling: SamplingParams) -> dict[str, Any]:
    """A request's sampling settings by llama-server's names."""
    return llama_params({name: getattr(sampling, name) for name in SLOT_PARAMS})
