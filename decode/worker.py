"""The decode worker: engine-core + consumer connector + API server + proxy heartbeat.

The same wiring as the prefill worker with the ``kv_consumer`` role; the connector's
consumer side waits for P's KV (or recomputes when it fails).
"""

from __future__ import annotations

import argparse

from prefill.worker import add_worker_arguments, engine_factory, run_worker

__all__ = ["add_worker_arguments", "engine_factory", "run"]


def run(args: argparse.Namespace) -> int:
    """``pdserve decode``."""
    return run_worker(args, "kv_consumer")
