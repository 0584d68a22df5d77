"""The proxy's ZMQ registration server and the client workers use to heartbeat to it.

Workers hold a DEALER socket connected to the proxy's ROUTER (``proxy_ip:proxy_port``,
default port 30001) and send a ``Heartbeat`` every few seconds; the first one registers
the worker, and a ``Deregister`` on shutdown removes it at once. Every message travels in
the cluster's authenticated envelope (``engine_core.cluster.trust``), sealed by a sender id
new per worker process: forged, stale and replayed ones are refused, and the registry binds
a worker's name to the sender that registered it. Messages are one-way: a
worker never waits on the proxy, so a proxy that is down or restarting costs a worker
nothing but dropped heartbeats (sends never block: IMMEDIATE, a small HWM, NOBLOCK, and
linger 0 on close).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from engine_core.cluster.trust import (
    CHANNEL_REGISTRATION,
    Clock,
    ClusterSecret,
    Sealer,
    TrustRefusal,
    Verifier,
    max_sealed_bytes,
)
from engine_core.errors import MessageDecodeError
from proxy.messages import (
    REGISTRATION_CODEC,
    Deregister,
    Heartbeat,
    WorkerLoad,
    decode_registration,
)
from proxy.registry import InstanceRegistry

logger = logging.getLogger(__name__)

YIELD_EVERY = 32  # registration messages handled between turns given back to the event loop
LOG_EVERY_BAD = 1000  # malformed registration messages per logged warning (all are counted)

DEFAULT_REGISTRATION_PORT = 30001
# Heartbeats that could not leave (no connection yet) are retried after 10, 20, 40 ... ms,
# at most 200 ms apart.
_FIRST_RETRY_S = 0.01
_MAX_RETRY_S = 0.2


class RegistrationServer:
    """ROUTER socket feeding heartbeats into an ``InstanceRegistry``; bad messages are counted,
    refused ones (envelope, identity, capacity) are counted by reason in ``refusals``."""

    def __init__(self, registry: InstanceRegistry, host: str = "127.0.0.1",
                 port: int = DEFAULT_REGISTRATION_PORT,
                 context: zmq.asyncio.Context | None = None,
                 secret: ClusterSecret = ClusterSecret(), clock: Clock = time.time) -> None:
        self._registry = registry
        self._verifier = Verifier(secret, CHANNEL_REGISTRATION, clock=clock)
        self._host = host
        self._requested_port = port
        self._owns_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.num_messages = 0
        self.num_bad_messages = 0

    @property
    def stats(self) -> tuple[int, int]:
        """(messages received, messages dropped as malformed)."""
        return self.num_messages, self.num_bad_messages

    @property
    def refusals(self) -> dict[str, int]:
        """Messages refused, by reason (``engine_core.cluster.trust.REFUSAL_REASONS``)."""
        return dict(self._verifier.refusals.counts)

    async def start(self) -> None:
        """Bind (port 0 picks a free one, see ``port``) and start receiving."""
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_sealed_bytes(REGISTRATION_CODEC.max_bytes))
        if self._requested_port == 0:
            self.port = socket.bind_to_random_port(f"tcp://{self._host}")
        else:
            socket.bind(f"tcp://{self._host}:{self._requested_port}")
            self.port = self._requested_port
        self._socket = socket
        self._task = asyncio.create_task(self._receive_loop(), name="proxy-registration")
        logger.info("registration server listening on tcp://%s:%d", self._host, self.port)

    async def stop(self) -> None:
        """Stop receiving and close the socket."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._owns_context:
            self._context.term()

    def handle(self, payload: bytes) -> None:
        """Apply one sealed payload to the registry; a refused or malformed one is logged and
        counted."""
        self.num_messages += 1
        try:
            opened = self._verifier.open(payload)
        except TrustRefusal:  # counted and logged (once per peer) by the verifier
            return
        try:
            message = decode_registration(opened.payload)
        except MessageDecodeError as exc:
            self.num_bad_messages += 1
            # Every one is counted; the log gets the first and then one in LOG_EVERY_BAD
            # (a flood of them must not flood the log too).
            if self.num_bad_messages % LOG_EVERY_BAD == 1:
                logger.warning("dropped a malformed registration message (%d so far): %.200s",
                               self.num_bad_messages, exc)
            return
        try:
            if isinstance(message, Deregister):
                if self._registry.remove(message.http_address, opened.sender_id):
                    logger.info("worker %s deregistered", message.http_address)
                return
            if self._registry.heartbeat(message, opened.sender_id):
                logger.info("worker registered: role=%s http=%s kv=%s model=%s", message.role,
                            message.http_address, message.zmq_address, message.model)
        except TrustRefusal as refusal:  # another sender's name, or the registry is full
            self._verifier.refusals.refuse(refusal.reason, str(refusal), opened.sender_id)

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            try:
                frames = await self._socket.recv_multipart()
            except zmq.ZMQError as exc:
                logger.warning("registration socket error: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 2:  # [identity, payload]
                self.num_messages += 1
                self.num_bad_messages += 1
                continue
            try:
                self.handle(frames[1])
            except Exception:  # a bug must cost one message, not every later registration
                self.num_bad_messages += 1
                logger.exception("registration message failed")
            if self.num_messages % YIELD_EVERY == 0:
                # recv_multipart returns at once while messages wait: without this, a backlog
                # (or a flood on this unauthenticated port) held HTTP and streams until drained.
                await asyncio.sleep(0)


LoadProvider = Callable[[], "WorkerLoad | Awaitable[WorkerLoad]"]


class RegistrationClient:
    """Sends this worker's heartbeat to the proxy every ``interval_s`` from an asyncio task.

    ``load_provider`` returns the current ``WorkerLoad`` (sync or async); it is called once
    per heartbeat and its failure only skips that heartbeat's stats. Messages are sealed with
    ``secret`` under a sender id new per client (the identity the proxy binds the worker to).
    """

    def __init__(self, proxy_address: str, *, role: str, http_address: str, model: str,
                 zmq_address: str | None = None, version: str = "",
                 load_provider: LoadProvider | None = None, interval_s: float = 3.0,
                 send_timeout_s: float = 1.0, context: zmq.Context | None = None,
                 secret: ClusterSecret = ClusterSecret()) -> None:
        self._proxy_address = proxy_address
        self._sealer = Sealer(secret, CHANNEL_REGISTRATION, f"{role}-{secrets.token_hex(8)}")
        self._template = Heartbeat(role=role, http_address=http_address, model=model,
                                   zmq_address=zmq_address, version=version,
                                   heartbeat_interval_s=interval_s)
        self._load_provider = load_provider
        self._interval_s = interval_s
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._socket: zmq.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_sent = 0
        self.num_dropped = 0

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

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; by default tell the proxy to drop this worker now."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
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
        return self._send(dataclasses.replace(self._template, load=load))

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
            if not await self.heartbeat_once():
                # Not connected yet (a fresh socket takes a few ms): retry soon, backing off,
                # so a new worker is routable within milliseconds of listening.
                await asyncio.sleep(min(retry_s, _MAX_RETRY_S, self._interval_s))
                retry_s *= 2
                continue
            retry_s = _FIRST_RETRY_S
            await asyncio.sleep(self._interval_s)
