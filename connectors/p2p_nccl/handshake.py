"""ZMQ control channel: a ROUTER server per engine at ``kv_port``, a DEALER client per peer.

Every socket has send/receive timeouts and linger 0, so closing never blocks and a dead peer
never hangs a thread, and a message-size cap (ZMQ drops a peer that sends a larger frame).
Messages are typed dataclasses (``messages.py``) sealed in the cluster's authenticated
envelope; one that is refused (forged, stale, replayed) or fails its schema check is counted
and dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from engine_core.addresses import is_host_port
from engine_core.cluster.sealed_codec import SealedCodec
from engine_core.cluster.trust import TrustRefusal
from engine_core.errors import KVTransferError

logger = logging.getLogger(__name__)

Handler = Callable[[Any, list[zmq.Frame]], None]


def tcp_endpoint(address: str) -> str:
    """``host:port`` -> ``tcp://host:port`` (brackets IPv6 hosts)."""
    if not is_host_port(address):
        raise KVTransferError(f"bad kv address {address!r}, expected host:port")
    host, _, port = address.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class ControlServer:
    """ROUTER socket served by one thread; hands each decoded message to ``handler``.

    The handler runs on the server thread and must not block for long; an exception in it
    is logged and counted, never fatal to the thread. ``max_message_bytes`` caps every frame
    (default: the largest control message; the CPU transport's data frames need more).
    """

    def __init__(self, address: str, codec: SealedCodec, handler: Handler,
                 poll_interval_s: float = 0.05, max_message_bytes: int | None = None) -> None:
        self.address = address
        self._codec = codec
        self._max_message_bytes = max(max_message_bytes or 0, codec.max_bytes)
        self._handler = handler
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.messages_received = 0
        self.messages_rejected = 0
        self.handler_errors = 0

    def start(self) -> None:
        """Bind (raises if the port is taken) and start serving."""
        if self._thread is not None:
            return
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        try:
            sock.bind(tcp_endpoint(self.address))
        except zmq.ZMQError as exc:
            sock.close(0)
            raise KVTransferError(f"cannot bind kv control socket {self.address}: {exc}") from exc
        self._socket = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name=f"kv-control-{self.address}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _serve(self) -> None:
        sock = self._socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(self._poll_ms):
                    continue
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
        finally:
            sock.close(0)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        # ROUTER prepends the peer identity; the message follows, then any data frames.
        if len(frames) < 2:
            self.messages_rejected += 1
            return
        try:
            message = self._codec.decode(frames[1].bytes)
        except TrustRefusal:  # counted by reason and logged once per peer by the codec
            self.messages_rejected += 1
            return
        except Exception as exc:  # MessageDecodeError, or a decoder bug: never the thread
            self.messages_rejected += 1
            logger.warning("dropped malformed kv control message: %s", exc)
            return
        self.messages_received += 1
        try:
            self._handler(message, frames[2:])
        except Exception:  # the serving thread must survive any handler bug
            self.handler_errors += 1
            logger.exception("kv control handler failed on %s", type(message).__name__)


class ControlClient:
    """DEALER socket to one peer's ROUTER; used by exactly one thread.

    Messages queue while the connection is (re)established; a send that cannot be queued
    within ``send_timeout_s`` (high-water mark reached: the peer is not reading) raises.
    """

    def __init__(self, address: str, codec: SealedCodec, send_timeout_s: float = 5.0,
                 high_water_mark: int = 1000) -> None:
        self.address = address
        self._codec = codec
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes)  # it reads nothing: nothing large
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(send_timeout_s * 1000)))
        sock.setsockopt(zmq.SNDHWM, high_water_mark)
        try:
            sock.connect(tcp_endpoint(address))
        except (zmq.ZMQError, KVTransferError) as exc:  # e.g. a host name ZMQ cannot parse
            sock.close(0)
            raise KVTransferError(f"cannot connect to {address!r}: {exc}") from exc
        self._socket = sock
        self.messages_sent = 0

    def send(self, message: Any, frames: Sequence[Any] = ()) -> None:
        """Send one message (and raw data frames); raises KVTransferError on timeout."""
        parts = [self._codec.encode(message), *frames]
        try:
            self._socket.send_multipart(parts, copy=False)
        except zmq.ZMQError as exc:
            raise KVTransferError(f"send to {self.address} failed: {exc}") from exc
        self.messages_sent += 1

    def close(self) -> None:
        """Drop queued messages and close at once."""
        self._socket.close(0)
