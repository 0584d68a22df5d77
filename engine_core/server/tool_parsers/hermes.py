"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, with text around them."""

from __future__ import annotations

from engine_core.server.tool_parsers.content import ContentWriter
from engine_core.server.tool_parsers.events import ToolEvent, held_prefix_length
from engine_core.server.tool_parsers.json_scan import CallObject

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class HermesToolParser:
    """Content outside the tags; each tagged JSON object a call. A tagged text that is no
    call object stays content, tags and all."""

    # The Hermes models' tags are special tokens: the detokenizer must keep them.
    keeps_special_tokens = True

    def __init__(self) -> None:
        self._pending = ""  # text not yet settled
        self._content = ContentWriter()
        self._call: CallObject | None = None
        self._body = ""  # the open call's text, for the content it becomes if it is no call
        self._num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self._pending += text
        events: list[ToolEvent] = []
        while True:
            if self._call is None:
                at = self._pending.find(CALL_START)
                if at < 0:
                    safe = len(self._pending) - held_prefix_length(self._pending, CALL_START)
                    events += self._content.text(self._pending[:safe])
                    self._pending = self._pending[safe:]
                    return events
                events += self._content.before_call(self._pending[:at])
                self._pending = self._pending[at + len(CALL_START):]
                self._call, self._body = CallObject(self._num_calls, ("arguments",)), ""
                continue
            at = self._pending.find(CALL_END)
            if at < 0:
                safe = len(self._pending) - held_prefix_length(self._pending, CALL_END)
                events += self._feed_call(self._pending[:safe])
                self._pending = self._pending[safe:]
                return events
            events += self._feed_call(self._pending[:at])
            self._pending = self._pending[at + len(CALL_END):]
            events += self._end_call(closed=True)

    def _feed_call(self, text: str) -> list[ToolEvent]:
        assert self._call is not None
        self._body += text
        return self._call.feed(text)[0]

    def _end_call(self, closed: bool) -> list[ToolEvent]:
        assert self._call is not None
        events = self._call.finish()
        self._call = None
        if events is None:  # no call: the tagged text is content
            return self._content.text(CALL_START + self._body + (CALL_END if closed else ""))
        self._num_calls += 1
        self._content.call_ended()
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._call is not None:
            events += self._feed_call(self._pending)
            events += self._end_call(closed=False)
        else:
            events += self._content.text(self._pending)
        self._pending = ""
        return [*events, *self._content.finish()]

