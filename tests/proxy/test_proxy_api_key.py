"""The proxy's API key: every route but /health, /ping and /ready needs it, /instances
always does (loopback only without a key), and the proxy sends it on to the workers."""

from __future__ import annotations

import pytest

KEY = "proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _check_json_401(status: int, body: dict) -> None:
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert "API key" in body["error"]["message"]


@pytest.mark.parametrize("method,path", [
    ("GET", "/instances"), ("GET", "/metrics"), ("POST", "/tokenize"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/version"),
    ("GET", "/no/such/route"),
])
async def test_every_route_but_the_probes_needs_the_key(make_worker, make_proxy, method: str,
                                                        path: str) -> None:
    client = await make_proxy(await make_worker("D"), api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = await client.request(method, path, json=COMPLETION, headers=headers)
        _check_json_401(response.status, await response.json())
    response = await client.request(method, path, json=COMPLETION, headers=AUTH)
    assert response.status != 401


async def test_the_probes_need_no_key(make_worker, make_proxy) -> None:
    client = await make_proxy(await make_worker("D"), api_key=KEY)
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                         ("GET", "/ready")):
        assert (await client.request(method, path)).status == 200


async def test_the_key_goes_on_to_the_workers(make_worker, make_proxy) -> None:
    """Workers launched with the cluster's key accept the proxy's legs: each carries it."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await make_proxy(p, d, api_key=KEY)
    response = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
    assert response.status == 200, await response.text()
    assert p.authorizations == [f"Bearer {KEY}"]
    assert d.authorizations == [f"Bearer {KEY}"]


async def test_without_a_key_instances_answers_loopback_clients(make_worker, make_proxy) -> None:
    """(Clients off the host are refused: tests/server/test_http_edges.py.)"""
    client = await make_proxy(await make_worker("D"))
    response = await client.get("/instances")
    assert response.status == 200
    assert (await response.json())["workers"]
