"""The one place that maps exceptions to HTTP statuses and error bodies, for the workers
and the proxy alike.

Body shape (OpenAI's): ``{"error": {"message", "type", "param", "code"}}`` with ``type`` an
error category (``invalid_request_error``, ``rate_limit_error``, ...), ``code`` a string
naming the case or null, and ``param`` the request parameter at fault or null. Clients
(the official ``openai`` one included) pick their exception class from the status.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_core.errors import (
    AuthenticationError,
    ConfigError,
    EngineDeadError,
    EngineSleepingError,
    EngineUnresponsiveError,
    InvalidRequestError,
    ModelNotFoundError,
    NoWorkerError,
    OverloadedError,
    RequestTimeoutError,
    RequestTooLargeError,
    ShuttingDownError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from engine_core.server.streaming import encode_event

logger = logging.getLogger("pdserve.server")

REQUEST_ID_KEY = web.RequestKey("request_id", str)


@dataclass(frozen=True)
class HttpError:
    """How one kind of failure reads over HTTP."""

    status: int
    type: str
    code: str | None


INTERNAL_ERROR = HttpError(500, "server_error", "internal_error")

# Exception type -> its HTTP answer; the first matching entry wins, so subclasses come
# before their bases. Anything not listed is an internal error whose details stay private.
HTTP_ERRORS: tuple[tuple[type[BaseException], HttpError], ...] = (
    (RequestTooLargeError, HttpError(413, "invalid_request_error", "request_too_large")),
    (RequestTimeoutError, HttpError(408, "invalid_request_error", "request_timeout")),
    (ModelNotFoundError, HttpError(404, "invalid_request_error", "model_not_found")),
    (InvalidRequestError, HttpError(400, "invalid_request_error", None)),
    (ConfigError, HttpError(400, "invalid_request_error", None)),
    (AuthenticationError, HttpError(401, "invalid_request_error", "invalid_api_key")),
    (OverloadedError, HttpError(429, "rate_limit_error", "too_many_requests")),
    (NoWorkerError, HttpError(503, "service_unavailable", "no_worker_available")),
    (EngineSleepingError, HttpError(503, "service_unavailable", "engine_sleeping")),
    (EngineDeadError, HttpError(503, "service_unavailable", "engine_dead")),
    (EngineUnresponsiveError, HttpError(503, "service_unavailable", "engine_unresponsive")),
    (ShuttingDownError, HttpError(503, "service_unavailable", "shutting_down")),
    (UpstreamTimeoutError, HttpError(504, "upstream_timeout", "upstream_timeout")),
    (UpstreamUnavailableError, HttpError(503, "service_unavailable", "worker_unavailable")),
    (UpstreamError, HttpError(502, "upstream_error", "bad_gateway")),
)

# aiohttp's own errors for the cases the table names too answer with the table's code.
_AIOHTTP_CODES = {answer.status: answer.code for exc_type, answer in HTTP_ERRORS
                  if exc_type in (RequestTooLargeError, RequestTimeoutError)}


def http_error_of(exc: BaseException) -> HttpError:
    """The HTTP answer for an exception: aiohttp's own (404, 405, 413, ...) by their status,
    ours from the table, anything else an internal error."""
    if isinstance(exc, web.HTTPException):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        code = _AIOHTTP_CODES.get(exc.status) or exc.reason.lower().replace(" ", "_")
        return HttpError(exc.status, kind, code)
    for exc_type, answer in HTTP_ERRORS:
        if isinstance(exc, exc_type):
            return answer
    return INTERNAL_ERROR


def error_status(exc: BaseException) -> int:
    """The HTTP status for an exception."""
    return http_error_of(exc).status


def error_body(answer: HttpError, message: str, param: str | None = None) -> dict[str, Any]:
    """The error object every server of the cluster answers with."""
    return {"error": {"message": message, "type": answer.type, "param": param,
                      "code": answer.code}}


def exception_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for an exception; an internal error's details are not leaked."""
    answer = http_error_of(exc)
    if isinstance(exc, web.HTTPException):
        message = exc.text or exc.reason
    elif answer is INTERNAL_ERROR:
        message = "internal server error"
    else:
        message = str(exc) or type(exc).__name__
    return answer.status, error_body(answer, message, getattr(exc, "param", None))


_BODY_HEADERS = ("content-type", "content-length")  # json_response sets its own


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    """The JSON error response for an exception (with aiohttp's own headers, e.g. 405's
    ``Allow``)."""
    status, body = exception_body(exc)
    merged = {}
    if isinstance(exc, web.HTTPException):
        merged = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
    merged.update(headers or {})
    response = web.json_response(body, status=status, headers=merged or None)
    if isinstance(exc, (RequestTimeoutError, RequestTooLargeError)):
        # The rest of the body was never read, so the connection cannot carry another
        # request: Connection: close, and aiohttp closes it after answering (without first
        # waiting to read, and discard, a body it refused).
        response.force_close()
    return response


def sse_error_event(exc: BaseException) -> bytes:
    """The SSE events that end a stream failing after its first byte: the error, then
    ``[DONE]``."""
    _, body = exception_body(exc)
    return encode_event(body) + encode_event("[DONE]")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure (aiohttp's own 404/405/413 included) into a JSON error response."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc)
    except Exception as exc:
        request_id = request.get(REQUEST_ID_KEY, "-")
        status = error_status(exc)
        if isinstance(exc, ConnectionError):  # the client left: nobody reads the answer
            logger.info("request %s: the client went away (%s)", request_id, exc)
        elif status == 503:  # asleep, engine gone, no worker: a state, not a bug
            logger.warning("request %s refused (503): %s", request_id, exc)
        elif status >= 500:
            logger.exception("request %s failed", request_id)
        else:
            logger.info("request %s rejected: %s", request_id, exc)
        return error_response(exc)
