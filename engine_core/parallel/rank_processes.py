"""Rank 0's handle on ranks 1..N-1: their processes, the step channel to them and, with a
KV connector, the report channel back.

Each rank is a ``python -m engine_core.parallel.rank_worker`` process with a ZMQ PULL
socket connected to a PUSH socket bound here; it receives ``RankInit`` first, then one
``RankStep`` per engine step, then ``RankStop``. With a connector every rank also pushes
``RankReport`` s (its finished transfers) to one PULL socket bound here; a thread hands them
to rank 0's connector (``RankZeroConnector.add_rank_report``) and tells it of a rank that
exited. Both channels are bound on loopback, like the engine's own sockets; the cluster
secret never crosses them: each rank reads it from its stdin, a pipe only rank 0 holds. The
ranks exit with this process (their parent): they also die with it when it is killed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import weakref
from dataclasses import replace

import zmq

from engine_core.cluster.trust import ClusterSecret
from engine_core.config import EngineConfig
from engine_core.errors import ConfigError, EngineDeadError, MessageDecodeError
from engine_core.kv_connector import ConnectorWorker, RankZeroConnector
from engine_core.parallel.group import free_init_method
from engine_core.parallel.messages import RANK_CODEC, RankInit, RankReport, RankStep, RankStop
from engine_core.parallel.support import check_parallel_support
from engine_core.sched.outputs import SchedulerOutput

logger = logging.getLogger("pdserve.parallel")

_STOP_WAIT_S = 10.0
_HOST = "127.0.0.1"
_REPORT_POLL_MS = 100


def start_other_ranks(config: EngineConfig, connector: ConnectorWorker | None
                      ) -> tuple[EngineConfig, RankProcesses | None]:
    """For a tensor-parallel engine: refuse what TP does not cover, and on rank 0 pick the
    group's rendezvous and spawn ranks 1..N-1. Returns the config this rank runs (with the
    rendezvous on rank 0) and the ranks it drives (None unless rank 0 of N > 1). Rank 0's
    ``connector`` (None: colocated) must be a ``RankZeroConnector``."""
    parallel = config.parallel
    if not parallel.is_parallel:
        return config, None
    check_parallel_support(config)
    if parallel.rank != 0:
        return config, None
    if connector is not None and not isinstance(connector, RankZeroConnector):
        raise ConfigError(f"--tensor-parallel-size {parallel.tensor_parallel_size}: the KV "
                          f"connector {type(connector).__name__} has no per-rank worker side")
    config = replace(config, parallel=replace(parallel,
                                              distributed_init_method=free_init_method()))
    return config, RankProcesses(config, connector)


class RankProcesses:
    """Spawns ranks 1..N-1 of ``config`` (whose ``distributed_init_method`` is set), sends
    them each step before rank 0 launches it and, with a ``connector``, feeds it their
    reports."""

    def __init__(self, config: EngineConfig, connector: RankZeroConnector | None = None
                 ) -> None:
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._processes: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []  # started ones only
        self._report_sockets: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._sockets,
                                           self._context, self._stopping, self._threads,
                                           self._report_sockets)
        self._connector = connector
        reports: _ReportReceiver | None = None
        report_address = factory = None
        secret = (config.kv_transfer.cluster_secret if config.kv_transfer is not None
                  else ClusterSecret())
        if connector is not None:
            report_socket = self._context.socket(zmq.PULL)
            report_socket.setsockopt(zmq.LINGER, 0)
            report_socket.setsockopt(zmq.MAXMSGSIZE, RANK_CODEC.max_bytes)
            self._report_sockets.append(report_socket)
            report_address = f"tcp://{_HOST}:{report_socket.bind_to_random_port(f'tcp://{_HOST}')}"
            factory = connector.rank_factory
            reports = _ReportReceiver(report_socket, self._processes, connector,
                                      self._stopping)
        for rank in range(1, config.parallel.tensor_parallel_size):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            port = socket.bind_to_random_port(f"tcp://{_HOST}")
            self._sockets.append(socket)
            process = subprocess.Popen(
                [sys.executable, "-m", "engine_core.parallel.rank_worker",
                 "--address", f"tcp://{_HOST}:{port}", "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE)
            self._processes.append(process)
            assert process.stdin is not None
            with process.stdin:
                process.stdin.write(secret.value)
            rank_config = replace(config, parallel=replace(config.parallel, rank=rank))
            socket.send(RANK_CODEC.encode(RankInit(rank_config, factory, report_address)))
        if reports is not None:
            reports.start()
            self._threads.append(reports)
        logger.info("started tensor-parallel ranks 1..%d (pids %s)", len(self._processes),
                    [p.pid for p in self._processes])

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if any rank has exited."""
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                raise EngineDeadError(f"tensor-parallel rank {rank} exited with code {code}")

    def send_step(self, output: SchedulerOutput) -> None:
        """Hand every rank the step rank 0 is about to launch, with its share of the
        connector metadata."""
        self.check_alive()
        connector_shares = (None if self._connector is None
                            else self._connector.rank_shares(output.kv_connector_metadata))
        if not connector_shares or not any(connector_shares):
            payload = RANK_CODEC.encode(RankStep.of(output))
            for socket in self._sockets:
                socket.send(payload, copy=False)
            return
        for socket, share in zip(self._sockets, connector_shares, strict=True):
            socket.send(RANK_CODEC.encode(RankStep.of(output, share)), copy=False)

    def shutdown(self) -> None:
        """Ask every rank to stop, wait for it, and kill what does not exit."""
        self._finalizer()


class _ReportReceiver(threading.Thread):
    """Takes the ranks' ``RankReport`` s off the report socket and hands them to rank 0's
    connector; tells it once of each rank that exited (checked every poll)."""

    def __init__(self, socket: zmq.Socket, processes: list[subprocess.Popen],
                 connector: RankZeroConnector, stopping: threading.Event) -> None:
        super().__init__(name="rank-reports", daemon=True)
        self._socket = socket
        self._processes = processes
        self._connector = connector
        self._stopping = stopping
        self._lost: set[int] = set()

    def run(self) -> None:
        while not self._stopping.is_set():
            if self._socket.poll(_REPORT_POLL_MS):
                self._take(self._socket.recv())
            self._check_exits()

    def _take(self, payload: bytes) -> None:
        try:
            report = RANK_CODEC.decode(payload)
        except MessageDecodeError as exc:
            logger.error("dropped a malformed rank report: %s", exc)
            return
        if (not isinstance(report, RankReport) or not 1 <= report.rank <= len(self._processes)
                or report.rank in self._lost):
            logger.error("dropped an unexpected rank message %s", type(report).__name__)
            return
        self._connector.add_rank_report(report.rank, report.finished(), report.connector_stats,
                                        report.idle)

    def _check_exits(self) -> None:
        for rank, process in enumerate(self._processes, start=1):
            if rank not in self._lost and process.poll() is not None:
                self._lost.add(rank)
                if not self._stopping.is_set():
                    logger.error("tensor-parallel rank %d exited: its transfers fail", rank)
                    self._connector.rank_lost(rank)


def _stop(processes: list[subprocess.Popen], sockets: list[zmq.Socket],
          context: zmq.Context, stopping: threading.Event,
          threads: list[threading.Thread], report_sockets: list[zmq.Socket]) -> None:
    stopping.set()
    stop = RANK_CODEC.encode(RankStop())
    for socket, process in zip(sockets, processes):
        if process.poll() is None:
            try:
                socket.send(stop, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for process in processes:
        try:
            process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel rank pid %d did not stop; killing it", process.pid)
            process.kill()
            process.wait()
    for thread in threads:
        thread.join()
    for socket in sockets + report_sockets:
        socket.close()
    context.term()
