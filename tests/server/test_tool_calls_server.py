"""Tool calling through the official openai client against a real server (demo model,
random weights: only the format matters).

``tool_choice="required"`` and a named function must ALWAYS answer with tool calls whose
arguments are valid JSON: that holds only with the grammar engine masking the sampler
(``SamplingParams.structured_outputs``), so those tests fail where it is not built in.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from engine_core.config import ModelConfig
from engine_core.server.streaming import TOKEN_IDS_COMMENT
from tests.server.conftest import API_KEY, MODEL_NAME, ServerHandle, demo_engine_config

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy/configs/tool_chat_template_hermes.jinja"
# Strings are bounded by patterns: random weights pick among the allowed tokens nearly
# uniformly, and xgrammar 0.2.8 lets a string with only a maxLength hold control characters.
MAX_MODEL_LEN = 1024  # the template's tool prompt is ~400 demo tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NUM_FORCED = 10


@pytest.fixture(scope="module")
def tool_server(demo_checkpoint: Path) -> ServerHandle:
    from engine_core.server.api_server import ServerOptions
    from engine_core.server.tools import ToolCallOptions

    config = demo_engine_config(demo_checkpoint)
    config = dataclasses.replace(config, model=ModelConfig(
        model=str(demo_checkpoint), max_model_len=MAX_MODEL_LEN, served_model_name=MODEL_NAME))
    options = ServerOptions(api_key=API_KEY, log_stats_interval_s=0,
                            tool_calls=ToolCallOptions(True, "hermes"),
                            chat_template=TEMPLATE.read_text())
    handle = ServerHandle(config, options)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def oai(tool_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0)


def _streamed(oai: openai.OpenAI, **request) -> dict:
    """A streamed answer assembled as a client does: content, calls, finish reason."""
    content, calls, finish, raw_markup = "", {}, None, False
    for chunk in oai.chat.completions.create(model=MODEL_NAME, stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        raw_markup |= "<tool_call>" in (choice.delta.content or "")
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: id, type, name, empty arguments
                assert call.index not in calls and call.type == "function"
                assert call.function.arguments == ""
                calls[call.index] = [call.id, call.function.name, ""]
            else:
                assert call.function.name is None
                calls[call.index][2] += call.function.arguments
        finish = choice.finish_reason or finish
    return {"content": content or None, "calls": [tuple(c) for _, c in sorted(calls.items())],
            "finish": finish, "raw_markup": raw_markup}


def _whole(oai: openai.OpenAI, **request) -> dict:
    answer = oai.chat.completions.create(model=MODEL_NAME, **request)
    message = answer.choices[0].message
    return {"content": message.content,
            "calls": [(c.id, c.function.name, c.function.arguments)
                      for c in message.tool_calls or []],
            "finish": answer.choices[0].finish_reason, "raw_markup": False}


def _answers(answer: Callable[..., dict], oai: openai.OpenAI, requests: list[dict]
             ) -> list[dict]:
    """``answer(oai, **request)`` for every request, all sent at once so that the engine
    batches them (each seeded: its tokens do not depend on its batch)."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: answer(oai, **request), requests))


def _same_answer(streamed: dict, whole: dict) -> None:
    """Streamed == whole (call ids name the request, so only names and arguments)."""
    assert not streamed["raw_markup"]
    assert streamed["content"] == whole["content"]
    assert [c[1:] for c in streamed["calls"]] == [c[1:] for c in whole["calls"]]
    assert streamed["finish"] == whole["finish"]


def test_auto_answers_stream_as_they_answer_whole(oai) -> None:
    requests = [{"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 24,
                 "temperature": 1.0, "seed": seed} for seed in range(3)]
    for request, whole, streamed in zip(requests, _answers(_whole, oai, requests),
                                        _answers(_streamed, oai, requests), strict=True):
        _same_answer(streamed, whole)
        assert whole["finish"] in ("stop", "length", "tool_calls"), request


def test_a_conversation_with_tool_turns_is_served(oai) -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = oai.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                         max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > 400  # the tools and the tool turn were rendered


def test_a_bad_tool_is_a_400_naming_it(oai) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                        "required": "city"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[WEATHER, bad])
    assert "tools[1] (f)" in str(exc.value)


def test_auto_without_the_server_flags_is_a_400(server) -> None:
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        plain.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        plain.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[WEATHER],
                                      tool_choice="none")


def _check_arguments(call: tuple, tools: dict) -> None:
    import jsonschema

    _, name, arguments = call
    jsonschema.validate(json.loads(arguments), tools[name]["function"]["parameters"])


@pytest.mark.parametrize("parallel", [False, True], ids=["one_call", "parallel"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_always_calls_with_valid_arguments(oai, stream, parallel) -> None:
    """One call (``maxItems`` 1) ends the answer; random weights may add parallel calls
    until ``max_tokens`` cuts the last one, so only the calls before it must be whole."""
    tools = {t["function"]["name"]: t for t in (WEATHER, TIME)}
    requests = [{"messages": USER, "tools": list(tools.values()), "tool_choice": "required",
                 "parallel_tool_calls": parallel, "max_tokens": 120, "temperature": 1.0,
                 "seed": seed} for seed in range(NUM_FORCED)]
    answers = _answers(_streamed if stream else _whole, oai, requests)
    wholes = _answers(_whole, oai, requests) if stream else answers
    for answer, whole in zip(answers, wholes, strict=True):
        assert answer["calls"], answer
        if not parallel:
            assert len(answer["calls"]) == 1 and answer["finish"] == "tool_calls", answer
        whole_calls = answer["calls"][:-1] if answer["finish"] == "length" else answer["calls"]
        assert whole_calls or answer["finish"] != "tool_calls"
        for call in whole_calls:
            _check_arguments(call, tools)
        if stream:
            _same_answer(answer, whole)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_always_called_with_valid_arguments(oai, stream) -> None:
    tools = {t["function"]["name"]: t for t in (WEATHER, TIME)}
    requests = [{"messages": USER, "tools": list(tools.values()), "max_tokens": 120,
                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                 "temperature": 1.0, "seed": seed} for seed in range(NUM_FORCED)]
    answers = _answers(_streamed if stream else _whole, oai, requests)
    wholes = _answers(_whole, oai, requests) if stream else answers
    for answer, whole in zip(answers, wholes, strict=True):
        assert [c[1] for c in answer["calls"]] == ["get_weather"], answer
        _check_arguments(answer["calls"][0], tools)
        assert answer["finish"] == "stop"
        if stream:
            _same_answer(answer, whole)


def _assembled(events: list[dict]) -> dict:
    """Content and calls (id, name, arguments) a client builds from chat stream events."""
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", "", ""])
                entry[0] += call.get("id", "")
                entry[1] += call.get("function", {}).get("name") or ""
                entry[2] += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"content": content, "calls": calls, "finish": finish}


def _writes(raw: bytes) -> list[tuple[list[int], list[dict]]]:
    """(token ids, events) of each write of a stream asked for ``stream_token_ids``: a
    write begins with the line naming its tokens (one delta's events share it)."""
    writes: list[tuple[list[int], list[dict]]] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(TOKEN_IDS_COMMENT):
            line, _, block = block.partition(b"\n")
            writes.append(([int(t) for t in line[len(TOKEN_IDS_COMMENT):].split(b",") if t],
                           []))
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            if not writes:
                writes.append(([], []))
            writes[-1][1].append(json.loads(block[len(b"data: "):]))
    return writes


async def test_a_tool_stream_continued_elsewhere_keeps_its_calls(tool_server) -> None:
    """The worker's half of the handoff and of migration: a named call's stream cut
    between any two writes and continued from the token ids sent glues into the
    uninterrupted stream, the call's id, name and arguments included."""
    import aiohttp

    body = {"model": MODEL_NAME, "messages": USER, "tools": [WEATHER], "temperature": 0.0,
            "max_tokens": 16, "ignore_eos": True, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "tools-continued"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async def run(params: dict) -> list[tuple[list[int], list[dict]]]:
            async with session.post(tool_server.url + "/v1/chat/completions", json={
                    **body, "kv_transfer_params": {**params, "stream_token_ids": True}}) as r:
                assert r.status == 200, await r.text()
                return _writes(await r.read())

        whole = await run({})
        want = _assembled([e for _, events in whole for e in events])
        assert want["calls"][0][1] == "get_weather" and want["calls"][0][0].startswith("call_")
        assert any(len(events) > 1 for _, events in whole)  # the call's head and arguments
        for cut in range(1, len(whole)):
            sent = whole[:cut]
            rest = await run({"generated_token_ids": [[t for ids, _ in sent for t in ids]]})
            assert _assembled([e for _, events in sent + rest for e in events]) == want, cut
