"""A producer whose prefill outlasts the consumer's deadline sends nothing for that
transfer, and the transfers behind it on the same pair are unharmed.

The pull says how long the consumer still waits (``timeout_s``, from when it sends the
pull); the producer's send ends by then, less a margin. Before, the producer sent its
header late, the consumer refused it and aborted the NCCL pair, and the producer's
unmatched sends held its one sender thread for that consumer until its own deadline: the
next transfer, requested and computed within milliseconds, failed too.
"""

from __future__ import annotations

import time

from tests.connectors.worker_pair import WorkerPair


def test_a_late_prefill_does_not_take_down_the_next_transfer() -> None:
    pair = WorkerPair(timeout_s=1.5)  # fake NCCL
    try:
        assert pair.consumer is not None
        pair.ask("late")
        assert pair.outcome("late") == "failed"  # P's prefill queued past D's deadline
        pair.ask("next")
        start = time.monotonic()
        pair.compute("late", "next")  # P computes the late one, then the next at once
        assert pair.outcome("next") == "ok"
        assert time.monotonic() - start < 1.0
        assert pair.consumer.stats()["messages_rejected"] == 0  # no late header arrived
        assert pair.producer.stats()["sends_failed"] >= 1  # "late" gave up before its header
        assert pair.idle()
    finally:
        pair.shutdown()
