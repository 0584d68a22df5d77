"""/health of a worker: 200 when the engine core answers, 503 (not a 500 with a logged
traceback) when it is gone or hung, so load balancers and the proxy take it out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from engine_core.errors import EngineDeadError, EngineUnresponsiveError
from engine_core.server import api_server
from engine_core.server.http_errors import exception_body


class _Client:
    def __init__(self, alive: bool, hang: bool, long_operation: str | None = None) -> None:
        self.is_alive = alive
        self._hang = hang
        self.long_operation = long_operation

    async def call(self, method: str, timeout_s: float = 30.0, **args: Any) -> Any:
        assert method == "check_health"
        if self._hang:  # as EngineClient.call does when no answer comes
            try:
                return await asyncio.wait_for(asyncio.Event().wait(), timeout_s)
            except asyncio.TimeoutError:
                raise EngineUnresponsiveError(
                    f"engine core did not answer {method} within {timeout_s:g} s") from None
        return None


def _routes(alive: bool, hang: bool, long_operation: str | None = None) -> Any:
    serving = SimpleNamespace(client=_Client(alive, hang, long_operation))
    return api_server._Routes(serving, options=None, model_path="m")  # type: ignore[arg-type]


async def test_health_answers_200_when_the_engine_answers() -> None:
    response = await _routes(alive=True, hang=False).health(None)
    assert response.status == 200


@pytest.mark.parametrize("alive,hang,error", [(False, False, EngineDeadError),
                                              (True, True, EngineUnresponsiveError)])
async def test_health_of_a_dead_or_hung_engine_is_a_503(monkeypatch: pytest.MonkeyPatch,
                                                        alive: bool, hang: bool,
                                                        error: type) -> None:
    monkeypatch.setattr(api_server, "HEALTH_TIMEOUT_S", 0.05)
    with pytest.raises(error) as caught:
        await _routes(alive, hang).health(None)
    status, body = exception_body(caught.value)
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert body["error"]["code"] == ("engine_dead" if not alive else "engine_unresponsive")
    assert "check_health" in body["error"]["message"] or not alive


async def test_health_of_an_engine_busy_waking_up_is_200() -> None:
    """A wake-up (or sleep) in flight: the engine answers nothing else for minutes, and a
    liveness probe must not restart the worker mid-reload."""
    response = await _routes(alive=True, hang=True, long_operation="wake_up").health(None)
    assert response.status == 200
    with pytest.raises(EngineDeadError):
        await _routes(alive=False, hang=True, long_operation="wake_up").health(None)
