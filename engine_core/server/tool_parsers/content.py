"""The content text around tool calls: whitespace that only separates text from a call
(before ``<tool_call>``, after ``</tool_call>``) is not content."""

from __future__ import annotations

from engine_core.server.tool_parsers.events import ContentText, ToolEvent


class ContentWriter:
    """Emits content with trailing whitespace held back until text follows it (it is
    dropped when a call follows instead) and leading whitespace after a call dropped."""

    def __init__(self) -> None:
        self.after_call = False
        self._held = ""

    def text(self, text: str) -> list[ToolEvent]:
        """Content that more text may follow."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        kept = text.rstrip()
        if not kept:
            self._held += text
            return []
        out, self._held = self._held + kept, text[len(kept):]
        return [ContentText(out)]

    def before_call(self, text: str) -> list[ToolEvent]:
        """Content a call follows: its trailing whitespace is dropped."""
        events = self.text(text)
        self._held = ""
        return events

    def call_ended(self) -> None:
        self.after_call = True

    def finish(self) -> list[ToolEvent]:
        """Whitespace held at the end of the answer is content."""
        held, self._held = self._held, ""
        return [ContentText(held)] if held else []
