"""Function tools of a chat request: their request shapes, and what `tool_choice` makes of
them (a ToolPlan).

- "none": the tools reach the chat template, the output is not parsed;
- "auto" (the default when tools are given): the server's `tool_call_parser` finds calls in
  the output (a request asking for it where none is configured is a 400);
- "required": a grammar makes the output a JSON list of one or more calls
  `[{"name": ..., "parameters": {...}}]` (one when `parallel_tool_calls` is false);
- a named function: a grammar makes the whole output that function's arguments object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from roseray.openai_api.constraints import Constraint, check_schema, raise_two
from roseray.openai_api.field_policy import UnsupportedFieldError
from roseray.sampling_params import StructuredOutputs

_STRICT = ConfigDict(extra="forbid", strict=True)
Name = Annotated[str, Field(min_length=1, max_length=256)]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function that takes no arguments


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # required and named choices always enforce the schema


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: Name


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: Name
    arguments: str | dict[str, Any]  # OpenAI's shape is JSON text; an object is taken too


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant message (the conversation's history)."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """OpenAI's shape, with the arguments as an object where they parse as one: templates
        such as Llama 3's write `arguments | tojson`, Qwen's take either."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass(frozen=True)
class ToolPlan:
    """What the server does with a chat request's tools. `mode`: "none" (also without tools),
    "auto", "required" or "named" (`name` is the function)."""

    mode: str = "none"
    name: str | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"


NO_TOOLS = ToolPlan()


def plan_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None,
               tool_call_parser: str | None, constraint: Constraint | None) -> tuple[ToolPlan, Constraint | None]:
    """The plan of a request, and its constraint (the request's own, or the tools' grammar)."""
    if not tools:
        if tool_choice is not None and tool_choice not in ("none", "auto"):  # those two change nothing here
            raise UnsupportedFieldError("tool_choice", f"tool_choice {_describe(tool_choice)} needs tools: the "
                                                       "request gives none")
        return NO_TOOLS, constraint
    names = [tool.function.name for tool in tools]
    seen: set[str] = set()
    for index, (tool, name) in enumerate(zip(tools, names)):
        if name in seen:
            raise UnsupportedFieldError("tools", f"tools: the name {name!r} is given to more than one function")
        seen.add(name)
        if tool.function.parameters is not None:
            check_schema(f"tools.{index}.function.parameters", tool.function.parameters)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return NO_TOOLS, constraint
    if choice == "auto":
        if tool_call_parser is None:
            raise UnsupportedFieldError("tool_choice", "tool_choice 'auto' (the default with tools) needs the "
                                                       "server's tool_call_parser option (--tool-call-parser, or "
                                                       "tool_call_parser in serve_config.yaml), which is not set: "
                                                       "send tool_choice 'required', a named function or 'none'")
        return ToolPlan("auto"), constraint
    if constraint is not None:
        raise_two(constraint.param, "tool_choice")
    if choice == "required":
        schema = required_schema(tools, parallel=parallel_tool_calls is not False)
        return ToolPlan("required"), Constraint("tools", StructuredOutputs.json_schema(schema))
    name = choice.function.name
    if name not in seen:
        raise UnsupportedFieldError("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                                   f"the tools ({', '.join(map(repr, names))})")
    tool = tools[names.index(name)]
    return ToolPlan("named", name), Constraint("tools", StructuredOutputs.json_schema(_parameters(tool)))


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each `{"name": <one tool's name>, "parameters": <its arguments>}`."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": _parameters(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else
                              {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def _describe(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming the function {choice.function.name!r}"
