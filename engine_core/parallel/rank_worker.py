"""A tensor-parallel rank other than 0: ``python -m engine_core.parallel.rank_worker``.

It builds the same engine as rank 0 (joining the process group, loading its shards,
sizing the KV cache, capturing graphs and warming up in lockstep with it), then runs each
``RankStep`` rank 0 sends: launch the step, then collect the one before it, as rank 0's
async scheduling does. Its sampler takes rank 0's tokens from a broadcast. It exits on
``RankStop`` or when rank 0 (its parent) is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import zmq

from engine_core.engine_process import die_with_parent
from engine_core.errors import MessageDecodeError
from engine_core.parallel.messages import RANK_CODEC, RankInit, RankStep, RankStop

logger = logging.getLogger("pdserve.parallel")

_POLL_MS = 100


def _receive(socket: zmq.Socket, parent_pid: int) -> object | None:
    """The next message, or None once the parent is gone."""
    while not socket.poll(_POLL_MS):
        if os.getppid() != parent_pid:
            return None
    return RANK_CODEC.decode(socket.recv())


def serve_rank(address: str, parent_pid: int) -> int:
    """Build this rank's engine from the first message, then follow rank 0's steps."""
    from engine_core.engine_core import EngineCore

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    engine = None
    try:
        init = _receive(socket, parent_pid)
        if not isinstance(init, RankInit):
            logger.error("expected RankInit first, got %s", type(init).__name__)
            return 1
        engine = EngineCore(init.config)
        runner = engine.runner
        in_flight = None
        while True:
            message = _receive(socket, parent_pid)
            if message is None or isinstance(message, RankStop):
                return 0
            if not isinstance(message, RankStep):
                raise MessageDecodeError(f"unexpected {type(message).__name__}")
            if engine.host_kv is not None:
                engine.host_kv.poll()
            launched = runner.launch(message.scheduler_output())
            if in_flight is not None:
                runner.collect(in_flight)
            in_flight = launched if launched.sampled else None
    finally:
        if engine is not None:
            engine.shutdown()
        socket.close()
        context.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="rank 0's step socket")
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0's pid")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [rank] %(name)s: %(message)s")
    die_with_parent(args.parent_pid)
    code = serve_rank(args.address, args.parent_pid)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: an NCCL communicator's destructor waits on its peers.
    os._exit(code)


if __name__ == "__main__":
    main()
