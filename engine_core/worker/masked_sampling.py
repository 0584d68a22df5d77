"""The sampling of steps whose grammar masks fill on a background thread.

With async scheduling step t+1 is launched (its forward only) before step t is collected.
Once step t's tokens advanced the grammars (the scheduler's update), ``start`` hands step
t+1's masks to the filler's thread and returns: the engine returns step t's outputs and
schedules step t+2 while the masks fill and the device runs step t+1's forward. ``finish``,
called just before step t+2 is launched (its inputs read step t+1's sampled tokens), waits
for the fill and queues the mask copy and the sampling. One-step-at-a-time stepping calls
both at once.
"""

from __future__ import annotations

import torch

from engine_core.grammar.bitmask import BitmaskFiller, FillJob, StepMasks
from engine_core.worker.grammar_mask import MaskedStepCounts
from engine_core.worker.model_runner import LaunchedStep, ModelRunner


class MaskedSampling:
    """One runner's steps awaiting grammar masks: at most one at a time."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.counts = MaskedStepCounts()
        self._filler: BitmaskFiller | None = None  # made with the first constrained step
        self._awaiting: tuple[LaunchedStep, FillJob, bool] | None = None

    @property
    def awaiting(self) -> bool:
        """A step's masks are filling; ``finish`` queues its sampling."""
        return self._awaiting is not None

    def start(self, step: LaunchedStep, masks: StepMasks | None, overlapped: bool) -> None:
        """Start filling ``step``'s masks (None: no row is constrained, it samples now).
        ``overlapped``: the step before was still in flight when ``step`` was launched."""
        assert self._awaiting is None, "the step before was not sampled"
        if masks is None:
            self.runner.sample(step)
            return
        if self._filler is None:
            self._filler = BitmaskFiller()
        job = self._filler.start(masks, self.runner.mask_rows(step))
        self._awaiting = (step, job, overlapped)

    def finish(self) -> None:
        """Queue the sampling of the step whose masks are filling, once they are in."""
        if self._awaiting is None:
            return
        step, job, overlapped = self._awaiting
        self._awaiting = None
        timer = self.runner.sample_timer

        def filled(request_ids: list[str], rows: torch.Tensor) -> bool:
            seconds = job.wait()
            if timer is not None:
                timer.fill_seconds(seconds)
            return True

        self.runner.sample(step, filled)
        self.counts.count(overlapped)

    def shutdown(self) -> None:
        if self._filler is not None:
            self._filler.shutdown()
