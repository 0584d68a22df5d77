"""The one exception-to-HTTP map: every server of the cluster answers in OpenAI's error
shape, each error type with its own status, and internal details never leak."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from engine_core.errors import (
    AuthenticationError,
    EngineSleepingError,
    InvalidRequestError,
    KVTransferError,
    ModelNotFoundError,
    NoWorkerError,
    OverloadedError,
    RequestTimeoutError,
    RequestTooLargeError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from engine_core.server.http_errors import (
    HTTP_ERRORS,
    error_response,
    exception_body,
    sse_error_event,
)

KEYS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("exc,status,kind,code", [
    (InvalidRequestError("n must be >= 1", "n"), 400, "invalid_request_error", None),
    (RequestTooLargeError("too big"), 413, "invalid_request_error", "request_too_large"),
    (RequestTimeoutError("slow body"), 408, "invalid_request_error", "request_timeout"),
    (ModelNotFoundError("no such model"), 404, "invalid_request_error", "model_not_found"),
    (AuthenticationError("bad key"), 401, "invalid_request_error", "invalid_api_key"),
    (OverloadedError("busy"), 429, "rate_limit_error", "too_many_requests"),
    (NoWorkerError("none"), 503, "service_unavailable", "no_worker_available"),
    (EngineSleepingError("asleep"), 503, "service_unavailable", "engine_sleeping"),
    (UpstreamTimeoutError("late"), 504, "upstream_timeout", "upstream_timeout"),
    (UpstreamUnavailableError("asleep"), 503, "service_unavailable", "worker_unavailable"),
    (UpstreamError("reset", kind="disconnect"), 502, "upstream_error", "bad_gateway"),
])
def test_each_error_has_its_status_type_and_code(exc, status, kind, code) -> None:
    got_status, body = exception_body(exc)
    assert got_status == status
    assert set(body) == {"error"} and set(body["error"]) == KEYS
    assert body["error"]["type"] == kind and body["error"]["code"] == code
    assert body["error"]["message"] == str(exc)
    assert body["error"]["param"] == getattr(exc, "param", None)


def test_no_entry_is_shadowed_by_an_earlier_base() -> None:
    """The first match wins, so a subclass listed after its base would never be reached."""
    for i, (later, _) in enumerate(HTTP_ERRORS):
        for earlier, _ in HTTP_ERRORS[:i]:
            assert not issubclass(later, earlier), (later, earlier)


@pytest.mark.parametrize("exc", [RuntimeError("secret path /x"), KVTransferError("peer 10.0.0.1")])
def test_internal_errors_hide_their_details(exc) -> None:
    status, body = exception_body(exc)
    assert status == 500
    assert body["error"] == {"message": "internal server error", "type": "server_error",
                             "param": None, "code": "internal_error"}


def test_aiohttp_errors_keep_their_status_and_headers() -> None:
    exc = web.HTTPMethodNotAllowed("GET", ["POST"])
    response = error_response(exc, headers={"X-Request-Id": "r1"})
    assert response.status == 405 and response.content_type == "application/json"
    assert response.headers["Allow"] == "POST" and response.headers["X-Request-Id"] == "r1"
    error = json.loads(response.body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"


def test_a_body_timeout_closes_its_connection() -> None:
    assert error_response(RequestTimeoutError("slow")).keep_alive is False
    assert error_response(InvalidRequestError("bad")).keep_alive is not False


def test_the_stream_error_event_carries_the_same_body_then_done() -> None:
    exc = UpstreamError("reset", kind="disconnect")
    error_event, done, rest = sse_error_event(exc).split(b"\n\n")
    assert json.loads(error_event.removeprefix(b"data: ")) == exception_body(exc)[1]
    assert done == b"data: [DONE]" and rest == b""


def test_aiohttp_body_too_large_reads_as_ours() -> None:
    exc = web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20)
    assert exception_body(exc)[1]["error"]["code"] == exception_body(
        RequestTooLargeError("too big"))[1]["error"]["code"] == "request_too_large"
