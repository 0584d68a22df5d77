"""A request whose client closed its connection before the handler started starts no engine
work, and the server says so at INFO, without a traceback.

aiohttp cancels a running handler when its connection closes; one that closed before the
handler started cancels nothing. A decode worker's request then waited in the engine for
remote KV, holding blocks, until its load timed out and was recomputed for nobody (a proxy
abandons its decode leg that way when its prefill worker turns out dead)."""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from engine_core.demo_model import random_demo_model_path
from engine_core.server.http_errors import REQUEST_ID_KEY, error_middleware
from engine_core.server.metrics import ServerMetrics
from engine_core.server.serving import OpenAIServing
from engine_core.server.tokenization import TokenizerService


class _RecordingClient:
    def __init__(self) -> None:
        self.started: list[str] = []

    async def generate(self, request_id: str, *args: Any, **kwargs: Any):
        self.started.append(request_id)
        raise AssertionError("no engine work for a client already gone")
        yield  # an async generator


def _request(closing: bool):
    transport = mock.Mock()
    transport.is_closing.return_value = closing
    request = make_mocked_request("POST", "/v1/completions", transport=transport)
    request[REQUEST_ID_KEY] = "r1"
    return request


@pytest.mark.asyncio
async def test_no_engine_request_for_a_client_already_gone(caplog) -> None:
    tokenizer = TokenizerService.load(str(random_demo_model_path()), 256, 1000)
    client = _RecordingClient()
    serving = OpenAIServing(client, tokenizer, ["demo"], ServerMetrics("demo"))
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t",
                                   "remote_kv_address": "127.0.0.1:1"}}

    async def handler(request):
        return await serving.completions(request, dict(body))

    with caplog.at_level(logging.INFO, logger="pdserve.server"):
        response = await error_middleware(_request(closing=True), handler)
    assert client.started == []
    assert response.status >= 400
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert gone and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    with pytest.raises(AssertionError, match="no engine work"):
        await serving.completions(_request(closing=False), dict(body))
    assert client.started  # an open connection does start it
    tokenizer.close()
