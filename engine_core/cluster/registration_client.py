"""The client a worker heartbeats to the proxy with (ZMQ DEALER to the proxy's ROUTER).

A worker sends a ``Heartbeat`` every few seconds; the first one registers it, and a
``Deregister`` on shutdown removes it at once. Each travels in the cluster's authenticated
envelope (``trust.py``), sealed under a sender id new per client: the proxy binds the
worker's name to it. Messages are one-way: a worker never waits on
the proxy, so a proxy that is down or restarting costs a worker nothing but dropped
heartbeats (sends never block: IMMEDIATE, a small HWM, NOBLOCK, and linger 0 on close).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import secrets
from collections.abc import Awaitable, Callable

import zmq

from engine_core.cluster.messages import REGISTRATION_CODEC, Deregister, Heartbeat, WorkerLoad
from engine_core.cluster.trust import CHANNEL_REGISTRATION, ClusterSecret, Sealer
from engine_core.parallel.kv_layout import PeerRanks

logger = logging.getLogger(__name__)

# Heartbeats that could not leave (no connection yet) are retried after 10, 20, 40 ... ms,
# at most 200 ms apart.
_FIRST_RETRY_S = 0.01
_MAX_RETRY_S = 0.2


LoadProvider = Callable[[], "WorkerLoad | Awaitable[WorkerLoad]"]


class RegistrationClient:
    """Sends this worker's heartbeat to the proxy every ``interval_s`` from an asyncio task.

    ``load_provider`` returns the current ``WorkerLoad`` (sync or async); it is called once
    per heartbeat and its failure only skips that heartbeat's stats. Messages are sealed with
    ``secret``.
    """

    def __init__(self, proxy_address: str, *, role: str, http_address: str, model: str,
                 zmq_address: str | None = None, version: str = "",
                 load_provider: LoadProvider | None = None, interval_s: float = 3.0,
                 send_timeout_s: float = 1.0, context: zmq.Context | None = None,
                 secret: ClusterSecret = ClusterSecret(),
                 kv_ranks: PeerRanks | None = None) -> None:
        self._proxy_address = proxy_address
        self._sealer = Sealer(secret, CHANNEL_REGISTRATION, f"{role}-{secrets.token_hex(8)}")
        self._template = Heartbeat(role=role, http_address=http_address, model=model,
                                   zmq_address=zmq_address, version=version,
                                   heartbeat_interval_s=interval_s, kv_ranks=kv_ranks)
        self._load_provider = load_provider
        self._interval_s = interval_s
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._socket: zmq.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._send_now = asyncio.Event()  # set: the next heartbeat leaves without waiting
        self.num_sent = 0
        self.num_dropped = 0
        # Whether the latest heartbeat left for a connected proxy (a worker's readiness).
        self.registered = False

    def start(self) -> None:
        """Connect and start heartbeating (call from a running event loop)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a proxy that is not there
        socket.setsockopt(zmq.SNDHWM, 8)
        socket.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        socket.connect(f"tcp://{self._proxy_address}")
        self._socket = socket
        self._task = asyncio.create_task(self._run(), name="registration-heartbeat")

    def send_now(self) -> None:
        """Send the next heartbeat now rather than at the next tick (the worker's state
        changed: asleep or awake); dropped sends are retried as every heartbeat is."""
        self._send_now.set()

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; by default tell the proxy to drop this worker now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.registered = False
        if self._socket is not None:
            if deregister:
                self._send(Deregister(self._template.http_address))
            self._socket.close(linger=0)
            self._socket = None
        if self._owns_context:
            self._context.term()

    async def heartbeat_once(self) -> bool:
        """Send one heartbeat now; return whether it left (False: dropped)."""
        load = WorkerLoad()
        if self._load_provider is not None:
            try:
                result = self._load_provider()
                load = await result if inspect.isawaitable(result) else result
            except Exception:  # stats are best effort; the heartbeat itself matters
                logger.exception("load provider failed; heartbeat sent without stats")
        message = dataclasses.replace(self._template, load=load)
        self.registered = self._send(message)
        return self.registered

    def _send(self, message: Heartbeat | Deregister) -> bool:
        assert self._socket is not None
        try:
            self._socket.send(self._sealer.seal(REGISTRATION_CODEC.encode(message)),
                              flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again: not connected yet or the proxy is slow
            self.num_dropped += 1
            return False
        self.num_sent += 1
        return True

    async def _run(self) -> None:
        retry_s = _FIRST_RETRY_S
        while True:
            self._send_now.clear()  # this heartbeat reads the state that asked for it
            if not await self.heartbeat_once():
                # Not connected yet (a fresh socket takes a few ms): retry soon, backing off,
                # so a new worker is routable within milliseconds of listening.
                await asyncio.sleep(min(retry_s, _MAX_RETRY_S, self._interval_s))
                retry_s *= 2
                continue
            retry_s = _FIRST_RETRY_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._send_now.wait(), self._interval_s)
