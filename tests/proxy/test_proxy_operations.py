"""Operational edges of the proxy: aiohttp's own errors and multi-model clusters."""

from __future__ import annotations

import dataclasses

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.registry import InstanceRegistry

MODEL = "tiny"


def _check_openai_error(body: dict, status: int) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/completions", 405),
    ("PUT", "/v1/chat/completions", 405),
    ("POST", "/v1/nothing", 404),
    ("GET", "/v1/models/tiny", 404),
])
async def test_unknown_route_and_method_get_an_openai_error_body(make_worker, make_proxy,
                                                                 method, path, status) -> None:
    """OpenAI clients parse every error body as JSON; aiohttp's own 404/405 are plain text."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.request(method, path)
    assert resp.status == status
    assert resp.content_type == "application/json", await resp.text()
    _check_openai_error(await resp.json(), status)
    if status == 405:
        assert "Allow" in resp.headers


async def test_request_without_model_never_pairs_workers_of_different_models(make_worker) -> None:
    """With two models registered, a request naming none must not send P's KV of one
    model to a D of the other (prefix_affinity picks P and D independently, so such
    pairs happen): it is refused (400) naming the served models."""
    p_a, d_a = await make_worker("P"), await make_worker("D")
    p_b, d_b = await make_worker("P"), await make_worker("D")
    config = ProxyConfig(registration_port=None, routing="prefix_affinity")
    registry = InstanceRegistry(config.heartbeat_timeout_s, config.suspect_s)
    for worker, model in ((p_a, "model-a"), (d_a, "model-a"), (p_b, "model-b"), (d_b, "model-b")):
        registry.heartbeat(dataclasses.replace(worker.heartbeat(), model=model))
    client = TestClient(TestServer(create_app(config, registry=registry)))
    await client.start_server()
    try:
        for i in range(6):
            resp = await client.post("/v1/completions",
                                     json={"prompt": f"hi {i}", "max_tokens": 4})
            body = await resp.json()
            assert resp.status == 400, body
            _check_openai_error(body, 400)
            assert "model-a" in body["error"]["message"] and "model-b" in body["error"]["message"]
            assert body["error"]["param"] == "model"
        resp = await client.post("/tokenize", json={"prompt": "hi"})  # tokenizers differ too
        assert resp.status == 400
        assert not (p_a.received or d_a.received or p_b.received or d_b.received)
        # Naming a model still routes within it.
        resp = await client.post("/v1/completions",
                                 json={"model": "model-b", "prompt": "hi", "max_tokens": 4})
        assert resp.status == 200
        assert len(p_b.received) == len(d_b.received) == 1
    finally:
        await client.close()


async def test_request_without_model_is_served_when_one_model_is_registered(make_worker,
                                                                           make_proxy) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d)
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status == 200
    assert len(p.received) == len(d.received) == 1
