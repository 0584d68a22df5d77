"""A doorbell: any thread rings it, the engine loop wakes on its file descriptor.

Why: while a decode engine has nothing to run but KV on its way, its loop sleeps in a ZMQ
poll with a short timeout and only then steps to land what arrived, so every transfer waited
half a poll interval on average for nothing. The connector's threads ring this when a
transfer completes or fails; the loop polls its descriptor next to its input socket and
steps at once. A self-pipe: ``os.write`` is safe from any thread and never blocks here (a
full pipe already means "ring pending").
"""

from __future__ import annotations

import os
import threading


class Doorbell:
    """A non-blocking self-pipe; ``fileno`` is what a poller watches."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        # Guards the descriptors against ``close``: a thread that rang after close wrote into
        # whatever file the process had opened since under the same number.
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        """Wake the poller (from any thread); a ring while one is pending is absorbed, one
        after ``close`` does nothing."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write, b"\0")
            except (BlockingIOError, OSError):  # full: a wake-up is already pending
                pass

    def drain(self) -> None:
        """Clear pending rings (the loop calls this when the descriptor is readable)."""
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self._read, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def close(self) -> None:
        """Close both ends; later rings and drains are no-ops (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._read, self._write):
                try:
                    os.close(fd)
                except OSError:
                    pass
