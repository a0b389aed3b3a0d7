"""Grammars for structured output: a JSON schema (or any JSON object) as Lark text for the grammar backend, and
the checks that name what is wrong with a schema before anything is compiled."""

from __future__ import annotations

import json

import jsonschema

from hybrid.structured_output.backend import GrammarError

# One canonical layout (", " and ": ", no free whitespace): a model cannot wander into endless whitespace, and
# outputs compare as text.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_schema(schema: object, where: str) -> dict:
    """Returns the schema when it is a valid JSON schema object; raises GrammarError naming the problem."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise GrammarError(f"{where}{path} is not a valid JSON schema: {e.message}") from None
    return schema


def json_value(schema: dict) -> str:
    """The Lark fragment that matches one JSON value valid against `schema`, in the canonical layout."""
    styled = {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(styled, ensure_ascii=False)


def json_schema_grammar(schema: dict) -> str:
    return f"start: {json_value(schema)}"


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def object_schema(parameters: dict | None) -> dict:
    """A function's parameters as the schema of its arguments object (no parameters: an empty object)."""
    return parameters if parameters else {"type": "object", "properties": {}, "additionalProperties": False}

