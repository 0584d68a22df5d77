"""The device time of each step, for the engine's step rates (``engine_core/step_rates.py``).

A step's host wall time is not its cost: with async scheduling the call that collects a
step began after the step was launched, and a worker that idles between prefills collects
a long prefill in a few milliseconds of waiting. The clock brackets each forward with CUDA
events and hands back the steps whose end event has completed, in launch order, without a
synchronisation. On CPU the forward runs inside the launch, so host time is its cost.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCost:
    """One finished step: its device seconds, its prompt tokens and its decode rows."""

    seconds: float
    num_prefill_tokens: int
    num_decodes: int


class StepClock:
    """``mark = clock.start()`` before a forward, ``clock.stop(mark, ...)`` after it;
    ``finished()`` returns the steps done since the last call."""

    # Steps still running on the device are kept at most this many (a device that never
    # completes them is a dead engine, not a reason to grow).
    MAX_PENDING = 64

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self._pending: deque[tuple[object, object, int, int]] = deque(maxlen=self.MAX_PENDING)

    def start(self) -> object:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark: object, num_prefill_tokens: int, num_decodes: int) -> None:
        self._pending.append((mark, self.start(), num_prefill_tokens, num_decodes))

    def finished(self) -> list[StepCost]:
        """Every step whose forward has completed, oldest first; never waits."""
        done = []
        while self._pending:
            start, end, num_prefill, num_decodes = self._pending[0]
            if self.is_cuda:
                if not end.query():  # type: ignore[attr-defined]
                    break
                seconds = start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
            else:
                seconds = end - start  # type: ignore[operator]
            self._pending.popleft()
            done.append(StepCost(seconds, num_prefill, num_decodes))
        return done
