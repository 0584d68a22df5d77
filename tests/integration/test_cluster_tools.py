"""Tool calling through a live 1P1D CPU cluster (real processes, `pdserve launch`'s wiring
with --chat-template, --enable-auto-tool-choice and --tool-call-parser forwarded to the
workers), with the official openai client: every answer, streamed (P's first token handed
over, D continuing) or whole, is the one a single worker gives.

Forced choices (``required``, a named function) always call with valid JSON arguments only
with the grammar engine masking the sampler; that test fails where it is not built in.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    build_tiny_checkpoint,
    labelled_counter,
)

# A short Hermes-style template: the tiny cluster's context is 256 tokens.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["q"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "a fox"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tools")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    built = Cluster.build(tmp / "logs", build_tiny_checkpoint(tmp / "ckpt"), num_prefill=1,
                          num_decode=1, launch_flags=[
                              "--chat-template", str(template), "--enable-auto-tool-choice",
                              "--tool-call-parser", "hermes"])
    try:
        built.start([built.proxy, *built.workers])
        built.wait_ready(built.workers)
        yield built
    finally:
        built.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _answer(client: openai.OpenAI, stream: bool, **request) -> dict:
    """Content, calls (name, arguments) and finish reason, streamed or whole."""
    if not stream:
        answer = client.chat.completions.create(model=MODEL, **request)
        message = answer.choices[0].message
        return {"content": message.content, "finish": answer.choices[0].finish_reason,
                "calls": [(c.function.name, c.function.arguments)
                          for c in message.tool_calls or []]}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        choice = chunk.choices[0]
        assert "<tool_call>" not in (choice.delta.content or "")
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.function.arguments == "" and call.index not in calls
                calls[call.index] = [call.function.name, ""]
            else:
                calls[call.index][1] += call.function.arguments
        finish = choice.finish_reason or finish
    return {"content": content or None, "finish": finish,
            "calls": [tuple(c) for _, c in sorted(calls.items())]}


REQUESTS = [
    {"messages": USER, "tools": [LOOKUP], "max_tokens": 12, "temperature": 0},
    {"messages": USER, "tools": [LOOKUP], "max_tokens": 12, "temperature": 1.0, "seed": 5},
    {"messages": USER, "tools": [LOOKUP], "tool_choice": "none", "max_tokens": 8,
     "temperature": 0},
    {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"q": "fox"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
     "tools": [LOOKUP], "max_tokens": 4, "temperature": 0},
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tool_answers_through_the_cluster_match_a_single_worker(cluster) -> None:
    proxy = _client(cluster.url)
    direct = _client(f"http://{cluster.workers[1].http_address}")  # the decode worker alone
    for request in REQUESTS:
        want = _answer(direct, False, **request)
        for stream in (False, True):
            assert _answer(proxy, stream, **request) == want, (request, stream)
    handoffs = labelled_counter(cluster.url.removeprefix("http://"),
                                "pdserve:proxy_first_token_handoffs")
    assert handoffs.get("prefill") == len(REQUESTS), handoffs  # every stream took it


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "lookup"}}],
                         ids=["required", "named"])
def test_forced_tool_choices_always_call_through_the_cluster(cluster, choice) -> None:
    import jsonschema

    proxy = _client(cluster.url)
    for seed in range(10):
        request = {"messages": USER, "tools": [LOOKUP], "tool_choice": choice,
                   "max_tokens": 60, "temperature": 1.0, "seed": seed}
        whole = _answer(proxy, False, **request)
        assert [name for name, _ in whole["calls"]][:1] == ["lookup"], whole
        for _, arguments in whole["calls"]:
            jsonschema.validate(json.loads(arguments), LOOKUP["function"]["parameters"])
        assert _answer(proxy, True, **request) == whole
