"""The proxy's ZMQ registration server: heartbeats from workers feed the registry.

Workers (``engine_core.cluster.registration_client.RegistrationClient``) hold a DEALER socket
connected to this ROUTER (``proxy_ip:proxy_port``, default port 30001) and send a
``Heartbeat`` every few seconds; the first one registers the worker, and a ``Deregister`` on
shutdown removes it at once. Every message travels in the cluster's authenticated envelope
(``engine_core.cluster.trust``): forged, stale and replayed ones are refused, and the registry
binds a worker's name to the sender that registered it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from engine_core.cluster.messages import REGISTRATION_CODEC, Deregister, decode_registration
from engine_core.cluster.trust import (
    CHANNEL_REGISTRATION,
    Clock,
    ClusterSecret,
    TrustRefusal,
    Verifier,
    max_sealed_bytes,
)
from engine_core.errors import MessageDecodeError
from proxy.registry import InstanceRegistry

logger = logging.getLogger(__name__)

YIELD_EVERY = 32  # registration messages handled between turns given back to the event loop
LOG_EVERY_BAD = 1000  # malformed registration messages per logged warning (all are counted)

DEFAULT_REGISTRATION_PORT = 30001


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
