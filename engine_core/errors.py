"""The project's exception types, defined once. HTTP mapping lives in server/http_errors.py."""


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


class ShuttingDownError(PdserveError):
    """The server is draining for shutdown and takes no new requests (HTTP 503: the proxy
    tries them on another worker)."""
