"""A chat answer's tool calls as OpenAI sends them: ``message.tool_calls`` in a whole
answer, and in a stream the deltas of each call (its index, id, type, name and empty
arguments first, then argument fragments), the markup around calls never shown.

Call ids are derived from the request id and prompt, so a stream continued by another
worker (the first-token handoff, request migration) names its calls as it began to.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine_core.output_processor import RequestDelta
from engine_core.server.responses import chat_logprobs
from engine_core.server.tool_parsers.events import (
    CallStarted,
    ContentText,
    ToolCallParser,
    ToolEvent,
    fold,
)
from engine_core.server.tools import ToolCallOptions, ToolRequest


class ChatTools:
    """The tool-call side of one chat request's answers, a parser per choice."""

    def __init__(self, request: ToolRequest, options: ToolCallOptions, request_id: str,
                 prompt_token_ids: list[int], num_choices: int) -> None:
        self.request = request
        self.options = options
        self._streams = [self._parser() for _ in range(num_choices)]
        self._called = [False] * num_choices
        digest = hashlib.sha256(request_id.encode())
        digest.update(",".join(map(str, prompt_token_ids)).encode())
        self._id_seed = digest.hexdigest()

    def _parser(self) -> ToolCallParser:
        parser = self.request.parser(self.options)
        assert parser is not None  # ChatTools only serves choices that call tools
        return parser

    def call_id(self, choice: int, index: int) -> str:
        """OpenAI's ``call_`` id of a choice's call ``index``."""
        digest = hashlib.sha256(f"{self._id_seed}:{choice}:{index}".encode()).hexdigest()
        return f"call_{digest[:24]}"

    def _kept(self, events: list[ToolEvent]) -> list[ToolEvent]:
        """Without ``parallel_tool_calls`` an answer keeps its first call only."""
        if self.request.parallel:
            return events
        return [e for e in events if isinstance(e, ContentText) or e.index == 0]

    def prime(self, choice: int, text: str) -> None:
        """Fold in the text the client already has (handed over from another worker)."""
        events = self._kept(self._streams[choice].feed(text))
        self._called[choice] |= any(isinstance(e, CallStarted) for e in events)

    def deltas(self, choice: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """The stream deltas of a choice's next ``text`` (and of its end)."""
        parser = self._streams[choice]
        events = self._kept([*parser.feed(text), *(parser.finish() if finished else [])])
        out: list[dict[str, Any]] = []
        for event in events:
            last = out[-1] if out else {}
            if isinstance(event, ContentText):
                if "content" in last:
                    last["content"] += event.text
                else:
                    out.append({"content": event.text})
            elif isinstance(event, CallStarted):
                self._called[choice] = True
                out.append({"tool_calls": [{
                    "index": event.index, "id": self.call_id(choice, event.index),
                    "type": "function", "function": {"name": event.name, "arguments": ""}}]})
            else:
                calls = last.get("tool_calls", [])
                if len(calls) == 1 and "id" not in calls[0] and calls[0]["index"] == event.index:
                    calls[0]["function"]["arguments"] += event.fragment
                else:
                    out.append({"tool_calls": [{"index": event.index, "function": {
                        "arguments": event.fragment}}]})
        return out

    def finish_reason(self, choice: int, reason: str | None) -> str | None:
        """``"tool_calls"`` for an answer that called (OpenAI's ``"stop"`` where the request
        named the function)."""
        if reason == "stop" and self._called[choice] and self.request.choice != "function":
            return "tool_calls"
        return reason

    def message(self, choice: int, text: str) -> dict[str, Any]:
        """A whole answer's message; records whether the choice called."""
        parser = self._parser()
        answer = fold(self._kept([*parser.feed(text), *parser.finish()]))
        self._called[choice] = bool(answer.calls)
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.calls:
            message["tool_calls"] = [
                {"id": self.call_id(choice, index), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for index, call in enumerate(answer.calls)]
        return message

    def chunks(self, head: dict[str, Any], choice: int, delta: RequestDelta,
               want_logprobs: bool) -> list[dict[str, Any]]:
        """The stream chunks of one delta: one per message delta, logprobs on the first,
        the finish on the last."""
        pieces = self.deltas(choice, delta.text, delta.finished)
        if not pieces and (delta.finished or delta.logprobs):
            pieces = [{}]
        reason = self.finish_reason(choice, delta.finish_reason) if delta.finished else None
        chunks = []
        for number, piece in enumerate(pieces):
            last = number == len(pieces) - 1
            chunks.append({**head, "choices": [{
                "index": choice, "delta": piece,
                "logprobs": (chat_logprobs((delta.logprobs or []) if number == 0 else [])
                             if want_logprobs else None),
                "finish_reason": reason if last else None,
                "stop_reason": delta.stop_reason if last and delta.finished else None}]})
        return chunks

