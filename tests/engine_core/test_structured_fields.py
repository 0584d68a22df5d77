"""The OpenAI layer's output-constraint fields -> StructuredOutputsParams, and their 400s."""

from __future__ import annotations

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.server.protocol import parse_chat_request, parse_completion_request
from engine_core.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def chat(**fields):
    return parse_chat_request({**CHAT, **fields}).sampling_params.structured_outputs


def completion(**fields):
    return parse_completion_request({**COMPLETION, **fields}).sampling_params.structured_outputs


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputsParams(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutputsParams(json={"type": "integer"})),
    ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
])
def test_every_field_maps_onto_one_constraint(parse, fields, expected) -> None:
    assert parse(**fields) == expected


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize("fields, field", [
    # two constraints at once
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    # unknown constraints and malformed values
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    # specs that do not build: bad schema, regex, grammar
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"guided_grammar": 'root ::= "a" | b'}, "guided_grammar"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400s_naming_the_field(parse, fields, field) -> None:
    with pytest.raises(InvalidRequestError) as error:
        parse(**fields)
    assert error.value.param == field


def test_choice_with_quotes_and_escapes_builds() -> None:
    choices = ['say "hi"', "back\\slash", "new\nline", "café 世界"]
    assert chat(guided_choice=choices) == StructuredOutputsParams(choice=tuple(choices))
