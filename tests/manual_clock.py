"""A clock tests move by hand, for code that takes an injected ``clock``."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``; tests set or advance it."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
