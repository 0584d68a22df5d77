"""Rank 0's handle on ranks 1..N-1: their processes and the step channel to them.

Each rank is a ``python -m engine_core.parallel.rank_worker`` process with a ZMQ PULL
socket connected to a PUSH socket bound here; it receives ``RankInit`` first, then one
``RankStep`` per engine step, then ``RankStop``. The ranks exit with this process (their
parent): they also die with it when it is killed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import weakref
from dataclasses import replace

import zmq

from engine_core.config import EngineConfig
from engine_core.errors import EngineDeadError
from engine_core.parallel.group import free_init_method
from engine_core.parallel.messages import RANK_CODEC, RankInit, RankStep, RankStop
from engine_core.parallel.support import check_parallel_support
from engine_core.sched.outputs import SchedulerOutput

logger = logging.getLogger("pdserve.parallel")

_STOP_WAIT_S = 10.0
_HOST = "127.0.0.1"


def start_other_ranks(config: EngineConfig, with_connector: bool
                      ) -> tuple[EngineConfig, RankProcesses | None]:
    """For a tensor-parallel engine: refuse what TP does not cover, and on rank 0 pick the
    group's rendezvous and spawn ranks 1..N-1. Returns the config this rank runs (with the
    rendezvous on rank 0) and the ranks it drives (None unless rank 0 of N > 1)."""
    parallel = config.parallel
    if not parallel.is_parallel:
        return config, None
    check_parallel_support(config, with_connector=with_connector)
    if parallel.rank != 0:
        return config, None
    config = replace(config, parallel=replace(parallel,
                                              distributed_init_method=free_init_method()))
    return config, RankProcesses(config)


class RankProcesses:
    """Spawns ranks 1..N-1 of ``config`` (whose ``distributed_init_method`` is set) and
    sends them each step before rank 0 launches it."""

    def __init__(self, config: EngineConfig) -> None:
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._processes: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._sockets,
                                           self._context)
        for rank in range(1, config.parallel.tensor_parallel_size):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            port = socket.bind_to_random_port(f"tcp://{_HOST}")
            self._sockets.append(socket)
            self._processes.append(subprocess.Popen(
                [sys.executable, "-m", "engine_core.parallel.rank_worker",
                 "--address", f"tcp://{_HOST}:{port}", "--parent-pid", str(os.getpid())]))
            rank_config = replace(config, parallel=replace(config.parallel, rank=rank))
            socket.send(RANK_CODEC.encode(RankInit(rank_config)))
        logger.info("started tensor-parallel ranks 1..%d (pids %s)", len(self._processes),
                    [p.pid for p in self._processes])

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if any rank has exited."""
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                raise EngineDeadError(f"tensor-parallel rank {rank} exited with code {code}")

    def send_step(self, output: SchedulerOutput) -> None:
        """Hand every rank the step rank 0 is about to launch."""
        self.check_alive()
        payload = RANK_CODEC.encode(RankStep.of(output))
        for socket in self._sockets:
            socket.send(payload, copy=False)

    def shutdown(self) -> None:
        """Ask every rank to stop, wait for it, and kill what does not exit."""
        self._finalizer()


def _stop(processes: list[subprocess.Popen], sockets: list[zmq.Socket],
          context: zmq.Context) -> None:
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
    for socket in sockets:
        socket.close()
    context.term()
