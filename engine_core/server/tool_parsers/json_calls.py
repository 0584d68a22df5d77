"""Answers that are a sequence of JSON call objects: Llama 3.x's
``{"name": ..., "parameters": {...}}; {...}`` (``llama3_json``) and the array of
``{"name": ..., "parameters": ...}`` that ``tool_choice="required"`` constrains the output to.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.server.tool_parsers.content import ContentWriter
from engine_core.server.tool_parsers.events import (
    CallArguments,
    CallStarted,
    ToolEvent,
    held_prefix_length,
)
from engine_core.server.tool_parsers.json_scan import JSON_WHITESPACE, CallObject


@dataclass(frozen=True)
class CallsFormat:
    """How the call objects of one answer are written."""

    argument_keys: tuple[str, ...]
    separator: str  # between two calls
    opener: str = ""  # before the first call (an array's "[")
    tag: str = ""  # an optional marker before the calls (Llama's <|python_tag|>)


class JsonCallsParser:
    """An answer that begins with a call object (after its format's opener or tag) is
    calls, separated by the format's separator; text after them, or an answer beginning
    otherwise, is content. The first object that is no call ends the calls: it and the
    rest are content."""

    keeps_special_tokens = False

    def __init__(self, format_: CallsFormat) -> None:
        self.format = format_
        self._pending = ""
        self._mode = "start"  # start -> calls <-> call -> content
        self._content = ContentWriter()
        self._call: CallObject | None = None
        self._num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self._pending += text
        events: list[ToolEvent] = []
        while self._pending:
            if self._mode == "start":
                if not self._start():
                    break
            elif self._mode == "calls":
                rest = self._pending.lstrip(JSON_WHITESPACE + self.format.separator)
                if rest and rest[0] == "{":
                    self._mode, self._call = "call", CallObject(self._num_calls,
                                                                self.format.argument_keys)
                elif rest:
                    self._mode = "content"
                self._pending = rest
            elif self._mode == "call":
                assert self._call is not None
                found, self._pending = self._call.feed(self._pending)
                events += found
                if self._call.complete:
                    events += self._end_call()
            else:
                events += self._content.text(self._pending)
                self._pending = ""
        return events

    def _start(self) -> bool:
        """Decide whether the answer is calls; False while its start cannot tell yet."""
        head = self._pending.lstrip(JSON_WHITESPACE)
        marker = self.format.tag or self.format.opener
        if not head or (marker and held_prefix_length(head, marker) == len(head)):
            return False
        if marker and head.startswith(marker):
            self._mode, self._pending = "calls", head[len(marker):]
        elif head[0] == "{" and not self.format.opener:
            self._mode, self._pending = "calls", head
        else:
            self._mode = "content"
        return True

    def _end_call(self) -> list[ToolEvent]:
        assert self._call is not None
        events = self._call.finish()
        text, self._call = self._call.text, None
        if events is None:  # no call: it and all that follows are content
            self._mode = "content"
            return self._content.text(text)
        self._num_calls += 1
        self._content.call_ended()
        self._mode = "calls"
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._mode == "call":
            events += self._end_call()
        if self._mode in ("start", "content"):
            events += self._content.text(self._pending)
        self._pending = ""
        return [*events, *self._content.finish()]


LLAMA3_JSON = CallsFormat(argument_keys=("parameters", "arguments"), separator=";",
                          tag="<|python_tag|>")
REQUIRED_CALLS = CallsFormat(argument_keys=("parameters",), separator=",]", opener="[")


class Llama3JsonToolParser(JsonCallsParser):
    """Llama 3.x JSON calls, optionally after ``<|python_tag|>``, separated by ``;``."""

    def __init__(self) -> None:
        super().__init__(LLAMA3_JSON)


class RequiredCallsParser(JsonCallsParser):
    """The JSON array of calls ``tool_choice="required"`` forces."""

    def __init__(self) -> None:
        super().__init__(REQUIRED_CALLS)


class NamedCallParser:
    """The output ``tool_choice`` naming a function forces: that call's arguments."""

    keeps_special_tokens = False

    def __init__(self, name: str) -> None:
        self.name = name
        self._text = ""
        self._sent = 0
        self._started = False

    def feed(self, text: str) -> list[ToolEvent]:
        self._text += text
        return self._events(self._text.strip(JSON_WHITESPACE))

    def _events(self, arguments: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self._started:
            self._started = True
            events.append(CallStarted(0, self.name))
        fragment, self._sent = arguments[self._sent:], len(arguments)
        if fragment:
            events.append(CallArguments(0, fragment))
        return events

    def finish(self) -> list[ToolEvent]:
        return self._events(self._text.strip(JSON_WHITESPACE))
