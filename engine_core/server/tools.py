"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` validated
once, the output constraint a forced choice sets, and the parser that reads the answer.

``tool_choice`` defaults to ``"auto"`` when tools are given, as in vLLM; ``"auto"`` reads
calls out of free text with the server's ``--tool-call-parser``; ``"required"`` and a
named function constrain the output (a JSON array of calls, or the function's arguments)
with the grammar engine and read that JSON directly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine_core.errors import ConfigError, InvalidRequestError
from engine_core.server.tool_parsers import TOOL_PARSERS
from engine_core.server.tool_parsers.events import ToolCallParser
from engine_core.server.tool_parsers.json_calls import NamedCallParser, RequiredCallsParser
from engine_core.structured_outputs import StructuredOutputsParams

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCallOptions:
    """The server's tool-call settings (vLLM's ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"unknown tool call parser {self.tool_call_parser!r}; "
                              f"known: {sorted(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolFunction:
    """One declared function: its name, description and parameters' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tools and choice. ``choice`` is ``"none"``, ``"auto"``,
    ``"required"`` or ``"function"`` (then ``function_name`` names it)."""

    tools: tuple[dict[str, Any], ...]  # as the client sent them, for the chat template
    functions: tuple[ToolFunction, ...]
    choice: str
    function_name: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """What a forced choice constrains the output to (vLLM's schemas)."""
        if self.choice == "function":
            function = next(f for f in self.functions if f.name == self.function_name)
            return StructuredOutputsParams(json=function.parameters)
        if self.choice != "required":
            return None
        # Each tool's "$defs" move to the array schema's root, where its "$ref"s resolve.
        defs: dict[str, Any] = {}
        items = []
        for f in self.functions:
            parameters = dict(f.parameters)
            for key, value in parameters.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise InvalidRequestError(f'tools define "$defs" {key!r} differently; '
                                              'tool_choice "required" needs one meaning',
                                              "tools")
            items.append({"type": "object",
                          "properties": {"name": {"type": "string", "enum": [f.name]},
                                         "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            calls["maxItems"] = 1
        if defs:
            calls["$defs"] = defs
        return StructuredOutputsParams(json=calls)

    def parser(self, options: ToolCallOptions) -> ToolCallParser | None:
        """A fresh parser for one answer; None when the answer is plain content."""
        if self.choice == "function":
            assert self.function_name is not None
            return NamedCallParser(self.function_name)
        if self.choice == "required":
            return RequiredCallsParser()
        if self.choice == "auto":
            self.check_auto(options)
            assert options.tool_call_parser is not None
            return TOOL_PARSERS[options.tool_call_parser]()
        return None

    def keeps_special_tokens(self, options: ToolCallOptions) -> bool:
        """Whether the answer's detokenizer must keep special tokens: the parser's markup
        may be special tokens (vLLM's Hermes parser asks this too)."""
        if self.choice != "auto" or options.tool_call_parser is None:
            return False
        return getattr(TOOL_PARSERS[options.tool_call_parser], "keeps_special_tokens", False)

    def check_auto(self, options: ToolCallOptions) -> None:
        """vLLM's rule: ``"auto"`` needs a server started to parse calls out of text."""
        if self.choice == "auto" and not (options.enable_auto_tool_choice
                                          and options.tool_call_parser):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set", "tool_choice")


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and choice; None when it declares no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(tool, index) for index, tool in enumerate(tools))
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools: the function name {duplicate!r} is declared twice",
                                  "tools")
    kind, name = _choice(choice, names)
    return ToolRequest(tuple(tools), functions, kind, name,
                       True if parallel is None else parallel)


def _function(tool: Any, index: int) -> ToolFunction:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f'{where} must be an object of type "function"', "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.function.name must be 1 to 64 letters, digits, "
                                  f"underscores or dashes, got {name!r:.80}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where} ({name}): description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    _check_schema(parameters, f"{where} ({name}): parameters")
    return ToolFunction(name, description, parameters)


def _check_schema(schema: Any, where: str) -> None:
    """A function's parameters must be a valid JSON schema of an object."""
    from jsonschema import exceptions, validators

    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where} must be a JSON schema object", "tools")
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f'{where} must describe an object ("type": "object")',
                                  "tools")
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        raise InvalidRequestError(f"{where} is not a valid JSON schema: {exc.message:.200}",
                                  "tools") from None


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a "
                                      f"named function, got {choice!r:.80}", "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
            name, str):
        raise InvalidRequestError('tool_choice must be a string or {"type": "function", '
                                  '"function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names the function {name!r:.80}, which tools "
                                  "does not declare", "tool_choice")
    return "function", name


def template_tool_calls(value: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    arguments a JSON object (the API carries them as a JSON string)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a list", "messages")
    calls = []
    for number, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}[{number}] must have function.name", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequestError(f"{where}[{number}].function.arguments is not JSON",
                                          "messages") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{where}[{number}].function.arguments must be a JSON "
                                      "object", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}[{number}].id must be a string", "messages")
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls
