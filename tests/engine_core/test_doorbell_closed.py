"""A doorbell rung after ``close`` (a connector thread outliving the worker's shutdown)."""

from __future__ import annotations

import os
import select

from engine_core.doorbell import Doorbell


def test_a_ring_after_close_never_reaches_a_reused_descriptor() -> None:
    """``close`` frees the pipe's descriptor numbers and the process reuses them for the next
    file it opens; a sender or landing thread that rang afterwards wrote a byte into that
    file (here a new pipe; in an engine possibly a socket). Now the ring is a no-op."""
    bell = Doorbell()
    old_read, old_write = bell.fileno(), bell._write
    bell.close()
    read_fd, write_fd = os.pipe()
    try:
        assert {read_fd, write_fd} == {old_read, old_write}  # the numbers were reused
        bell.ring()
        assert not select.select([read_fd], [], [], 0.0)[0]  # nothing rang into it
        os.write(write_fd, b"x")
        os.set_blocking(read_fd, False)  # (the old drain would block on it otherwise)
        bell.drain()  # nor may a drain read (steal) from the reused descriptor
        assert os.read(read_fd, 16) == b"x"
        bell.close()  # idempotent: the new pipe stays open
        os.write(write_fd, b"y")
        assert os.read(read_fd, 16) == b"y"
    finally:
        os.close(read_fd)
        os.close(write_fd)
