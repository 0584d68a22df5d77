"""GPU time of each step's model forward (eager or graph replay), for benchmarks.

The step's wall time includes scheduling, input building and sampling; the forward time
alone shows how much of a step the host adds. Events are only read back by ``collect``,
so timing adds no synchronisation to the step itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class ForwardSample:
    """One step's forward: its time in ms, whether a graph ran, and the (padded) batch."""

    ms: float
    graphed: bool
    num_tokens: int


class ForwardTimer:
    """Records CUDA events (wall clock on CPU) around each forward the runner runs."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self._start: torch.cuda.Event | float | None = None
        self._pending: list[tuple[object, object, bool, int]] = []

    def start(self) -> None:
        self._start = self._mark()

    def stop(self, graphed: bool, num_tokens: int) -> None:
        self._pending.append((self._start, self._mark(), graphed, num_tokens))

    def _mark(self) -> torch.cuda.Event | float:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def collect(self) -> list[ForwardSample]:
        """Every forward timed since the last call (waits for the last one to finish)."""
        samples = []
        for start, end, graphed, num_tokens in self._pending:
            if self.is_cuda:
                end.synchronize()  # type: ignore[union-attr]
                ms = start.elapsed_time(end)  # type: ignore[union-attr]
            else:
                ms = (end - start) * 1e3  # type: ignore[operator]
            samples.append(ForwardSample(ms, graphed, num_tokens))
        self._pending = []
        return samples
