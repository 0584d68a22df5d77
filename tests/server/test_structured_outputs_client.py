"""Structured outputs through the official openai client against a real server on the
random-weight demo model: generated JSON schemas always validate, regex and choice always
match, a streamed answer equals the whole one, and bad constraints are 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.structured_schemas import generated_schemas

MAX_TOKENS = 128
REGEX = r"[a-z]{1,4}@[a-z]{1,4}\.(com|org)"


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _schema_answer(oai: openai.OpenAI, schema: dict) -> tuple[str, str | None]:
    reply = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Answer in JSON."}],
        max_completion_tokens=MAX_TOKENS, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason


def test_fifty_generated_schemas_parse_and_validate(oai, server) -> None:
    schemas = generated_schemas(50)
    with ThreadPoolExecutor(len(schemas)) as pool:
        answers = list(pool.map(lambda s: _schema_answer(oai, s), schemas))
    for schema, (text, finish_reason) in zip(schemas, answers):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert server.wait_idle().num_free_blocks == server.initial_free_blocks


def test_regex_and_choice_match_on_both_endpoints(oai) -> None:
    for _ in range(3):
        done = oai.completions.create(model=MODEL_NAME, prompt="mail:", max_tokens=32,
                                      temperature=1.0, extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, done.choices[0].text), done.choices[0].text
        chat = oai.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "pick"}], max_tokens=8,
            temperature=1.0, n=4,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
        assert {c.message.content for c in chat.choices} <= {"alpha", "beta", "gamma"}


def test_json_object_answer_is_a_json_object(oai) -> None:
    # Any JSON object may nest without bound: ask for a few and accept only a finished one.
    reply = oai.completions.create(model=MODEL_NAME, prompt="{", max_tokens=64, temperature=0,
                                   n=1, extra_body={"response_format": {"type": "json_object"}})
    text = reply.choices[0].text
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_answer_equals_whole(oai, endpoint) -> None:
    schema = generated_schemas(3, seed=5)[2]
    kwargs = dict(model=MODEL_NAME, temperature=0.9, seed=11)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    if endpoint == "chat":
        kwargs.update(messages=[{"role": "user", "content": "go"}], max_tokens=MAX_TOKENS,
                      response_format=fmt)
        whole = oai.chat.completions.create(**kwargs).choices[0].message.content
        stream = oai.chat.completions.create(stream=True, **kwargs)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    else:
        kwargs.update(prompt="go", max_tokens=MAX_TOKENS, extra_body={"guided_json": schema})
        whole = oai.completions.create(**kwargs).choices[0].text
        stream = oai.completions.create(stream=True, **kwargs)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(oai, server, extra, field) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert error.value.body.get("param") == field
    assert server.wait_idle().num_free_blocks == server.initial_free_blocks
