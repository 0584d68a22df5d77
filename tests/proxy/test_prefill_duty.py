"""PrefillDuty: decayed prefill seconds per worker (pure, injected time)."""

from __future__ import annotations

import math

import pytest

from proxy.prefill_duty import PrefillDuty


def test_steady_load_reads_as_its_seconds_per_second() -> None:
    duty = PrefillDuty(window_s=3.0)
    # 0.05 s of prefill every 0.1 s for a minute: half of the worker's time.
    for step in range(600):
        duty.add("a", 0.05, step * 0.1)
    assert duty.share("a", 60.0) == pytest.approx(0.5, rel=0.05)
    assert duty.share("b", 60.0) == 0.0


def test_it_decays_and_forgets() -> None:
    duty = PrefillDuty(window_s=2.0)
    duty.add("a", 1.0, 10.0)
    assert duty.share("a", 10.0) == pytest.approx(0.5)  # queued work counts at once
    assert duty.share("a", 12.0) == pytest.approx(0.5 * math.exp(-1))
    duty.add("a", 1.0, 12.0)
    assert duty.share("a", 12.0) == pytest.approx(0.5 * math.exp(-1) + 0.5)
    duty.forget("a")
    assert duty.share("a", 12.0) == 0.0
