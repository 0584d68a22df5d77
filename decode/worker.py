"""The decode worker: the shared worker wiring with the consumer role.

Its connector's consumer side waits for P's KV (or recomputes the prompt when it fails).
"""

from __future__ import annotations

import argparse

from connectors import create_connector
from engine_core.server.worker import add_worker_arguments, run_worker

__all__ = ["add_worker_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """``pdserve decode``."""
    return run_worker(args, "kv_consumer", create_connector)
