"""Maximum goodput by rate search: the highest request rate at which >= 90% of requests meet
an SLO cell, found by growing the rate until every cell fails and then bisecting each cell's
bracket. Pure: the sweep feeds it measured points and asks where to go next.

One point (a rate, a fresh prompt set, a fixed number of seconds of Poisson arrivals) scores
every cell at once, so the search spends its points on the cell whose bracket is widest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SloCell:
    """A latency target: TTFT and TPOT bounds in milliseconds."""

    ttft_ms: float
    tpot_ms: float

    @property
    def name(self) -> str:
        return f"ttft{self.ttft_ms:g}_tpot{self.tpot_ms:g}"


@dataclass(frozen=True)
class PointResult:
    """One measured rate: per-request TTFT and TPOT in seconds (None: failed or undefined)."""

    rate: float
    ttfts: tuple[float | None, ...]
    tpots: tuple[float | None, ...]
    duration_s: float

    def attainment(self, cell: SloCell) -> float:
        """The share of sent requests that met ``cell`` (a failed request meets none; a
        one-token request's TPOT is 0)."""
        if not self.ttfts:
            return 0.0
        good = sum(1 for ttft, tpot in zip(self.ttfts, self.tpots, strict=True)
                   if ttft is not None and ttft * 1e3 <= cell.ttft_ms
                   and (tpot or 0.0) * 1e3 <= cell.tpot_ms)
        return good / len(self.ttfts)

    def goodput(self, cell: SloCell) -> float:
        """Requests per second that met ``cell``."""
        return self.attainment(cell) * len(self.ttfts) / max(self.duration_s, 1e-9)


@dataclass
class RateSearch:
    """Where to measure next, and each cell's maximum goodput so far.

    Growth: from ``start_rate`` by ``growth`` until every cell fails (or ``max_rate``).
    Then each cell's bracket (highest passing rate, lowest failing rate above it) is halved
    geometrically, widest first, until it is within ``tolerance`` or ``budget`` points are spent.
    """

    cells: Sequence[SloCell]
    start_rate: float
    max_rate: float
    budget: int
    target: float = 0.9
    growth: float = 2.0
    tolerance: float = 1.15
    points: list[PointResult] = field(default_factory=list)

    def record(self, point: PointResult) -> None:
        self.points.append(point)

    def passes(self, point: PointResult, cell: SloCell) -> bool:
        return point.attainment(cell) >= self.target

    def bracket(self, cell: SloCell) -> tuple[float | None, float | None]:
        """(highest passing rate below the lowest failing one, lowest failing rate)."""
        failing = [p.rate for p in self.points if not self.passes(p, cell)]
        low_fail = min(failing) if failing else None
        passing = [p.rate for p in self.points if self.passes(p, cell)
                   and (low_fail is None or p.rate < low_fail)]
        return (max(passing) if passing else None), low_fail

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when done."""
        if len(self.points) >= self.budget:
            return None
        if not self.points:
            return self.start_rate
        top = max(p.rate for p in self.points)
        if any(self.passes(p, cell) for p in self.points if p.rate == top for cell in self.cells):
            return None if top >= self.max_rate else min(top * self.growth, self.max_rate)
        widest: tuple[float, float] | None = None
        for cell in self.cells:
            low, high = self.bracket(cell)
            if high is None:
                continue
            low = low if low is not None else 0.0
            ratio = math.inf if low <= 0 else high / low
            if ratio > self.tolerance and (widest is None or ratio > widest[0]):
                widest = (ratio, math.sqrt(low * high) if low > 0 else high / self.growth)
        if widest is None:
            return None
        rate = widest[1]
        measured = {round(p.rate, 6) for p in self.points}
        return None if round(rate, 6) in measured else rate

    def max_goodput(self, cell: SloCell) -> dict[str, float | None]:
        """The cell's highest passing rate (below any failure) and the goodput measured there."""
        low, _ = self.bracket(cell)
        if low is None:
            return {"rate": None, "goodput": 0.0}
        point = next(p for p in self.points if p.rate == low)
        return {"rate": low, "goodput": point.goodput(cell)}
