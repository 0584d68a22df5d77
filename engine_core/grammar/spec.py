"""A request's ``StructuredOutputsParams`` as one grammar source text, and its check.

The text is what the compile cache is keyed by and what xgrammar compiles; ``check_spec``
builds the grammar without a tokenizer, so the API process refuses a bad schema, regex or
grammar with a 400 before the engine sees it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine_core.errors import InvalidRequestError
from engine_core.structured_outputs import StructuredOutputsParams

# Compact JSON: with any whitespace allowed a model can pad forever between tokens, and
# clients parse the answer, not its layout.
ANY_WHITESPACE = False
MAX_SPEC_CHARS = 1 << 20  # a grammar source larger than this is refused
MAX_CHOICES = 1024
# xgrammar's errors begin with "[time] file.cc:line: "; clients get the message after it.
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \([^)]*\) is false:\s*)?")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: ``kind`` is json, json_object, regex or grammar (EBNF); a choice
    is the grammar of its alternatives."""

    kind: str
    text: str


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The one source text of ``params``. A schema object keeps its key order: the order
    of ``properties`` is the order the output writes them in."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        spec = GrammarSpec("json", text)
    elif kind == "json_object":
        spec = GrammarSpec("json_object", "")
    elif kind == "regex":
        spec = GrammarSpec("regex", _text(params.regex, "regex"))
    elif kind == "grammar":
        spec = GrammarSpec("grammar", _text(params.grammar, "grammar"))
    elif kind == "choice":
        spec = GrammarSpec("grammar", choice_grammar(params.choice or ()))
    else:
        raise InvalidRequestError("structured_outputs needs exactly one constraint",
                                  "structured_outputs")
    if len(spec.text) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"structured_outputs.{kind} is longer than "
                                  f"{MAX_SPEC_CHARS} characters", "structured_outputs")
    return spec


def _text(value: object, kind: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"structured_outputs.{kind} must be a non-empty string",
                                  "structured_outputs")
    return value


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF matching exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    if not choices or len(choices) > MAX_CHOICES or not all(
            isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(
            f"structured_outputs.choice must be 1 to {MAX_CHOICES} non-empty strings",
            "structured_outputs")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def native_message(exc: BaseException) -> str:
    """xgrammar's error text without its source-location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", text)[:500]


def build_grammar(spec: GrammarSpec):  # -> xgrammar.Grammar
    """The tokenizer-free grammar of ``spec``; raise InvalidRequestError when it is bad."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=ANY_WHITESPACE)
        if spec.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex",
                "grammar": "grammar"}[spec.kind]
        raise InvalidRequestError(f"invalid {what}: {native_message(exc)}",
                                  "structured_outputs") from None


def import_grammar_engine() -> None:
    """Import xgrammar (a second or more): a server does it on a thread at startup, so the
    first constrained request does not pay for it on the event loop."""
    import xgrammar  # noqa: F401


def check_spec(params: StructuredOutputsParams) -> None:
    """Raise InvalidRequestError unless ``params`` compiles (no tokenizer needed)."""
    build_grammar(grammar_spec(params))
