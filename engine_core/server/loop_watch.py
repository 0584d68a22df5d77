"""A watch on an asyncio event loop: says when it stops turning, and where it is stuck.

Why: everything a server process does on the network runs on its loop, its heartbeats to
the proxy included. A loop held for seconds (a long synchronous call, a burst of work that
never yields) is seen from outside only as a worker that stopped answering: the proxy drops
it after its heartbeat timeout (the decode worker of the 2026-11-24 two-GPU report was
dropped so, overloaded, with no trace of why). The watch is a coroutine that stamps the time
every ``interval_s`` and a thread that reads the stamp: when the stamp is older than
``threshold_s`` the thread logs the loop thread's stack at that moment (once a stall), and
when the loop turns again the coroutine reports the stall's length to ``on_stall``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger("pdserve.loop_watch")


class LoopWatch:
    """``await watch.start()`` on the loop to watch; ``await watch.stop()`` to end it."""

    def __init__(self, name: str, threshold_s: float = 1.0, interval_s: float = 0.1,
                 on_stall: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_s <= interval_s:
            raise ValueError("threshold_s must exceed interval_s")
        self.name = name
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self._on_stall = on_stall
        self._clock = clock
        self._stamp = clock()
        self._reported_stamp: float | None = None  # the stamp of the stall already logged
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stalls = 0
        self.stalled_seconds = 0.0

    async def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._stamp = self._clock()
        self._task = asyncio.create_task(self._stamp_loop())
        self._thread = threading.Thread(target=self._watch, name=f"loop-watch-{self.name}",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    async def _stamp_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = self._clock()
            # A late turn: the loop was held since the last stamp (less the sleep).
            held = now - self._stamp - self.interval_s
            if held > self.threshold_s:
                self.stalls += 1
                self.stalled_seconds += held
                logger.warning("%s: event loop was blocked for %.2f s", self.name, held)
                if self._on_stall is not None:
                    self._on_stall(held)
            self._stamp = now

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            stamp = self._stamp
            late = self._clock() - stamp - self.interval_s
            if late <= self.threshold_s or self._reported_stamp == stamp:
                continue
            self._reported_stamp = stamp
            logger.warning("%s: event loop blocked for %.2f s so far; it is in:\n%s",
                           self.name, late, self.loop_stack())

    def loop_stack(self) -> str:
        """The loop thread's stack now (innermost call last)."""
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "  (loop thread not found)"
        return "".join(traceback.format_stack(frame))
