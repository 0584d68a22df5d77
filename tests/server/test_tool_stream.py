"""A chat answer's tool calls as OpenAI sends them, streamed and whole."""

from __future__ import annotations

import json

from engine_core.output_processor import RequestDelta
from engine_core.server import protocol
from engine_core.server.tool_stream import ChatTools
from engine_core.server.tools import ToolCallOptions

HERMES = ToolCallOptions(True, "hermes")
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
ANSWER = ('I will call.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}


def _tools(num_choices=1, options=HERMES, **body) -> ChatTools:
    request = protocol.parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                                           "tools": TOOLS, **body}).tools
    return ChatTools(request, options, "req-1", [1, 2, 3], num_choices)


def _delta(text, finished=False) -> RequestDelta:
    return RequestDelta("r", text, [7], None, 3, 0, 1, finished=finished,
                        finish_reason="stop" if finished else None)


def _stream(tools: ChatTools, pieces: list[str]) -> list[dict]:
    chunks = []
    for number, piece in enumerate(pieces):
        chunks += tools.chunks(HEAD, 0, _delta(piece, number == len(pieces) - 1), False)
    return chunks


def _assemble(chunks: list[dict]) -> dict:
    """What the openai client builds from the deltas."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id", entry["id"])
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
        finish = choice["finish_reason"] or finish
    return {"content": content or None,
            "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            "finish": finish}


def _whole(tools: ChatTools, text: str) -> dict:
    message = tools.message(0, text)
    return {"content": message["content"],
            "calls": [(c["id"], c["function"]["name"], c["function"]["arguments"])
                      for c in message.get("tool_calls", [])],
            "finish": tools.finish_reason(0, "stop")}


def test_streamed_deltas_follow_openai_and_agree_with_the_whole_answer() -> None:
    chunks = _stream(_tools(), list(ANSWER))
    firsts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
              if "id" in (c["choices"][0]["delta"].get("tool_calls") or [{}])[0]]
    assert [(f["index"], f["type"], f["function"]) for f in firsts] == [
        (0, "function", {"name": "a", "arguments": ""}),
        (1, "function", {"name": "b", "arguments": ""})]
    assert all(f["id"].startswith("call_") for f in firsts)
    assert not any("<" in (c["choices"][0]["delta"].get("content") or "") for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    streamed = _assemble(chunks)
    assert streamed == _whole(_tools(), ANSWER)
    assert streamed["content"] == "I will call."
    assert [json.loads(arguments) for _, _, arguments in streamed["calls"]] == [{"x": [1, 2]}, {}]


def test_call_ids_are_stable_for_a_request_so_a_continued_stream_keeps_them() -> None:
    assert _tools().call_id(0, 1) == _tools().call_id(0, 1) != _tools().call_id(1, 1)
    continued = _tools()
    continued.prime(0, ANSWER[:60])  # the client has these from another worker
    rest = _assemble(continued.chunks(HEAD, 0, _delta(ANSWER[60:], True), False))
    assert rest["finish"] == "tool_calls"
    assert rest["calls"][-1][0] == _tools().call_id(0, 1)


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    tools = _tools(parallel_tool_calls=False)
    assert [name for _, name, _ in _assemble(_stream(tools, [ANSWER]))["calls"]] == ["a"]
    assert [c["function"]["name"] for c in _tools(parallel_tool_calls=False)
            .message(0, ANSWER)["tool_calls"]] == ["a"]


def test_an_answer_without_calls_is_its_text() -> None:
    tools = _tools()
    assert tools.message(0, "plain text ") == {"role": "assistant", "content": "plain text "}
    assert tools.finish_reason(0, "stop") == "stop"


def test_a_named_choice_streams_its_arguments_and_finishes_with_stop() -> None:
    tools = _tools(options=ToolCallOptions(),
                   tool_choice={"type": "function", "function": {"name": "b"}})
    chunks = _stream(tools, ['{"q":', ' "x"}'])
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {
        "name": "b", "arguments": ""}
    assembled = _assemble(chunks)
    assert assembled["calls"][0][1:] == ("b", '{"q": "x"}') and assembled["finish"] == "stop"


def test_required_reads_the_array_of_calls() -> None:
    tools = _tools(options=ToolCallOptions(), tool_choice="required")
    text = '[{"name": "b", "parameters": {"k": 1}}, {"name": "a", "parameters": {}}]'
    assert _assemble(_stream(tools, list(text))) == _whole(_tools(
        options=ToolCallOptions(), tool_choice="required"), text)
    assert [c["function"]["arguments"] for c in tools.message(0, text)["tool_calls"]] == \
        ['{"k": 1}', "{}"]
