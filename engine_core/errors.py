"""The project's exception types, defined once; ``server/http_errors.py`` maps them to HTTP
statuses and error bodies for the workers and the proxy alike."""


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""


class ConfigError(PdserveError, ValueError):
    """A configuration value or flag is invalid."""


class ModelLoadError(PdserveError):
    """A checkpoint cannot be loaded: missing directory, unsupported architecture, missing tensors."""


class InvalidRequestError(PdserveError, ValueError):
    """A request is malformed or out of bounds; the client gets HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTimeoutError(InvalidRequestError):
    """The client did not send its whole request body within the server's bound (HTTP 408)."""


class RequestTooLargeError(InvalidRequestError):
    """The request body exceeds the server's size bound (HTTP 413)."""


class AuthenticationError(PdserveError):
    """Missing or wrong API key (HTTP 401)."""


class ModelNotFoundError(PdserveError):
    """The request names a model this server does not serve (HTTP 404)."""


class MessageDecodeError(PdserveError, ValueError):
    """A socket message failed its schema check; it is dropped and counted, never fatal."""


class EngineDeadError(PdserveError):
    """The engine-core process is gone; the API process can no longer serve."""


class EngineUnresponsiveError(PdserveError):
    """The engine-core process is alive but did not answer in time (a health check: 503)."""


class KVTransferError(PdserveError):
    """A KV transfer failed or timed out; the consumer recomputes or fails the request."""


class OverloadedError(PdserveError):
    """Too many requests in flight (HTTP 429)."""


class NoWorkerError(PdserveError):
    """No worker of a needed role is registered (HTTP 503)."""


class EngineSleepingError(PdserveError):
    """The engine is asleep (sleep mode): it serves again after wake_up; HTTP 503."""


class UpstreamError(PdserveError):
    """A worker leg of a proxied request failed: connection, protocol, timeout or 5xx (HTTP
    502). ``connect_failed`` means nothing reached the worker, so the request may go elsewhere.
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


class ShuttingDownError(PdserveError):
    """The server is draining for shutdown and takes no new requests (HTTP 503: the proxy
    tries them on another worker)."""
