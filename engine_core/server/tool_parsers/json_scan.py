"""Incremental scanning of JSON texts: where a value ends, and one call object
(``{"name": ..., "arguments": {...}}``) streamed as a header and argument fragments."""

from __future__ import annotations

import json
import re
from typing import Any

from engine_core.server.tool_parsers.events import CallArguments, CallStarted, ToolEvent

JSON_WHITESPACE = " \t\r\n"
_SCALAR_END = ",}]" + JSON_WHITESPACE
# A call object's head: its name first, then the key that holds the arguments.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(\w+)"\s*:')


class JsonValueScanner:
    """Finds where one JSON value ends, fed its text piece by piece (leading whitespace
    skipped). A number or literal ends at the character after it."""

    def __init__(self) -> None:
        self.started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scalar = False

    def feed(self, text: str) -> int | None:
        """The offset in ``text`` just past the value's end, or None while it goes on."""
        for offset, char in enumerate(text):
            if not self.started:
                if char in JSON_WHITESPACE:
                    continue
                self.started = True
                if char in "{[":
                    self.depth = 1
                elif char == '"':
                    self.in_string = True
                else:
                    self.scalar = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return offset + 1
            elif self.scalar:
                if char in _SCALAR_END:
                    return offset
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return offset + 1
        return None


class CallObject:
    """One call object as its text arrives: ``CallStarted`` once its name is read (the
    name must come first), then its arguments' text as it grows, trailing whitespace held
    back. An object whose head does not read that way is judged whole at its end
    (``finish``). ``argument_keys``: the keys that may hold the arguments."""

    def __init__(self, index: int, argument_keys: tuple[str, ...]) -> None:
        self.index = index
        self.argument_keys = argument_keys
        self.text = ""
        self.name: str | None = None
        self.complete = False  # the object's closing brace arrived
        self._object = JsonValueScanner()
        self._arguments = JsonValueScanner()
        self._arguments_start = 0
        self._arguments_end: int | None = None
        self._scanned = 0  # text the arguments scanner has seen
        self._sent = 0  # characters of the (stripped) arguments sent

    def feed(self, text: str) -> tuple[list[ToolEvent], str]:
        """Events for ``text``, and what follows the object's end (not part of it)."""
        end = self._object.feed(text) if not self.complete else 0
        rest = ""
        if end is not None:
            text, rest = text[:end], text[end:]
            self.complete = True
        self.text += text
        events: list[ToolEvent] = []
        if self.name is None:
            head = _CALL_HEAD.match(self.text)
            if head and head.group(2) in self.argument_keys:
                self.name = json.loads(head.group(1))
                self._arguments_start = self._scanned = head.end()
                events.append(CallStarted(self.index, self.name))
        if self.name is not None:
            if self._arguments_end is None:
                value_end = self._arguments.feed(self.text[self._scanned:])
                if value_end is not None:
                    self._arguments_end = self._scanned + value_end
                self._scanned = len(self.text)
            events += self._arguments_events()
        return events, rest

    def _arguments_events(self) -> list[ToolEvent]:
        stop = self._arguments_end if self._arguments_end is not None else len(self.text)
        arguments = self.text[self._arguments_start:stop].strip(JSON_WHITESPACE)
        fragment = arguments[self._sent:]
        self._sent = len(arguments)
        return [CallArguments(self.index, fragment)] if fragment else []

    def finish(self) -> list[ToolEvent] | None:
        """The call's last events once its text is all there; None when it is no call
        (its text is then content)."""
        if self.name is not None:
            return self._arguments_events()
        try:
            value: Any = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        key = next((k for k in self.argument_keys if k in value), None)
        if key is None:
            return None
        self.name = value["name"]
        arguments = json.dumps(value[key], ensure_ascii=False)
        return [CallStarted(self.index, value["name"]), CallArguments(self.index, arguments)]
