"""Proxy error types and their HTTP mapping, in one place.

The shared types (``InvalidRequestError``, ``OverloadedError``, ``NoWorkerError``,
``ModelNotFoundError``) come from ``engine_core.errors``; the upstream failures below only
the proxy raises. ``to_http`` turns any of them into an OpenAI-style status and body.
"""

from __future__ import annotations

import json
from typing import Any

from engine_core.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    NoWorkerError,
    OverloadedError,
    PdserveError,
    RequestTimeoutError,
    RequestTooLargeError,
)


class UpstreamError(PdserveError):
    """A worker leg failed: connection, protocol, timeout or 5xx (HTTP 502).

    ``connect_failed`` means nothing reached the worker, so the request may go elsewhere.
    """

    def __init__(self, message: str, kind: str, connect_failed: bool = False,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind  # connect | disconnect | timeout | status | empty
        self.connect_failed = connect_failed
        self.status = status


class UpstreamUnavailableError(UpstreamError):
    """A worker answered 503 (asleep, not ready) and no other could take the request (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="status", status=503)


class UpstreamTimeoutError(UpstreamError):
    """A worker leg ran past its deadline (HTTP 504)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="timeout")


# exception type -> (HTTP status, OpenAI error type, code); the first matching entry wins.
_HTTP_MAP: list[tuple[type[BaseException], int, str, str]] = [
    (RequestTooLargeError, 413, "invalid_request_error", "request_too_large"),
    (RequestTimeoutError, 408, "invalid_request_error", "request_timeout"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (AuthenticationError, 401, "invalid_request_error", "invalid_api_key"),
    (OverloadedError, 429, "rate_limit_error", "too_many_requests"),
    (NoWorkerError, 503, "service_unavailable", "no_worker_available"),
    (UpstreamTimeoutError, 504, "upstream_timeout", "upstream_timeout"),
    (UpstreamUnavailableError, 503, "service_unavailable", "worker_unavailable"),
    (UpstreamError, 502, "upstream_error", "bad_gateway"),
]


def error_payload(message: str, error_type: str, code: str | int | None,
                  param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def to_http(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Map an exception to (status, OpenAI error body); unknown ones are 500s."""
    for exc_type, status, error_type, code in _HTTP_MAP:
        if isinstance(exc, exc_type):
            return status, error_payload(str(exc), error_type, code, getattr(exc, "param", None))
    return 500, error_payload(f"internal proxy error: {type(exc).__name__}", "server_error",
                              "internal_error")


def sse_error_event(exc: BaseException) -> bytes:
    """The SSE event that ends a stream whose upstream failed after bytes went out."""
    _, payload = to_http(exc)
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"
