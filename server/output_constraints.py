"""The request fields that constrain a reply's text, and the grammar each makes: OpenAI's `response_format`,
vLLM's `structured_outputs` (and its older `guided_*` fields), llama-server's `json_schema` and `grammar`.
A request gives at most one of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybrid.structured_output.backend import GrammarError
from hybrid.structured_output.grammars import (
    check_schema_shape,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    regex_grammar,
    text_grammar,
)

# vLLM's structured_outputs options hybridd does not implement, with the values that ask for nothing.
# disable_any_whitespace and disable_fallback need nothing: a JSON reply never has free whitespace here, and
# there is one grammar library to fall back from.
UNSUPPORTED_OPTIONS = {"disable_additional_properties": (False,), "whitespace_pattern": (None,),
                       "structural_tag": (None,)}


def unsupported_field(data: object, unsupported: dict[str, tuple]) -> str | None:
    """The first field of `data` set to anything but its neutral values (same type too: 1 is not True)."""
    if not isinstance(data, dict):
        return None
    return next((name for name, neutral in unsupported.items()
                 if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral)), None)


def _schema(value: object, where: str) -> dict:
    """A JSON schema given as an object or as JSON text (vLLM takes both), its shape checked."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where} is a string but not JSON text: {e}") from None
    try:
        return check_schema_shape(value, where)
    except GrammarError as e:
        raise ValueError(str(e)) from None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _valid(cls, v: dict) -> dict:
        return _schema(v, "schema")


class ResponseFormat(BaseModel):
    """`json_object`: any JSON object, or (llama-server's form) a value valid against its `schema`;
    `json_schema`: a JSON value valid against the given schema."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    object_schema: dict | None = Field(default=None, alias="schema")

    @field_validator("object_schema")
    @classmethod
    def _valid(cls, v: dict | None) -> dict | None:
        return None if v is None else _schema(v, "schema")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        if self.object_schema is not None and self.type != "json_object":
            where = "json_schema.schema" if self.type == "json_schema" else "no schema"
            raise ValueError(f"a schema beside the type is llama-server's json_object form; type {self.type} takes "
                             f"{where}")
        return self

    @property
    def schema_given(self) -> dict | None:
        if self.type == "json_schema":
            return self.json_schema.json_schema
        return self.object_schema

    def grammar(self) -> str | None:
        if self.type == "text":
            return None
        schema = self.schema_given
        return json_object_grammar() if schema is None else json_schema_grammar(schema)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (Lark or GBNF) and
    json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    _grammar: str = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _neutral_options(cls, data):
        if (name := unsupported_field(data, UNSUPPORTED_OPTIONS)) is not None:
            raise ValueError(f"hybridd does not support the option {name} yet")
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in UNSUPPORTED_OPTIONS}
        return data

    @field_validator("json_")
    @classmethod
    def _json(cls, v: dict | str | None) -> dict | None:
        return None if v is None else _schema(v, "schema")

    @model_validator(mode="after")
    def _exactly_one(self):
        kinds = {"json": self.json_ is not None and (lambda: json_schema_grammar(self.json_)),
                 "regex": self.regex is not None and (lambda: regex_grammar(self.regex)),
                 "choice": self.choice is not None and (lambda: choice_grammar(self.choice)),
                 "grammar": self.grammar is not None and (lambda: text_grammar(self.grammar)),
                 "json_object": bool(self.json_object) and json_object_grammar}
        given = [k for k, make in kinds.items() if make]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(kinds)}, got {', '.join(given) or 'none'}")
        try:
            self._grammar = kinds[given[0]]()
        except GrammarError as e:
            raise ValueError(f"{given[0]}: {e}") from None
        return self

    @property
    def schema_given(self) -> dict | None:
        return self.json_

    def grammar_text(self) -> str:
        return self._grammar


class ConstraintFields(BaseModel):
    """The fields that constrain a reply, on both completion routes: at most one may be given. `constraint` is
    the grammar of the one given and its field."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict | None = None
    grammar: str | None = None
    _constraint: tuple[str, str] | None = PrivateAttr(default=None)

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v: dict | str | None) -> dict | None:
        return None if v is None else _schema(v, "schema")

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: dict | None) -> dict | None:
        return None if v is None else _schema(v, "schema")

    @field_validator("grammar", mode="before")
    @classmethod
    def _no_grammar(cls, v: object) -> object:
        return None if v == "" else v  # llama-server's clients send "" for none

    def _given(self) -> list[tuple[str, Callable[[], str]]]:
        """(field, grammar maker) of each constraint the request gives."""
        makers = {"guided_json": json_schema_grammar, "json_schema": json_schema_grammar,
                  "guided_regex": regex_grammar, "guided_choice": choice_grammar,
                  "guided_grammar": text_grammar, "grammar": text_grammar}
        found: list[tuple[str, Callable[[], str]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", self.response_format.grammar))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.grammar_text))
        for field, make in makers.items():
            if (value := getattr(self, field)) is not None:
                found.append((field, lambda make=make, value=value: make(value)))
        return found

    @model_validator(mode="after")
    def _at_most_one(self):
        given = self._given()
        if len(given) > 1:
            raise PydanticCustomError("constraint", "{fields} each constrain the reply: give one",
                                      {"param": given[1][0], "fields": " and ".join(f for f, _ in given)})
        if given:
            field, make = given[0]
            try:
                self._constraint = (make(), field)
            except GrammarError as e:
                raise PydanticCustomError("grammar", "{problem}", {"param": field, "problem": str(e)}) from None
        return self

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(Lark grammar, field) of the request's constraint, or None: free text."""
        return self._constraint

    def schemas(self) -> list[tuple[str, str, dict]]:
        """(field, name, schema) of every JSON schema in the request, for the full check the api runs off its event
        loop (parsing checks only their shape)."""
        found = []
        if self.response_format is not None and (schema := self.response_format.schema_given) is not None:
            where = "json_schema.schema" if self.response_format.type == "json_schema" else "schema"
            found.append((f"response_format.{where}", "schema", schema))
        if self.structured_outputs is not None and (schema := self.structured_outputs.schema_given) is not None:
            found.append(("structured_outputs.json", "schema", schema))
        for field in ("guided_json", "json_schema"):
            if (schema := getattr(self, field)) is not None:
                found.append((field, "schema", schema))
        return found
