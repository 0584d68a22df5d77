"""Through the API server: the generation config's eos ids stop requests and its sampling
values are defaults (--generation-config), and chat template options reach the template."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import aiohttp
import pytest

from tests.server.conftest import ServerHandle, demo_engine_config

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
IM_END = 2  # in the demo checkpoint's generation_config.json eos ids, not in config.json's


async def _post(url: str, auth: dict, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=auth) as response:
            return response.status, await response.json()


async def test_generation_config_eos_stops_a_chat(server, auth):
    """vLLM: "stop" after one token, the id as stop_reason, no text (was: 6 tokens,
    "length")."""
    body = {"messages": MSG, "max_tokens": 6, "logit_bias": {str(IM_END): 100}}
    status, got = await _post(server.url, auth, CHAT, body)
    assert status == 200, got
    choice = got["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", IM_END)
    assert choice["message"]["content"] == "" and got["usage"]["completion_tokens"] == 1
    status, got = await _post(server.url, auth, CHAT, {**body, "ignore_eos": True})
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 6
    status, got = await _post(server.url, auth, C, {"prompt": "hi", "max_tokens": 6,
                                                    "logit_bias": {str(IM_END): 100}})
    assert got["choices"][0]["stop_reason"] == IM_END


async def test_chat_template_options_reach_the_template(server, auth):
    status, got = await _post(server.url, auth, CHAT, {
        "messages": MSG, "max_tokens": 1, "chat_template_kwargs": {"tokenize": True}})
    assert status == 400 and got["error"]["param"] == "chat_template_kwargs"
    status, got = await _post(server.url, auth, CHAT, {
        "messages": MSG, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
    messages = [*MSG, {"role": "assistant", "content": "Sure"}]
    closed = await _post(server.url, auth, CHAT, {"messages": messages, "max_tokens": 1,
                                                  "add_generation_prompt": False})
    left_open = await _post(server.url, auth, CHAT, {"messages": messages, "max_tokens": 1,
                                                     "add_generation_prompt": False,
                                                     "continue_final_message": True})
    # ChatML closes the message with "<|im_end|>\n": two tokens fewer when left open.
    assert (closed[1]["usage"]["prompt_tokens"] - left_open[1]["usage"]["prompt_tokens"]) == 2


@pytest.fixture(scope="module")
def greedy_server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server whose --generation-config folder asks for greedy decoding."""
    from engine_core.server.api_server import ServerOptions

    folder = tmp_path_factory.mktemp("greedy-generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                              "top_p": 0.5}))
    config = demo_engine_config(demo_checkpoint)
    config = config.with_changes(model=dataclasses.replace(
        config.model, generation_config=str(folder),
        override_generation_config={"top_p": 1.0}))
    handle = ServerHandle(config, ServerOptions(log_stats_interval_s=0))
    yield handle
    handle.stop()


async def test_generation_config_sampling_defaults(greedy_server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "ignore_eos": True}
    status, got = await _post(greedy_server.url, {}, C, body)
    assert status == 200, got
    texts = {c["text"] for c in got["choices"]}
    _, explicit = await _post(greedy_server.url, {}, C, {**body, "temperature": 0, "n": 1})
    assert texts == {explicit["choices"][0]["text"]}  # greedy, as the default asks
    _, sampled = await _post(greedy_server.url, {}, C, {**body, "temperature": 1.5, "n": 8,
                                                        "seed": 1})
    assert len({c["text"] for c in sampled["choices"]}) > 1  # the request's value wins

