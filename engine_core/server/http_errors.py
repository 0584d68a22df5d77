"""The one place that maps exceptions to HTTP statuses and the OpenAI-style error body.

Body shape (as vLLM's OpenAI server): ``{"error": {"message", "type", "param", "code"}}``
with ``type`` the error class name clients see and ``code`` the HTTP status.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engine_core.errors import (
    ConfigError,
    EngineDeadError,
    EngineSleepingError,
    EngineUnresponsiveError,
    InvalidRequestError,
    KVTransferError,
    ModelNotFoundError,
    NoWorkerError,
    OverloadedError,
    RequestTimeoutError,
    ShuttingDownError,
)

logger = logging.getLogger("pdserve.server")

_STATUS_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}


REQUEST_ID_KEY = web.RequestKey("request_id", str)


class AuthenticationError(Exception):
    """Missing or wrong API key (HTTP 401)."""


def error_status(exc: BaseException) -> int:
    """The HTTP status for an exception."""
    if isinstance(exc, web.HTTPException):
        return exc.status
    if isinstance(exc, RequestTimeoutError):
        return 408
    if isinstance(exc, (InvalidRequestError, ConfigError)):
        return 400
    if isinstance(exc, AuthenticationError):
        return 401
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, OverloadedError):
        return 429
    if isinstance(exc, (EngineDeadError, EngineUnresponsiveError, EngineSleepingError,
                        NoWorkerError, ShuttingDownError)):
        return 503
    if isinstance(exc, KVTransferError):
        return 500
    return 500


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-style error object."""
    return {"error": {"message": message, "type": _STATUS_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def exception_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for an exception; internal details are not leaked on 500."""
    status = error_status(exc)
    if isinstance(exc, web.HTTPException):
        message = exc.text or exc.reason
        if status == 413:
            message = f"request body too large: {exc.reason}"
    elif status == 500:
        message = "internal server error"
    else:
        message = str(exc) or type(exc).__name__
    return status, error_body(status, message, getattr(exc, "param", None))


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    status, body = exception_body(exc)
    response = web.json_response(body, status=status, headers=headers)
    if status == 408:
        # The rest of the body was never read, so the connection cannot carry another
        # request: Connection: close, and aiohttp closes it after answering.
        response.force_close()
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure (including aiohttp's 404/405/413) into a JSON error response."""
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
