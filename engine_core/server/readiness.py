"""Whether a server takes new requests: what its ``GET /ready`` reports.

A server is ready once it listens (the engine is loaded), every registered check passes (a
worker's: its heartbeat reaches the proxy) and it is not draining. On SIGTERM it drains:
``/ready`` answers 503 and new generation requests are refused with a 503 (the proxy tries
them on another worker) while the requests in flight finish. ``/health`` stays liveness.

A generation request counts as in flight from the moment its handler is admitted, not from
when the engine sees it: reading its body and tokenizing come first, and a drain that did
not wait for them would stop the engine under a request it had accepted (a prefill worker
would answer it and then exit holding the KV its decode worker is about to pull).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine_core.errors import ShuttingDownError


@dataclass
class Readiness:
    """One server's readiness: named checks and the draining flag (one per app)."""

    checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    draining: bool = False
    admitted: int = 0  # generation requests taken whose handlers have not returned

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Count one generation request while its handler runs (the drain waits for it);
        ``ShuttingDownError`` (503) while draining."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1

    def add_check(self, name: str, check: Callable[[], bool]) -> None:
        """Require ``check()`` to be true for the server to be ready (``name`` is reported)."""
        self.checks[name] = check

    def waiting_for(self) -> list[str]:
        """What keeps the server from being ready (empty: ready)."""
        waiting = ["draining"] if self.draining else []
        return waiting + [name for name, check in self.checks.items() if not check()]
