"""What the report's sections share: the result mapping type, the goals, the device models
that decide which runs compare, and cell formatting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Results = Mapping[str, Mapping[str, Any]]  # run name -> bench result
GOALS = {"ttft_overhead_p50_ms": 3.0, "ttft_overhead_p99_ms": 10.0, "goodput_ratio": 1.5,
         "proxy_overhead_p50_ms": 1.0}
ATTAINMENT_TARGET = 0.9


def fmt(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def goal_verdict(value: float | None, goal: float, lower_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value <= goal if lower_is_better else value >= goal
    if met:
        return "met"
    gap = value - goal if lower_is_better else goal - value
    return f"missed by {gap:.2f}"


def device_models(provenance: Mapping[str, Any] | None) -> frozenset[str]:
    """The device models a run's provenance names (``nvidia-smi``'s name column; a CPU's
    line as it is): what decides whether two runs may be compared. Counts, memory and driver
    are left out, so a one-GPU and a two-GPU machine of the same card agree."""
    devices = (provenance or {}).get("devices") or []
    return frozenset(str(d).split(",")[0].strip() for d in devices)
