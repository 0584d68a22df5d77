"""The event-loop watch: a held loop is reported while held (with the stack it is stuck in)
and when it turns again (its length, to the metrics); a turning loop is never reported."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import time
from collections.abc import Callable

import pytest

from engine_core.server.loop_watch import GcClock, LoopWatch


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop thread: nothing else runs


def _collect_garbage(seconds: float) -> None:
    """Hold the loop in garbage collections of many tracked objects."""
    junk = [[i] for i in range(300_000)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
    del junk


async def _watched(hold_s: float, caplog: pytest.LogCaptureFixture,
                   hold: Callable[[float], None] = _hold_the_loop
                   ) -> tuple[LoopWatch, list[float]]:
    stalls: list[float] = []
    watch = LoopWatch("test", threshold_s=0.2, interval_s=0.02, on_stall=stalls.append)
    await watch.start()
    await asyncio.sleep(0.1)
    if hold_s:
        hold(hold_s)
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
    assert re.search(r"0\.\d\d s of it in \d+ garbage collections", after[0]), after[0]
    gc_share = float(re.search(r"(\d+\.\d+) s of it", after[0]).group(1))
    assert gc_share < 0.1  # a sleep, not a collection


def test_a_stall_in_garbage_collection_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A loop held by collections: the report puts most of the stall on them."""
    caplog.set_level(logging.WARNING, logger="pdserve.loop_watch")
    watch, stalls = asyncio.run(_watched(0.6, caplog, hold=_collect_garbage))
    assert len(stalls) == 1
    after = [r.getMessage() for r in caplog.records if "was blocked for" in r.getMessage()][0]
    gc_share = float(re.search(r"(\d+\.\d+) s of it", after).group(1))
    assert gc_share > 0.5 * stalls[0], after
    assert watch.gc.collections > 0 and watch.gc.longest_s > 0
    assert watch.gc._callback not in gc.callbacks  # removed at stop


def test_gc_clock_sums_collections() -> None:
    ticks = iter([1.0, 1.5, 2.0, 2.25])
    clock = GcClock(clock=lambda: next(ticks))
    clock._callback("start", {"generation": 2})
    clock._callback("stop", {"generation": 2})
    clock._callback("start", {"generation": 0})
    clock._callback("stop", {"generation": 0})
    assert clock.collections == 2
    assert clock.seconds == pytest.approx(0.75) and clock.longest_s == pytest.approx(0.5)


def test_a_turning_loop_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.loop_watch")
    watch, stalls = asyncio.run(_watched(0.0, caplog))
    assert stalls == [] and watch.stalls == 0
    assert not caplog.records


def test_threshold_must_exceed_the_interval() -> None:
    with pytest.raises(ValueError):
        LoopWatch("x", threshold_s=0.1, interval_s=0.1)
