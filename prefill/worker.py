"""The prefill worker: the shared worker wiring with the producer role.

Its connector's producer side sends each prompt's KV to the decode worker that pulls it.
"""

from __future__ import annotations

import argparse

from connectors import create_connector
from engine_core.server.worker import add_worker_arguments, run_worker

__all__ = ["add_worker_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """``pdserve prefill``."""
    return run_worker(args, "kv_producer", create_connector)
