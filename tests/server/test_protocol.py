"""Request-body validation, without a server."""

from __future__ import annotations

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.kv_transfer_params import KVTransferParams
from engine_core.server import protocol


def test_completion_request_fields():
    req = protocol.parse_completion_request({
        "model": "m", "prompt": ["a", [1, 2]], "max_tokens": 7, "temperature": 0,
        "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "logprobs": 2,
        "seed": 3, "kv_transfer_params": {"transfer_id": "t"}})
    assert req.prompts == ["a", [1, 2]]
    assert req.sampling_params.max_tokens == 7 and req.sampling_params.stop == ["x"]
    assert req.sampling_params.logprobs == 2 and req.sampling_params.seed == 3
    assert req.stream and req.include_usage
    assert req.kv_transfer_params == KVTransferParams(transfer_id="t")
    assert protocol.parse_completion_request({"prompt": [5, 6]}).prompts == [[5, 6]]
    assert protocol.parse_completion_request({"prompt": "x"}).sampling_params.max_tokens == 16


def test_chat_request_fields():
    req = protocol.parse_chat_request({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 5, "max_tokens": 9})
    assert req.messages == [{"role": "user", "content": "a\nb"}]  # joined as vLLM joins them
    assert req.sampling_params.logprobs == 3 and req.sampling_params.max_tokens == 5
    assert protocol.parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}]}).sampling_params.max_tokens is None


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_rejections_name_the_param(body, param):
    with pytest.raises(InvalidRequestError) as exc:
        protocol.parse_completion_request(body)
    assert exc.value.param == param


def test_parse_json_rejects_non_objects():
    for raw in (b"[1]", b"\xff", b"", b"null"):
        with pytest.raises(InvalidRequestError):
            protocol.parse_json(raw)


def test_prompt_logprobs_and_echo_set_the_engine_parameter():
    """prompt_logprobs is the engine's; echo with logprobs scores the prompt with the same k;
    chat takes prompt_logprobs too."""
    parse = protocol.parse_completion_request
    assert parse({"prompt": "x", "prompt_logprobs": 3}).sampling_params.prompt_logprobs == 3
    assert parse({"prompt": "x", "echo": True, "logprobs": 2}).sampling_params.prompt_logprobs == 2
    assert parse({"prompt": "x", "echo": True, "logprobs": 2, "stream": True}
                 ).sampling_params.prompt_logprobs == 2
    assert parse({"prompt": "x", "echo": True}).sampling_params.prompt_logprobs is None
    assert parse({"prompt": "x", "logprobs": 2}).sampling_params.prompt_logprobs is None
    chat = protocol.parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                        "prompt_logprobs": 0})
    assert chat.sampling_params.prompt_logprobs == 0
