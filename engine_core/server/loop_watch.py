"""A watch on an asyncio event loop: says when it stops turning, and where it is stuck.

Why: everything a server process does on the network runs on its loop, its heartbeats to
the proxy included. A loop held for seconds (a long synchronous call, a burst of work that
never yields) is seen from outside only as a worker that stopped answering: the proxy drops
it after its heartbeat timeout, and without the watch an overloaded worker is dropped with
no trace of why. The watch is a coroutine that stamps the time
every ``interval_s`` and a thread that reads the stamp: when the stamp is older than
``threshold_s`` the thread logs the loop thread's stack at that moment (once a stall), and
when the loop turns again the coroutine reports the stall's length to ``on_stall``, with
the share of it the process spent in garbage collection (``GcClock``): a collection holds
the GIL, so the stack sampled during a stall cannot tell a long collection from a long
computation (a loop held by a collection shows its stack in whatever trivial call, say a
``queue.put_nowait``, the collection interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger("pdserve.loop_watch")


class GcClock:
    """Seconds the process spent in garbage collection, and how many collections, through
    ``gc.callbacks`` (a collection runs in whichever thread triggered it, holding the GIL).
    ``install`` / ``remove`` add and take away its callback."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self.seconds = 0.0
        self.collections = 0
        self.longest_s = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            took = self._clock() - self._started
            self._started = None
            self.seconds += took
            self.collections += 1
            self.longest_s = max(self.longest_s, took)


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
        self.gc = GcClock()
        self._gc_at_stamp = (0.0, 0)
        self.stalls = 0
        self.stalled_seconds = 0.0

    async def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self.gc.install()
        self._stamp = self._clock()
        self._task = asyncio.create_task(self._stamp_loop())
        self._thread = threading.Thread(target=self._watch, name=f"loop-watch-{self.name}",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self.gc.remove()
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
            gc_now = (self.gc.seconds, self.gc.collections)
            if held > self.threshold_s:
                self.stalls += 1
                self.stalled_seconds += held
                logger.warning("%s: event loop was blocked for %.2f s, %.2f s of it in %d "
                               "garbage collections", self.name, held,
                               gc_now[0] - self._gc_at_stamp[0], gc_now[1] - self._gc_at_stamp[1])
                if self._on_stall is not None:
                    self._on_stall(held)
            self._stamp = now
            self._gc_at_stamp = gc_now

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
