"""A tensor-parallel rank other than 0: ``python -m engine_core.parallel.rank_worker``.

It builds the same engine as rank 0 (joining the process group, loading its shards,
sizing the KV cache, capturing graphs and warming up in lockstep with it), then runs each
``RankStep`` rank 0 sends: launch the step, then collect the one before it, as rank 0's
async scheduling does. Its sampler takes rank 0's tokens from a broadcast. It exits on
``RankStop`` or when rank 0 (its parent) is gone.

With a KV connector the rank runs its own connector worker (built by the factory
``RankInit`` names, at ``kv_port + rank``), fed its share of each step, and every loop turn,
with a step or without (a landed load or a finished send rings its doorbell), lands its
loads, collects its finished transfers and pushes them to rank 0 as a ``RankReport``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import replace
from typing import Any

import zmq

from engine_core.cluster.trust import ClusterSecret
from engine_core.engine_process import die_with_parent
from engine_core.errors import ConfigError, MessageDecodeError
from engine_core.kv_connector import (
    FinishedTransfers,
    NullConnectorScheduler,
    RankConnectorWorker,
)
from engine_core.parallel.group import rank_device
from engine_core.parallel.messages import RANK_CODEC, RankInit, RankReport, RankStep, RankStop

logger = logging.getLogger("pdserve.parallel")

_POLL_MS = 100


def _wait(poller: zmq.Poller, parent_pid: int) -> dict[Any, int] | None:
    """The ready sockets of one poll, or None once the parent is gone."""
    ready = dict(poller.poll(_POLL_MS))
    if not ready and os.getppid() != parent_pid:
        return None
    return ready


def _receive(socket: zmq.Socket, parent_pid: int) -> object | None:
    """The next message, or None once the parent is gone."""
    while not socket.poll(_POLL_MS):
        if os.getppid() != parent_pid:
            return None
    return RANK_CODEC.decode(socket.recv())


def resolve_connector_factory(path: str) -> Any:
    """The function ``module:function`` names (``RankZeroConnector.rank_factory``)."""
    module_name, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"rank connector factory {path!r}: {exc}") from None


class _Reports:
    """This rank's finished transfers on their way to rank 0."""

    def __init__(self, rank: int, socket: zmq.Socket, connector: RankConnectorWorker) -> None:
        self._rank = rank
        self._socket = socket
        self._connector = connector
        self._last: tuple[dict[str, float], bool] = ({}, True)

    def send(self, *parts: FinishedTransfers) -> None:
        """Land this rank's loads, collect its finished transfers, and report what ended
        (``parts``: what this turn's step already collected) or a change of its connector's
        stats or idleness."""
        report = FinishedTransfers()
        for part in (*parts, self._connector.land_loads(), self._connector.get_finished()):
            report.sending |= part.sending
            report.recving |= part.recving
            report.failed_recving |= part.failed_recving
        state = (self._connector.stats(), self._connector.is_idle())
        if report.sending or report.recving or report.failed_recving or state != self._last:
            self._socket.send(RANK_CODEC.encode(RankReport.of(self._rank, report, *state)))
            self._last = state


def serve_rank(address: str, parent_pid: int, secret: ClusterSecret = ClusterSecret()) -> int:
    """Build this rank's engine from the first message (its connector under ``secret``, the
    cluster secret, which the step channel never carries), then follow rank 0's steps."""
    from engine_core.engine_core import EngineCore

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    engine = None
    report_socket = None
    try:
        init = _receive(socket, parent_pid)
        if not isinstance(init, RankInit):
            logger.error("expected RankInit first, got %s", type(init).__name__)
            return 1
        connector: RankConnectorWorker | None = None
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        config = init.config
        if config.kv_transfer is not None:
            config = replace(config, kv_transfer=replace(config.kv_transfer,
                                                         cluster_secret=secret))
        if init.connector_factory is not None and init.report_address is not None:
            factory = resolve_connector_factory(init.connector_factory)
            connector = factory(config, rank_device(config.device.resolve(), config.parallel))
            report_socket = context.socket(zmq.PUSH)
            report_socket.setsockopt(zmq.LINGER, 0)
            report_socket.connect(init.report_address)
        engine = EngineCore(config, connector=None if connector is None
                            else (NullConnectorScheduler(), connector))
        reports = doorbell = None
        if connector is not None and report_socket is not None:
            reports = _Reports(config.parallel.rank, report_socket, connector)
            doorbell = connector.doorbell()
            if doorbell is not None:
                poller.register(doorbell.fileno(), zmq.POLLIN)
        runner = engine.runner
        in_flight = None
        while True:
            ready = _wait(poller, parent_pid)
            if ready is None:
                return 0
            if doorbell is not None and doorbell.fileno() in ready:
                doorbell.drain()
            collected: list[FinishedTransfers] = []
            if socket in ready:
                message = RANK_CODEC.decode(socket.recv())
                if isinstance(message, RankStop):
                    return 0
                if not isinstance(message, RankStep):
                    raise MessageDecodeError(f"unexpected {type(message).__name__}")
                if engine.host_kv is not None:
                    engine.host_kv.poll()
                share = (None if connector is None or message.connector_share is None
                         else connector.decode_share(message.connector_share))
                launched = runner.launch(message.scheduler_output(share))
                collected.append(FinishedTransfers(launched.finished_sending,
                                                   launched.finished_recving,
                                                   launched.failed_recving))
                if in_flight is not None:
                    runner.collect(in_flight)
                in_flight = launched if launched.sampled else None
            if reports is not None:
                reports.send(*collected)
    finally:
        if engine is not None:
            engine.shutdown()
        if report_socket is not None:
            report_socket.close()
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
    secret = ClusterSecret(sys.stdin.buffer.read())  # rank 0 writes it and closes the pipe
    code = serve_rank(args.address, args.parent_pid, secret)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: an NCCL communicator's destructor waits on its peers.
    os._exit(code)


if __name__ == "__main__":
    main()
