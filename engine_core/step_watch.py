"""A warning when an engine step takes long: what the step held, and whether Triton compiled.

Why: a stall of a second (a kernel variant compiled while serving, an allocator retry, a
starved host) shows in clients' TTFT and nowhere in the logs. This line says when it
happened, what the step carried, and whether new Triton variants appeared during it, which
tells a compile apart from everything else. At most one line per ``min_interval_s``; the
lines in between are counted and reported with the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.kernels.jit_variants import compiled_variants

logger = logging.getLogger("pdserve.engine")

# A Qwen3-8B step of 8192 prompt tokens takes ~0.24 s on an H100; twice
# that is no ordinary step on a GPU. CPU engines (tests, the demo) run far below it too.
SLOW_STEP_S = 0.5


def _total_variants() -> int:
    return sum(compiled_variants().values())


@dataclass
class StepWatch:
    """Times engine steps and warns about slow ones (rate-limited)."""

    threshold_s: float = SLOW_STEP_S
    min_interval_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    count_variants: Callable[[], int] = _total_variants
    slow_steps: int = 0
    _variants: int = field(default=-1, init=False)
    _last_log: float = field(default=float("-inf"), init=False)
    _unlogged: int = field(default=0, init=False)

    def start(self) -> None:
        """Take the variant count as it stands (after the startup warm-up)."""
        self._variants = self.count_variants()

    def observe(self, seconds: float, num_tokens: int, num_reqs: int) -> bool:
        """Record one step's wall time; True when it was logged."""
        if seconds < self.threshold_s:
            return False
        self.slow_steps += 1
        variants = self.count_variants()
        new = max(variants - self._variants, 0) if self._variants >= 0 else 0
        self._variants = variants
        now = self.clock()
        if now - self._last_log < self.min_interval_s:
            self._unlogged += 1
            return False
        earlier = f"; {self._unlogged} more slow steps since the last line" if self._unlogged else ""
        compiled = (f"{new} Triton kernel variants compiled during it" if new
                    else "no Triton compile")
        logger.warning("Slow engine step: %.0f ms (%d tokens scheduled in %d requests; %s)%s",
                       seconds * 1e3, num_tokens, num_reqs, compiled, earlier)
        self._last_log = now
        self._unlogged = 0
        return True
