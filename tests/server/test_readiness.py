"""A worker's ``/ready``: 200 only while its heartbeats reach the proxy and it is not
draining; while draining, new generation requests are a 503 the proxy retries elsewhere."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine_core.cluster.registration_client import RegistrationClient
from engine_core.errors import ShuttingDownError
from engine_core.server import api_server
from engine_core.server.http_errors import exception_body
from engine_core.server.readiness import Readiness
from proxy.registration import RegistrationServer
from proxy.registry import InstanceRegistry


def _routes(readiness: Readiness) -> Any:
    serving = SimpleNamespace(client=None)
    return api_server._Routes(serving, options=None, model_path="m",  # type: ignore[arg-type]
                              readiness=readiness)


async def test_ready_is_200_without_checks_and_503_naming_what_fails() -> None:
    registered = False
    readiness = Readiness()
    routes = _routes(readiness)
    assert (await routes.ready(None)).status == 200
    readiness.add_check("proxy_registration", lambda: registered)
    response = await routes.ready(None)
    assert response.status == 503
    assert json.loads(response.body) == {"ready": False, "waiting_for": ["proxy_registration"]}
    registered = True
    assert (await routes.ready(None)).status == 200
    readiness.draining = True
    response = await routes.ready(None)
    assert response.status == 503 and json.loads(response.body)["waiting_for"] == ["draining"]


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_draining_server_refuses_new_generation_requests_with_a_503(route: str) -> None:
    routes = _routes(Readiness(draining=True))
    with pytest.raises(ShuttingDownError) as caught:
        await getattr(routes, route)(None)  # refused before the body is read
    status, body = exception_body(caught.value)
    assert status == 503 and "shutting down" in body["error"]["message"]


async def test_registration_client_is_registered_only_while_its_heartbeats_leave() -> None:
    client = RegistrationClient("127.0.0.1:1", role="D", http_address="127.0.0.1:9",
                                model="m", zmq_address="127.0.0.1:10", interval_s=0.05)
    client.start()
    try:
        await asyncio.sleep(0.3)
        assert not client.registered  # nobody listens on port 1
    finally:
        await client.stop()

    registry = InstanceRegistry(heartbeat_timeout_s=5.0)
    server = RegistrationServer(registry, port=0)
    await server.start()
    client = RegistrationClient(f"127.0.0.1:{server.port}", role="D",
                                http_address="127.0.0.1:9", model="m",
                                zmq_address="127.0.0.1:10", interval_s=0.05)
    client.start()
    try:
        for _ in range(100):
            if client.registered:
                break
            await asyncio.sleep(0.05)
        assert client.registered
    finally:
        await client.stop()
        await server.stop()
    assert not client.registered
