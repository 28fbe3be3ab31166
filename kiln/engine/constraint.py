"""A request's structured_outputs in the one form the grammar cache keys on, checked for what xgrammar
would accept but not enforce."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.sampling_params import StructuredOutputsParams

# Keywords xgrammar accepts but does not enforce: a schema using them would be obeyed only in part.
_UNENFORCED = {
    "number": ("multipleOf",),
    "integer": ("multipleOf",),
    "array": ("uniqueItems", "contains", "minContains", "maxContains"),
    "object": ("propertyNames", "dependentRequired", "dependentSchemas"),
}
_STRING_FORMATS = {
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}  # fmt: skip


@dataclass(slots=True, frozen=True)
class Constraint:
    """A constraint in the one form the cache keys on: its kind and its text (a schema as canonical JSON,
    a choice as the EBNF grammar it becomes)."""

    kind: str  # "json", "regex", "grammar" or "structural_tag"
    text: str
    any_whitespace: bool = True

    @classmethod
    def of(cls, params: StructuredOutputsParams, compact: bool = False) -> Constraint:
        """compact: JSON without whitespace whatever the params say (the server's setting)."""
        ws = not (params.disable_any_whitespace or compact)
        if params.json_object:
            return cls("json", '{"type": "object"}', ws)
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            _check_enforceable(schema)
            return cls("json", json.dumps(schema, ensure_ascii=False), ws)
        if params.regex is not None:
            if "\x00" in params.regex:
                raise ValueError("structured_outputs.regex must not contain a NUL character")
            return cls("regex", params.regex)
        if params.choice is not None:
            if not params.choice or not all(params.choice):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return cls("grammar", f"root ::= {alternatives}")
        if params.structural_tag is not None:
            try:
                tag = json.loads(params.structural_tag)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
            if not isinstance(tag, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object")
            return cls("structural_tag", json.dumps(tag, ensure_ascii=False, sort_keys=True))
        assert params.grammar is not None
        return cls("grammar", params.grammar)


def _check_enforceable(schema: Any, where: str = "#") -> None:
    """A 400 for what the grammar would silently leave out, rather than output that breaks the schema."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_enforceable(item, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    for kind in types & _UNENFORCED.keys():
        for key in _UNENFORCED[kind]:
            if key in schema:
                raise ValueError(f"JSON schema keyword {key!r} at {where} is not supported")
    fmt = schema.get("format")
    if "string" in types and fmt is not None and fmt not in _STRING_FORMATS:
        raise ValueError(f"JSON schema string format {fmt!r} at {where} is not supported")
    if "string" in types and ("pattern" in schema or fmt) and ({"minLength", "maxLength"} & schema.keys()):
        raise ValueError(f"JSON schema at {where}: a string with both a pattern/format and a length bound")
    for key, value in schema.items():
        if isinstance(value, dict | list) and key not in ("enum", "const", "default", "examples"):
            _check_enforceable(value, f"{where}/{key}")
