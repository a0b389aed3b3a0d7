"""Grammars for structured output as Lark text for the grammar backend: a JSON schema (or any JSON object), a
regular expression, a choice of strings, a grammar given as Lark or GBNF; and the checks that name what is wrong
with a schema before anything is compiled."""

from __future__ import annotations

import json

import jsonschema

from hybrid.structured_output.backend import GrammarError

# One canonical layout (", " and ": ", no free whitespace): a model cannot wander into endless whitespace, and
# outputs compare as text.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on a schema from a request, checked while the request is parsed, before jsonschema walks it
# (recursively): deeper nesting would overflow Python's stack, and checking takes time in proportion to the size.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_BYTES = 256 * 1024
MAX_GRAMMAR_CHARS = 256 * 1024  # a regex, a grammar's text, or a choice's strings together


def _check_bounds(schema: dict, where: str) -> None:
    """Refuses a schema nested deeper than MAX_SCHEMA_DEPTH containers or larger than MAX_SCHEMA_BYTES as JSON;
    iterative, so any depth is measured without recursion."""
    stack, size = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        size += 2 + (sum(len(str(k)) + 4 for k in value) if isinstance(value, dict) else 0)
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            else:  # about its length as JSON, with its separator
                size += len(child) + 4 if isinstance(child, str) else len(str(child)) + 2
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"{where} is larger than {MAX_SCHEMA_BYTES // 1024} KiB")


def check_schema_shape(schema: object, where: str) -> dict:
    """Returns the schema when it is an object within the bounds, with grammar options (x-guidance) that are an
    object; raises GrammarError naming the problem. Cheap: the api runs it while parsing a request."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    _check_bounds(schema, where)
    if not isinstance(schema.get("x-guidance", {}), dict):
        raise GrammarError(f"{where}['x-guidance'] must be an object of grammar options")
    if not isinstance(schema.get("$schema", ""), str):
        raise GrammarError(f"{where}['$schema'] must be the URI of a JSON Schema draft")
    return schema


def check_schema(schema: object, where: str) -> dict:
    """check_schema_shape, then that the schema is a valid JSON schema (jsonschema's meta-schema check: a large
    schema takes a good part of a second, so the api runs it on a worker thread)."""
    check_schema_shape(schema, where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise GrammarError(f"{where}{path} is not a valid JSON schema: {e.message}") from None
    except Exception as e:  # jsonschema's own failure on an odd schema is still the schema's fault
        raise GrammarError(f"{where} cannot be checked as a JSON schema: {type(e).__name__}: {e}") from None
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


def _check_length(text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"longer than {MAX_GRAMMAR_CHARS // 1024} K characters")


def regex_grammar(pattern: str) -> str:
    """The whole output matches `pattern` (Rust regex syntax, which llguidance compiles: no look-around and no
    backreferences; the compile names what it cannot read)."""
    from llguidance import regex_to_lark

    _check_length(pattern)
    return f"start: /{regex_to_lark(pattern)}/"


def choice_grammar(choices: list[str]) -> str:
    """The output is exactly one of `choices`. Lark string literals take JSON's escapes."""
    if not choices:
        raise GrammarError("needs at least one string")
    _check_length("".join(choices))
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def text_grammar(text: str) -> str:
    """A grammar in llguidance's Lark dialect (it has a `start:` rule), or in llama.cpp's GBNF (`root ::= ...`),
    which is translated to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    _check_length(text)
    if not text.strip():
        raise GrammarError("the grammar is empty")
    try:
        return any_to_lark(text)
    except Exception as e:  # the translator raises plain Exceptions naming the rule or position
        raise GrammarError(f"neither Lark (a `start:` rule) nor GBNF (a `root ::=` rule) that can be read: "
                           f"{e}") from None
