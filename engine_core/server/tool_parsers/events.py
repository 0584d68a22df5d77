"""What a tool-call parser reports as the model's text arrives, and the whole answer those
reports add up to.

Parsers are incremental and pure: ``feed(text)`` takes the next piece of the answer and
returns what is now certain, ``finish()`` what the end settles. A whole answer is parsed by
feeding it at once, so streamed and whole answers agree whenever the events do not depend
on how the text was split (the parser tests check every split point).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ContentText:
    """Text outside tool calls, for ``message.content``."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """Call ``index`` (0, 1, ... within the answer) names its function."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next characters of call ``index``'s arguments (a JSON text)."""

    index: int
    fragment: str


ToolEvent = ContentText | CallStarted | CallArguments


class ToolCallParser(Protocol):
    """Turns the model's text into content and tool calls as it arrives."""

    def feed(self, text: str) -> list[ToolEvent]:
        """Events the answer so far settles, given its next ``text``."""
        ...

    def finish(self) -> list[ToolEvent]:
        """Events the end of the answer settles (held-back text, an unclosed call)."""
        ...


@dataclass
class ParsedCall:
    """One tool call of a whole answer."""

    name: str
    arguments: str


@dataclass
class ParsedAnswer:
    """A whole answer: its content (None when it is only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def fold(events: list[ToolEvent]) -> ParsedAnswer:
    """The answer a complete list of events describes."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    for event in events:
        if isinstance(event, ContentText):
            content.append(event.text)
        elif isinstance(event, CallStarted):
            calls.append(ParsedCall(event.name, ""))
        else:
            calls[event.index].arguments += event.fragment
    text = "".join(content)
    return ParsedAnswer(None if calls and not text else text, calls)


def parse_whole(parser: ToolCallParser, text: str) -> ParsedAnswer:
    """A whole answer parsed as one stream piece (so it agrees with the streamed one)."""
    return fold([*parser.feed(text), *parser.finish()])


def held_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (but is not all of
    it): characters to hold back, since the next piece may complete the marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
