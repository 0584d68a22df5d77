"""When each request is sent: gamma-distributed gaps (Poisson at burstiness 1), as vLLM does.

Gaps are drawn from Gamma(shape=burstiness, scale=1/(rate*burstiness)), so their mean is
1/rate whatever the burstiness; the cumulative arrival times are then scaled so the last
one falls at exactly ``n / rate`` seconds, which keeps the offered load equal to the rate
on short runs. An infinite rate sends everything at once; an infinite burstiness gives
evenly spaced arrivals.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent."""
    if num_requests <= 0:
        return []
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                         size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def paced(items: Sequence[T], offsets: Sequence[float],
                start: float | None = None) -> AsyncIterator[T]:
    """Yield each item at ``start + offset`` (``time.perf_counter`` clock)."""
    start = time.perf_counter() if start is None else start
    for item, offset in zip(items, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
