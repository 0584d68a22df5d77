"""Exact byte accounting of the consumer's receive buffer (``kv_buffer_size``).

Pure logic: no tensors, no threads. When a transfer does not fit, the consumer pushes back:
it delays its pull request (so the producer never sends bytes the consumer cannot hold)
until earlier transfers release their bytes, or until the transfer's deadline.
"""

from __future__ import annotations

import threading


class RecvBuffer:
    """Reservations of receive-buffer bytes, one per transfer; thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._reserved: dict[str, int] = {}
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use_bytes(self) -> int:
        """Bytes currently reserved."""
        return self._in_use

    def fits_ever(self, nbytes: int) -> bool:
        """Whether a transfer of ``nbytes`` can fit an empty buffer at all."""
        return nbytes <= self.capacity_bytes

    def try_reserve(self, transfer_id: str, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``transfer_id``; False (nothing changed) when they do not fit."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        with self._lock:
            if transfer_id in self._reserved:
                raise KeyError(f"transfer {transfer_id!r} already holds a reservation")
            if self._in_use + nbytes > self.capacity_bytes:
                return False
            self._reserved[transfer_id] = nbytes
            self._in_use += nbytes
            return True

    def release(self, transfer_id: str) -> int:
        """Give back a transfer's bytes; returns how many (0 when it held none)."""
        with self._lock:
            nbytes = self._reserved.pop(transfer_id, 0)
            self._in_use -= nbytes
            return nbytes

    def holders(self) -> list[str]:
        """Transfer ids holding a reservation."""
        with self._lock:
            return list(self._reserved)
