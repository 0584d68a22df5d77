"""Whether a server takes new requests: what its ``GET /ready`` reports.

A server is ready once it listens (the engine is loaded), every registered check passes (a
worker's: its heartbeat reaches the proxy) and it is not draining. On SIGTERM it drains:
``/ready`` answers 503 and new generation requests are refused with a 503 (the proxy tries
them on another worker) while the requests in flight finish. ``/health`` stays liveness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Readiness:
    """One server's readiness: named checks and the draining flag (one per app)."""

    checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    draining: bool = False

    def add_check(self, name: str, check: Callable[[], bool]) -> None:
        """Require ``check()`` to be true for the server to be ready (``name`` is reported)."""
        self.checks[name] = check

    def waiting_for(self) -> list[str]:
        """What keeps the server from being ready (empty: ready)."""
        waiting = ["draining"] if self.draining else []
        return waiting + [name for name, check in self.checks.items() if not check()]
