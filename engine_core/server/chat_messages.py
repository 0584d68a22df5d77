"""A chat request's messages, validated and reduced to what chat templates read: role and
text, an assistant's tool calls (arguments as objects), a tool result's call id and name."""

from __future__ import annotations

from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.server.tools import template_tool_calls

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins a message's text parts
    if content is None:
        return ""
    raise InvalidRequestError(f"messages[{index}].content must be a string or text parts",
                              "messages")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The validated messages of a chat (or chat /tokenize) request."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                "messages")
        messages.append(_message(message, role, index))
    return messages


def _message(message: dict[str, Any], role: str, index: int) -> dict[str, Any]:
    """One message as the chat template reads it: role and text; an assistant's tool calls
    (arguments as objects), a tool result's ``tool_call_id`` and ``name``."""
    out: dict[str, Any] = {"role": role, "content": _message_text(message.get("content"), index)}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = template_tool_calls(message["tool_calls"], index)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"messages[{index}].{key} must be a string",
                                          "messages")
            if value is not None:
                out[key] = value
    return out
