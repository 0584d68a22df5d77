"""The OpenAI and vLLM request fields that constrain the output, mapped onto the one
``StructuredOutputsParams``: ``response_format`` (json_object, json_schema), vLLM's
``structured_outputs`` object and the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one constraint per request; each is checked
by building its grammar here, so a bad schema, regex or grammar is a 400 naming its field
before any engine work.
"""

from __future__ import annotations

import json
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.grammar.spec import check_spec
from engine_core.structured_outputs import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
# vLLM's structured_outputs keys honoured here: each is one constraint.
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def needs_grammar_engine(body: dict[str, Any]) -> bool:
    """Whether parsing ``body`` builds a grammar: it names an output constraint or a tool
    choice that forces one (``required`` or a named function)."""
    return (any(body.get(name) is not None for name in STRUCTURED_FIELDS)
            or body.get("tool_choice") not in (None, "auto", "none"))


def structured_outputs_from(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's output constraint (None: unconstrained); InvalidRequestError names the
    field when it is malformed, when two are given, or when its grammar does not build."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        params = _response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, _constraint(name, kind, body[name])))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(
            f"only one output constraint is allowed; got {[name for name, _ in found]}",
            found[1][0])
    name, params = found[0]
    try:
        check_spec(params)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{name}: {exc}", name) from None
    return params


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("response_format must be an object with a type",
                                  "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r:.64}",
            "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object",
                                  "response_format")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("response_format.json_schema.name must be a string",
                                  "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                  "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema "
                                  "object", "response_format")
    return StructuredOutputsParams(json=schema)


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
    given = {key: v for key, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_CONSTRAINT_KEYS))
    if unknown:
        raise InvalidRequestError(f"structured_outputs fields {unknown} are not supported "
                                  f"(one of {list(_CONSTRAINT_KEYS)} is)", "structured_outputs")
    if len(given) != 1:
        raise InvalidRequestError(
            f"structured_outputs needs exactly one of {list(_CONSTRAINT_KEYS)}, got "
            f"{sorted(given)}", "structured_outputs")
    (key, constraint), = given.items()
    if key == "json_object":
        if constraint is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true",
                                      "structured_outputs")
        return StructuredOutputsParams(json_object=True)
    return _constraint("structured_outputs", key, constraint)


def _constraint(field: str, kind: str, value: Any) -> StructuredOutputsParams:
    """One constraint of ``kind`` from the value of ``field``, type-checked."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequestError(f"{field}: the JSON schema is not valid JSON",
                                          field) from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field}: the JSON schema must be an object", field)
        return StructuredOutputsParams(json=value)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequestError(f"{field}: choice must be a non-empty list of non-empty "
                                      "strings", field)
        return StructuredOutputsParams(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{field}: {kind} must be a non-empty string", field)
    return StructuredOutputsParams(**{kind: value})
