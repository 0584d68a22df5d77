"""The event-loop watch: a held loop is reported while held (with the stack it is stuck in)
and when it turns again (its length, to the metrics); a turning loop is never reported."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from engine_core.server.loop_watch import LoopWatch


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop thread: nothing else runs


async def _watched(hold_s: float, caplog: pytest.LogCaptureFixture) -> tuple[LoopWatch, list[float]]:
    stalls: list[float] = []
    watch = LoopWatch("test", threshold_s=0.2, interval_s=0.02, on_stall=stalls.append)
    await watch.start()
    await asyncio.sleep(0.1)
    if hold_s:
        _hold_the_loop(hold_s)
    await asyncio.sleep(0.1)
    await watch.stop()
    return watch, stalls


def test_a_held_loop_is_reported_with_its_stack(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.loop_watch")
    watch, stalls = asyncio.run(_watched(0.6, caplog))
    assert len(stalls) == 1 and 0.45 < stalls[0] < 1.5, stalls
    assert watch.stalls == 1 and watch.stalled_seconds == pytest.approx(stalls[0])
    during = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert len(during) == 1, during  # once per stall, not once per check
    assert "_hold_the_loop" in during[0] and "time.sleep" in during[0]
    after = [r.getMessage() for r in caplog.records if "was blocked for" in r.getMessage()]
    assert len(after) == 1


def test_a_turning_loop_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.loop_watch")
    watch, stalls = asyncio.run(_watched(0.0, caplog))
    assert stalls == [] and watch.stalls == 0
    assert not caplog.records


def test_threshold_must_exceed_the_interval() -> None:
    with pytest.raises(ValueError):
        LoopWatch("x", threshold_s=0.1, interval_s=0.1)
