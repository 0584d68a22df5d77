"""The tool-call parsers: whole answers, and the same answers streamed split anywhere."""

from __future__ import annotations

import json

import pytest

from engine_core.server.tool_parsers import TOOL_PARSERS
from engine_core.server.tool_parsers.events import (
    CallArguments,
    CallStarted,
    ContentText,
    ParsedCall,
    fold,
    parse_whole,
)
from engine_core.server.tool_parsers.hermes import HermesToolParser
from engine_core.server.tool_parsers.json_calls import (
    Llama3JsonToolParser,
    NamedCallParser,
    RequiredCallsParser,
)

WEATHER = '{"city": "Paris", "days": [1, {"note": "a } and a \\" and ]"}], "metric": true}'

# (parser factory, answer, expected content, expected [(name, arguments)])
CASES = [
    (HermesToolParser, "Just text, no calls.  ", "Just text, no calls.  ", []),
    (HermesToolParser, "a < b and <tool but no call", "a < b and <tool but no call", []),
    (HermesToolParser,
     f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    (HermesToolParser,
     'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.',
     "Let me look.Done.", [("a", '{"x": 1}'), ("b", "{}")]),
    # Keys in another order: judged whole at the closing tag.
    (HermesToolParser, '<tool_call>{"arguments": {"y": 2}, "name": "c"}</tool_call>',
     None, [("c", '{"y": 2}')]),
    # No call object inside the tags: content, tags and all.
    (HermesToolParser, "<tool_call>not json</tool_call> ok",
     "<tool_call>not json</tool_call> ok", []),
    # Cut off inside a call (max_tokens): what arrived stands.
    (HermesToolParser, '<tool_call>\n{"name": "a", "arguments": {"x": [1, 2',
     None, [("a", '{"x": [1, 2')]),
    (Llama3JsonToolParser, 'The answer is 4.', "The answer is 4.", []),
    (Llama3JsonToolParser, f'{{"name": "get_weather", "parameters": {WEATHER}}}',
     None, [("get_weather", WEATHER)]),
    (Llama3JsonToolParser,
     '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     None, [("a", '{"x": 1}'), ("b", "{}")]),
    (Llama3JsonToolParser, ' {"name": "a", "parameters": {"n": 12}} and then words',
     "and then words", [("a", '{"n": 12}')]),
    (Llama3JsonToolParser, '{"not": "a call"} text', '{"not": "a call"} text', []),
    (RequiredCallsParser,
     '[{"name": "a", "parameters": {"x": "]"}}, {"name": "b", "parameters": {}}]',
     None, [("a", '{"x": "]"}'), ("b", "{}")]),
    (lambda: NamedCallParser("get_weather"), f"  {WEATHER} ", None, [("get_weather", WEATHER)]),
]


def _expected(content, calls):
    return content, [ParsedCall(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize(("factory", "answer", "content", "calls"), CASES)
def test_whole_answer(factory, answer, content, calls) -> None:
    parsed = parse_whole(factory(), answer)
    assert (parsed.content, parsed.calls) == _expected(content, calls)
    for call in parsed.calls:
        if not answer.rstrip().endswith(("[1, 2",)):
            json.loads(call.arguments)


def _streamed(factory, pieces):
    parser = factory()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


@pytest.mark.parametrize(("factory", "answer", "content", "calls"), CASES)
def test_split_at_every_boundary_agrees(factory, answer, content, calls) -> None:
    expected = _expected(content, calls)
    one_by_one = fold(_streamed(factory, list(answer)))
    assert (one_by_one.content, one_by_one.calls) == expected
    for at in range(1, len(answer)):
        parsed = fold(_streamed(factory, [answer[:at], answer[at:]]))
        assert (parsed.content, parsed.calls) == expected, at


def test_stream_never_shows_markup_and_names_a_call_before_its_arguments() -> None:
    answer = 'Hi <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    events = _streamed(HermesToolParser, list(answer))
    text = "".join(e.text for e in events if isinstance(e, ContentText))
    assert "<" not in text and text == "Hi"
    kinds = [type(e) for e in events if not isinstance(e, ContentText)]
    assert kinds[0] is CallStarted and set(kinds[1:]) == {CallArguments}


def test_arguments_stream_before_the_call_ends() -> None:
    parser = HermesToolParser()
    events = parser.feed('<tool_call>{"name": "a", "arguments": {"text": "hello')
    assert CallStarted(0, "a") in events
    assert "".join(e.fragment for e in events if isinstance(e, CallArguments)) == \
        '{"text": "hello'


def test_registry_names_vllm_parsers() -> None:
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json"}
