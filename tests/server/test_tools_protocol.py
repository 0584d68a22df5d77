"""Tool requests: validation (a 400 naming the bad tool), tool_choice, the constraint a
forced choice sets, tool messages, and the chat template rendering tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.errors import ConfigError, InvalidRequestError
from engine_core.server import protocol
from engine_core.server.tokenization import TokenizerService
from engine_core.server.tools import ToolCallOptions

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy/configs/tool_chat_template_hermes.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(**body):
    return protocol.parse_chat_request({"messages": USER, **body})


def test_tools_default_to_auto_and_keep_the_request_tools_for_the_template() -> None:
    parsed = _chat(tools=[WEATHER, TIME])
    assert parsed.tools.choice == "auto" and parsed.tools.parallel
    assert parsed.template.tools == [WEATHER, TIME]
    assert parsed.sampling_params.structured_outputs is None
    assert parsed.tools.functions[1].parameters == {"type": "object", "properties": {}}


def test_required_constrains_the_output_to_an_array_of_calls() -> None:
    parsed = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = parsed.sampling_params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == \
        WEATHER["function"]["parameters"]
    assert "maxItems" not in _chat(tools=[WEATHER], tool_choice="required") \
        .sampling_params.structured_outputs.json


def test_required_moves_the_tools_defs_to_the_root_where_refs_resolve() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tool = {"type": "function", "function": {"name": "draw", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}},
        "$defs": {"point": point}}}}
    schema = _chat(tools=[tool, TIME], tool_choice="required") \
        .sampling_params.structured_outputs.json
    assert schema["$defs"] == {"point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    import jsonschema

    jsonschema.validate([{"name": "draw", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "draw", "parameters": {"at": {"x": "one"}}}], schema)
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"point": {"type": "string"}}}}}
    with pytest.raises(InvalidRequestError, match="point"):
        _chat(tools=[tool, other], tool_choice="required")


def test_a_named_choice_constrains_the_output_to_its_parameters() -> None:
    parsed = _chat(tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert parsed.tools.choice == "function" and parsed.tools.function_name == "get_weather"
    assert parsed.sampling_params.structured_outputs.json == WEATHER["function"]["parameters"]


def test_none_sets_no_constraint() -> None:
    parsed = _chat(tools=[WEATHER], tool_choice="none")
    assert parsed.tools.choice == "none" and parsed.sampling_params.structured_outputs is None


@pytest.mark.parametrize(("body", "names"), [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "(f)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "(f)"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "string"}}}]}, "(f)"),
    ({"tools": [WEATHER, WEATHER]}, "get_weather"),
    ({"tools": "get_weather"}, "tools"),
])
def test_a_bad_tool_is_refused_naming_it(body, names) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        _chat(**body)
    assert exc.value.param == "tools" and names in str(exc.value)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_a_bad_tool_choice_is_refused(body, param) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        _chat(**body)
    assert exc.value.param == param


def test_auto_needs_the_server_flags_as_in_vllm() -> None:
    tools = _chat(tools=[WEATHER]).tools
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        tools.check_auto(ToolCallOptions())
    tools.check_auto(ToolCallOptions(True, "hermes"))
    _chat(tools=[WEATHER], tool_choice="required").tools.check_auto(ToolCallOptions())


def test_server_tool_flags_are_checked() -> None:
    with pytest.raises(ConfigError):
        ToolCallOptions(True, None)
    with pytest.raises(ConfigError):
        ToolCallOptions(False, "no-such-parser")


def test_tool_messages_reach_the_template_with_arguments_as_objects() -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = protocol.parse_chat_request({"messages": messages, "tools": [WEATHER]})
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message", [
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "tool_calls": {"function": {"name": "f"}}},
    {"role": "tool", "content": "x", "tool_call_id": 5},
])
def test_bad_tool_messages_are_refused(message) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        protocol.parse_chat_request({"messages": [*USER, message]})
    assert exc.value.param == "messages"


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from engine_core.demo_model import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_the_template_renders_tools_and_tool_turns(demo_tokenizer) -> None:
    service = TokenizerService(demo_tokenizer, 4096, 1000, chat_template=TEMPLATE.read_text())
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny, 21 C"}]
    parsed = protocol.parse_chat_request({"messages": messages, "tools": [WEATHER]})
    text = service.render_chat(parsed.messages, True, parsed.template)
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert service.encode_chat(parsed.messages, True, None, parsed.template)


def test_a_template_without_tools_is_a_clear_400(demo_tokenizer) -> None:
    service = TokenizerService(demo_tokenizer, 4096, 1000)  # the demo's plain ChatML
    parsed = _chat(tools=[WEATHER])
    with pytest.raises(InvalidRequestError, match="does not render tools") as exc:
        service.encode_chat(parsed.messages, True, None, parsed.template)
    assert exc.value.param == "tools"


def test_the_chat_template_flag_takes_a_file_or_a_template(tmp_path) -> None:
    from engine_core.server.server_args import chat_template_text

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert chat_template_text(str(path)) == "{{ messages }}"
    assert chat_template_text("{% for m in messages %}{% endfor %}").startswith("{%")
    assert chat_template_text(None) is None
    with pytest.raises(ConfigError, match="no such file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
