"""A request's constrained decoding (scheduler/grammar.py): the one constraint its fields give,
from OpenAI's, llama-server's and vLLM's spellings (`parse_constraint`), or a 400 naming the
field."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from scheduler.types import Constraint
from server.errors import invalid

if TYPE_CHECKING:
    from server.openai_api import Fields


# vLLM's structured_outputs keys (and its older guided_* fields) -> our constraint kinds
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf"}


def parse_constraint(fields: Fields) -> Constraint | None:
    """Constrained decoding (scheduler/grammar.py), from whichever one of these the request
    gives: OpenAI's `response_format` ({"type": "json_object"}, or "json_schema" with
    `json_schema.schema`; "text" is no constraint), llama-server's `json_schema` (a schema) and
    `grammar` (GBNF), vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar": ...},
    or {"json_object": true}) and its older `guided_json`, `guided_regex`, `guided_choice`,
    `guided_grammar`. vLLM's whitespace options (`structured_outputs.disable_any_whitespace`,
    `structured_outputs.whitespace_pattern`, `guided_whitespace_pattern`) apply to a JSON schema
    from any of these (`_with_whitespace`); its other options are ignored."""
    found = []
    fmt = fields.raw("response_format")
    if fmt is not None:
        found.append(_response_format(fmt))
    if fields.raw("json_schema") is not None:
        found.append(_schema_constraint(fields.raw("json_schema"), "json_schema"))
    grammar = fields.string("grammar")
    if grammar:  # llama-server sends "" for none
        found.append(Constraint("gbnf", grammar, "grammar"))
    outputs = fields.raw("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise invalid("'structured_outputs' must be an object", "structured_outputs")
        if outputs.get("structural_tag") is not None:
            raise invalid("'structured_outputs.structural_tag' is not supported", "structured_outputs.structural_tag")
        given = [key for key in (*_VLLM_KINDS, "json_object") if outputs.get(key) not in (None, False)]
        if len(given) > 1:
            raise invalid(f"'structured_outputs' gives {given}: at most one of them", "structured_outputs")
        if given == ["json_object"]:  # any JSON object
            found.append(_schema_constraint({"type": "object"}, "structured_outputs.json_object"))
        else:
            found += [_vllm_constraint(key, outputs[key], f"structured_outputs.{key}") for key in given]
    for key in _VLLM_KINDS:
        if fields.raw(f"guided_{key}") is not None:
            found.append(_vllm_constraint(key, fields.raw(f"guided_{key}"), f"guided_{key}"))
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise invalid(f"the request constrains its output twice ({', '.join(c.field for c in found)}): give one",
                      found[1].field)
    whitespace = _whitespace_options(fields, outputs if isinstance(outputs, dict) else {})
    if found and whitespace and found[0].kind == "json_schema":
        return _with_whitespace(found[0], whitespace)
    return found[0] if found else None


def _whitespace_options(fields: Fields, outputs: dict) -> dict[str, Any]:
    """vLLM's whitespace options as llguidance's JSON options: `disable_any_whitespace` (none
    between a JSON value's tokens), or a `whitespace_pattern` regex (from `structured_outputs`
    or the older `guided_whitespace_pattern`); {} where none is given."""
    pattern, field = outputs.get("whitespace_pattern"), "structured_outputs.whitespace_pattern"
    if pattern is None:
        pattern, field = fields.raw("guided_whitespace_pattern"), "guided_whitespace_pattern"
    disable = outputs.get("disable_any_whitespace")
    if disable is not None and not isinstance(disable, bool):
        raise invalid("'structured_outputs.disable_any_whitespace' must be a boolean",
                      "structured_outputs.disable_any_whitespace")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise invalid(f"'{field}' must be a non-empty string (a regular expression)", field)
    if disable and pattern is not None:
        raise invalid(f"'structured_outputs.disable_any_whitespace' and '{field}' disagree: give one", field)
    if disable:
        return {"whitespace_flexible": False, "whitespace_pattern": None}
    return {} if pattern is None else {"whitespace_pattern": pattern}


def _with_whitespace(constraint: Constraint, options: dict[str, Any]) -> Constraint:
    """The schema with llguidance's options in its `x-guidance` (which takes precedence over the
    engine's default whitespace, scheduler/grammar.py)."""
    schema = json.loads(constraint.source)
    if schema is False:
        return constraint  # allows nothing: no whitespace to shape
    schema = {} if schema is True else schema
    own = schema.get("x-guidance") or {}
    if not isinstance(own, dict):
        raise invalid(f"'{constraint.field}' has an 'x-guidance' that is not an object", constraint.field)
    schema = {**schema, "x-guidance": {**own, **options}}
    return dataclasses.replace(constraint, source=json.dumps(schema, ensure_ascii=False))


def _response_format(fmt: Any) -> Constraint | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid("'response_format' must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":  # any JSON object; llama-server also takes a "schema" here
        schema = fmt.get("schema")
        return _schema_constraint({"type": "object"} if schema is None else schema, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format 'json_schema' needs a 'json_schema' object", "response_format.json_schema")
        schema = spec.get("schema")
        # OpenAI makes the schema optional: none is any JSON value
        return _schema_constraint({} if schema is None else schema, "response_format.json_schema.schema")
    raise invalid(f"response_format type {kind!r} is not one of \"text\", \"json_object\", \"json_schema\"",
                  "response_format.type")


def _schema_constraint(schema: Any, field: str) -> Constraint:
    """A JSON schema given as an object (or true/false), or as its JSON text (vLLM allows it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"'{field}' is not valid JSON: {exc}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"'{field}' must be a JSON schema (an object)", field)
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), field)


def _vllm_constraint(key: str, value: Any, field: str) -> Constraint:
    if key == "json":
        return _schema_constraint(value, field)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(f"'{field}' must be a non-empty array of strings", field)
        return Constraint("choice", json.dumps(value, ensure_ascii=False), field)
    if not isinstance(value, str) or not value:
        raise invalid(f"'{field}' must be a non-empty string", field)
    return Constraint(_VLLM_KINDS[key], value, field)
