"""What a request's output must match: vLLM's ``structured_outputs`` fields, in one type.

The OpenAI layer maps ``response_format``, ``structured_outputs`` and the older
``guided_*`` fields (and tool choices that force a call) onto this; the engine compiles
it into a grammar and masks the sampler with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine_core.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint is set. ``json`` is a JSON schema (an object, or its text)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None         # EBNF (GBNF / Lark-like, as the grammar engine reads)
    json_object: bool = False          # any JSON object (response_format json_object)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.kind is None:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                "json_object", "structured_outputs")

    @property
    def kind(self) -> str | None:
        """The one constraint set, or None when zero or several are."""
        set_ = [f.name for f in fields(self)
                if (getattr(self, f.name) is not None and f.name != "json_object")]
        if self.json_object:
            set_.append("json_object")
        return set_[0] if len(set_) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.choice is not None:
            out["choice"] = list(self.choice)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidRequestError(f"unknown structured_outputs fields {sorted(unknown)}",
                                      "structured_outputs")
        return cls(**data)
