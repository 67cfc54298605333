"""The request fields that constrain the output to a grammar, and the one StructuredOutputs
they ask for.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` object
and vLLM's older top-level names (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, `structural_tag`) all map to `SamplingParams.structured_outputs`. One
request names at most one constraint: two are a 400 naming both (which one wins would be
a guess). Whether a schema, regex or grammar compiles is the engine's check (a ValueError,
so a 400); a JSON schema is checked against its meta-schema here first, so that a malformed
one is named before the engine sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from roseray.openai_api.field_policy import UnsupportedFieldError, refused
from roseray.sampling_params import StructuredOutputs

_STRICT = ConfigDict(extra="forbid", strict=True)
Choices = Annotated[list[str], Field(min_length=1)]
Spec = Annotated[str, Field(min_length=1)]  # a regex, a grammar, a structural tag
Backend = Literal["auto", "xgrammar"]  # xgrammar is the only backend
MAX_CHECKED_SCHEMAS = 256  # meta-checks remembered by schema text: an app sends the same few over and over
BACKEND_REASON = "xgrammar is the only backend; 'auto' and 'xgrammar' are accepted"


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the grammar always enforces the schema, so strict or not is the same


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputsObject(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object,
    structural_tag; its other keys only with the values that change nothing."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None
    json_object: bool | None = None
    structural_tag: Spec | None = None
    disable_fallback: bool = False  # roseray has one backend and never falls back: either value holds
    disable_any_whitespace: bool = False  # True: JSON without free whitespace (json, json_object)
    disable_additional_properties: Literal[False] = refused("a schema's additionalProperties is kept as written",
                                                            False)
    whitespace_pattern: None = refused("the JSON grammar's whitespace is fixed")
    backend: Backend | None = refused(BACKEND_REASON)


@dataclass(frozen=True)
class Constraint:
    """The request's constraint and the field that asked for it (a 400 about it names that field)."""

    param: str
    structured_outputs: StructuredOutputs


def _json_schema(param: str, schema: dict[str, Any] | str, any_whitespace: bool = True) -> StructuredOutputs:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise UnsupportedFieldError(param, f"{param}: the JSON schema is not valid JSON ({error})") from None
    check_schema(param, schema)
    return StructuredOutputs.json_schema(schema, any_whitespace)


def check_schema(param: str, schema: Any) -> None:
    """A 400 naming `param` when `schema` is not a JSON schema (per its meta-schema)."""
    if not isinstance(schema, (dict, bool)):
        raise UnsupportedFieldError(param, f"{param}: a JSON schema must be an object, got {type(schema).__name__}")
    try:
        problem = _schema_problem(json.dumps(schema, sort_keys=True))
    except RecursionError:
        problem = "the JSON schema is nested too deeply"
    if problem is not None:
        raise UnsupportedFieldError(param, f"{param}: {problem}")


@lru_cache(maxsize=MAX_CHECKED_SCHEMAS)
def _schema_problem(text: str) -> str | None:
    """What makes the schema (as canonical JSON text) no JSON schema, or None (the meta-check takes
    ~1.6 ms a schema; the text, ~2% of that)."""
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.path) or "the top level"
        return f"invalid JSON schema at {where}: {error.message}"
    return None  # (a RecursionError reaches check_schema, which says the schema is nested too deeply)


def _text_specs(fields: list[tuple[str, Any]]) -> list[tuple[str, StructuredOutputs]]:
    """(param, its spec) for each field given: a regex, choice, grammar or structural tag, by the
    param's last word (`guided_regex`, `structured_outputs.choice`, ...)."""
    found = []
    for param, value in fields:
        if value is None:
            continue
        kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
        found.append((param, StructuredOutputs.choice(value) if kind == "choice" else StructuredOutputs(kind, value)))
    return found


def _of_object(obj: StructuredOutputsObject) -> list[tuple[str, StructuredOutputs]]:
    param = "structured_outputs"
    found = []
    any_whitespace = not obj.disable_any_whitespace
    if obj.json_ is not None:
        found.append(("structured_outputs.json", _json_schema(param, obj.json_, any_whitespace)))
    found += _text_specs([("structured_outputs.regex", obj.regex), ("structured_outputs.choice", obj.choice),
                          ("structured_outputs.grammar", obj.grammar)])
    if obj.json_object:
        found.append(("structured_outputs.json_object", StructuredOutputs("json_object",
                                                                          any_whitespace=any_whitespace)))
    found += _text_specs([("structured_outputs.structural_tag", obj.structural_tag)])
    if not found:
        raise UnsupportedFieldError(param, "structured_outputs names no constraint: give one of json, regex, choice, "
                                           "grammar, json_object, structural_tag")
    return found


def request_constraint(body) -> Constraint | None:
    """The one constraint `body` (a completion or chat request) asks for, or None. Two are a 400."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        found.append(("response_format", StructuredOutputs("json_object")))
    elif isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        found.append(("response_format", StructuredOutputs("json_object") if schema is None
                      else _json_schema("response_format", schema)))
    if body.structured_outputs is not None:
        found.extend(_of_object(body.structured_outputs))
    if body.guided_json is not None:
        found.append(("guided_json", _json_schema("guided_json", body.guided_json)))
    found += _text_specs([("guided_regex", body.guided_regex), ("guided_choice", body.guided_choice),
                          ("guided_grammar", body.guided_grammar), ("structural_tag", body.structural_tag)])
    if len(found) > 1:
        raise_two(found[0][0], found[1][0])
    if not found:
        return None
    param, structured = found[0]
    return Constraint(param.split(".")[0], structured)


def raise_two(first: str, second: str) -> None:
    raise UnsupportedFieldError(second, f"{first} and {second} both constrain the output: a request may name "
                                        "only one constraint")
