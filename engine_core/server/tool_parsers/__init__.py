"""Tool-call output parsers, by vLLM's ``--tool-call-parser`` names."""

from __future__ import annotations

from collections.abc import Callable

from engine_core.server.tool_parsers.events import ToolCallParser
from engine_core.server.tool_parsers.hermes import HermesToolParser
from engine_core.server.tool_parsers.json_calls import Llama3JsonToolParser

TOOL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
