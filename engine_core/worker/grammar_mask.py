"""The step's grammar masks on their way to the device: one pinned host buffer the scheduler
fills, one device buffer the sampler reads, one non-blocking copy between them.

Both buffers hold ``max_num_seqs`` rows and keep their addresses; a step uses its first
rows. The host buffer is written again only after the copy out of it has run (an event
marks it), so a fill never races the copy of the step before; while the filler's thread
fills it (``worker/masked_sampling.py``) nothing else touches it. On CPU the host buffer is
the device buffer and nothing is copied.

``SampleTimer`` (benchmarks only) times the parts a masked step adds, with CUDA events read
back after the steps, so timing adds no synchronisation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.grammar.bitmask import num_words

# Fills rows [0, len(request_ids)) of the host rows it is given, one per request in order;
# False when no request is constrained (the rows are then not read).
MaskFill = Callable[[list[str], torch.Tensor], bool]


class GrammarMaskStage:
    """Staging of packed int32 masks ``[rows, num_words(vocab_size)]`` for ``device``."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        shape = (max_rows, num_words(vocab_size))
        self.is_cuda = device.type == "cuda"
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=self.is_cuda)
        self.device_rows = (torch.empty(shape, dtype=torch.int32, device=device)
                            if self.is_cuda else self.host)
        self._copied: torch.cuda.Event | None = None

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]

    def host_rows(self, num_rows: int) -> torch.Tensor:
        """The first ``num_rows`` host rows, free to fill (the last copy out has run)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.host[:num_rows]

    def to_device(self, num_rows: int) -> torch.Tensor:
        """Queue the copy of the first ``num_rows`` rows; their device view."""
        if not self.is_cuda:
            return self.host[:num_rows]
        rows = self.device_rows[:num_rows]
        rows.copy_(self.host[:num_rows], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return rows


@dataclass
class MaskedStepCounts:
    """Steps that sampled under grammar masks, and those of them whose masks were filled
    while the step before was still in flight (async scheduling kept its overlap)."""

    total: int = 0
    overlapped: int = 0

    def count(self, overlapped: bool) -> None:
        self.total += 1
        self.overlapped += overlapped


@dataclass
class SampleTiming:
    """One sampled step, in milliseconds: the mask fill on the filler's thread (0 without
    masks), how long the engine's thread then waited for it, how long the device sat idle
    between the step's logits and the sampling work (the mask copy when masked: waiting for
    the host when positive), the mask copy, and the sampling (the mask apply included)."""

    masked: bool
    fill_ms: float
    fill_wait_ms: float
    device_wait_ms: float
    copy_ms: float
    sample_ms: float


class SampleTimer:
    """Events around each step's sampling (wall clock on CPU), set on the runner by
    benchmarks; ``collect`` reads them back after the steps."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self._marks: dict[str, object] = {}
        self._fill_ms = self._wait_ms = 0.0
        self._done: list[tuple[bool, float, float, dict[str, object]]] = []

    def mark(self, name: str) -> None:
        """Mark a point of the step: ``logits``, ``copy_start``, ``sample_start``,
        ``sample_end``."""
        if not self.is_cuda:
            self._marks[name] = time.perf_counter()
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks[name] = event

    def fill_seconds(self, seconds: float) -> None:
        self._fill_ms = seconds * 1e3

    def wait_seconds(self, seconds: float) -> None:
        self._wait_ms = seconds * 1e3

    def end_step(self, masked: bool) -> None:
        self._done.append((masked, self._fill_ms, self._wait_ms, self._marks))
        self._marks, self._fill_ms, self._wait_ms = {}, 0.0, 0.0

    def collect(self) -> list[SampleTiming]:
        """Every step timed since the last call (waits for the last one)."""
        samples = []
        for masked, fill_ms, wait_ms, marks in self._done:
            first_after_logits = "copy_start" if "copy_start" in marks else "sample_start"
            copy_ms = (self._between(marks, "copy_start", "sample_start")
                       if "copy_start" in marks else 0.0)
            samples.append(SampleTiming(
                masked=masked, fill_ms=fill_ms, fill_wait_ms=wait_ms,
                device_wait_ms=self._between(marks, "logits", first_after_logits),
                copy_ms=copy_ms,
                sample_ms=self._between(marks, "sample_start", "sample_end")))
        self._done = []
        return samples

    def _between(self, marks: dict[str, object], first: str, second: str) -> float:
        start, end = marks[first], marks[second]
        if not self.is_cuda:
            return (end - start) * 1e3  # type: ignore[operator]
        end.synchronize()  # type: ignore[attr-defined]
        return start.elapsed_time(end)  # type: ignore[attr-defined]
