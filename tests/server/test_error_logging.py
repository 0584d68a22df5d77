"""What the API server logs for a refused request: a 503 (asleep, engine gone) is one line,
not a traceback per request; a real 500 keeps its traceback."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from engine_core.errors import EngineSleepingError
from engine_core.server.http_errors import error_middleware


@pytest.mark.parametrize("exc,status,traceback", [
    (EngineSleepingError("the engine is asleep"), 503, False),
    (RuntimeError("boom"), 500, True),
])
async def test_refusals_log_a_line_and_failures_a_traceback(
        caplog: pytest.LogCaptureFixture, exc: Exception, status: int, traceback: bool) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise exc

    with caplog.at_level(logging.INFO, logger="pdserve"):
        response = await error_middleware(make_mocked_request("POST", "/v1/completions"),
                                          handler)
    assert response.status == status
    records = [r for r in caplog.records if "request" in r.getMessage()]
    assert len(records) == 1
    assert (records[0].exc_info is not None) == traceback
