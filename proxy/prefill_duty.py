"""PrefillDuty: the prefill seconds the proxy placed on each worker, decayed over a window.

The placement policy's duty input (``WorkerSnapshot.prefill_duty``): a worker's recent and
queued prefill seconds per second. The proxy adds a prefill's predicted seconds when it
places it (so work still queued counts at once, not a heartbeat later); the sum decays
exponentially with ``window_s``, and the share is the sum over the window, which for a
steady load is the seconds of prefill placed there per second. Pure: the caller passes
the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class PrefillDuty:
    """Exponentially decayed prefill seconds per worker."""

    window_s: float = 3.0
    _load: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (s, at)

    def _decayed(self, worker_id: str, now: float) -> float:
        seconds, at = self._load.get(worker_id, (0.0, now))
        return seconds * math.exp(-max(0.0, now - at) / self.window_s)

    def add(self, worker_id: str, seconds: float, now: float) -> None:
        """``seconds`` of prefill placed on ``worker_id`` at ``now``."""
        self._load[worker_id] = (self._decayed(worker_id, now) + max(0.0, seconds), now)

    def share(self, worker_id: str, now: float) -> float:
        """Prefill seconds per second placed on ``worker_id`` lately (0 when none)."""
        return self._decayed(worker_id, now) / self.window_s

    def forget(self, worker_id: str) -> None:
        """The worker left."""
        self._load.pop(worker_id, None)
