"""Slow-step warnings: the threshold, the rate limit with its count, and compiles told apart."""

from __future__ import annotations

import logging

from engine_core.step_watch import StepWatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_slow_steps_are_logged_once_per_interval(caplog):
    clock, variants = FakeClock(), [14]
    watch = StepWatch(threshold_s=0.5, min_interval_s=10.0, clock=clock,
                      count_variants=lambda: variants[0])
    watch.start()
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        assert not watch.observe(0.2, 64, 3)
        assert watch.observe(0.9, 2304, 31)
        assert "900 ms (2304 tokens scheduled in 31 requests; no Triton compile)" in caplog.text
        clock.now += 1
        variants[0] = 16  # two variants compiled during this step
        assert not watch.observe(1.2, 4608, 32)  # within the interval: counted
        clock.now += 10
        assert watch.observe(0.7, 100, 2)
    last = caplog.records[-1].getMessage()
    assert "1 more slow steps since the last line" in last and "no Triton compile" in last
    assert watch.slow_steps == 3


def test_a_compile_is_named(caplog):
    variants = [14]
    watch = StepWatch(count_variants=lambda: variants[0])
    watch.start()
    variants[0] = 15
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        assert watch.observe(1.1, 19, 2)
    assert "1 Triton kernel variants compiled during it" in caplog.text
