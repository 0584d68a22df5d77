"""NCCL's pair semantics without CUDA, for CPU tests of the connector's NCCL code paths.

``FakeNcclTransport`` keeps ``NcclPairTransport``'s contract (transport.py): the producer
reuses a healthy pair and sends ``NcclHello`` only on first contact or after ``abort``; the
consumer replaces its pair on every hello and cannot receive without one. Its data moves
through a ``Fabric`` shared by the processes of a test (passed in: no module state), where,
as in NCCL, a send completes only once the rank that joined the same communicator received
it: a send to a rank that is gone (its process restarted) never completes, and the sender
gives up at its deadline, as the real transport's wait and watchdog do.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.p2p_nccl.messages import KVSendHeader, NcclHello
from connectors.p2p_nccl.transport import PostedRecv
from engine_core.errors import KVTransferError


@dataclass
class _Comm:
    """One 2-rank communicator: what rank 0 sent, in order, and how much rank 1 took."""

    sent: list[bytes] = field(default_factory=list)
    taken: int = 0


class Fabric:
    """The communicators of every fake transport of a test, by unique id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._comms: dict[bytes, _Comm] = {}

    def join(self, unique_id: bytes) -> _Comm:
        with self.lock:
            return self._comms.setdefault(unique_id, _Comm())


@dataclass
class _FakePair:
    comm: _Comm
    aborted: bool = False


class FakeNcclTransport:
    """``NcclPairTransport``'s pair lifecycle and matching on a ``Fabric``, without CUDA."""

    name = "fake-nccl"
    uses_data_messages = False

    def __init__(self, fabric: Fabric, own_address: str) -> None:
        self._fabric = fabric
        self._own_address = own_address
        self._epoch = os.urandom(8).hex()
        self._pairs: dict[tuple[str, str], _FakePair] = {}
        self._lock = threading.Lock()
        self.data_calls = 0
        self.hellos_sent = 0

    def open_pair(self, client: Any, peer_address: str, deadline: float) -> None:
        """As the real one: a no-op while the pair is healthy, else a new id and a hello."""
        with self._lock:
            pair = self._pairs.get(("send", peer_address))
            if pair is not None and not pair.aborted:
                return
            unique_id = os.urandom(128)  # an ncclUniqueId's size
            self._pairs[("send", peer_address)] = _FakePair(self._fabric.join(unique_id))
            self.hellos_sent += 1
        client.send(NcclHello(self._own_address, self._epoch, unique_id))

    def send_call(self, client: Any, header: KVSendHeader, first_layer: int,
                  buffer: torch.Tensor, event: Any, deadline: float) -> None:
        pair = self._live("send", client.address)
        with self._fabric.lock:
            pair.comm.sent.append(buffer.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
        self.data_calls += 1

    def finish_sends(self, peer_address: str, deadline: float) -> None:
        """Wait until the peer rank received every send, the pair is aborted, or the deadline."""
        pair = self._live("send", peer_address)
        while True:
            with self._fabric.lock:
                if pair.comm.taken == len(pair.comm.sent):
                    return
            if pair.aborted:
                raise KVTransferError(f"NCCL pair with {peer_address} failed: aborted")
            if time.monotonic() > deadline:
                raise KVTransferError(f"NCCL transfer with {peer_address} timed out")
            time.sleep(0.001)

    @contextlib.contextmanager
    def gather_context(self, peer_address: str, event: Any) -> Iterator[None]:
        yield

    def on_hello(self, hello: NcclHello) -> None:
        """As the real one: drop any old pair with this producer and join the new one."""
        with self._lock:
            self._pairs[("recv", hello.producer_address)] = _FakePair(self._fabric.join(hello.unique_id))

    def post_recv(self, peer_address: str, buffers: list[torch.Tensor], ready: Any = None,
                  on_landed: Callable[[], None] | None = None,
                  after_each: Callable[[int], None] | None = None) -> PostedRecv:
        """Raises without a pair, as the real one; the poll takes the sends in order, each
        followed by ``after_each`` (a stream runs them in that order); nothing runs after an
        abort, so the posted work is drained at once."""
        pair = self._live("recv", peer_address)
        pending = list(enumerate(buffers))
        self.data_calls += len(buffers)

        def poll() -> bool:
            if pair.aborted:
                raise KVTransferError(f"NCCL pair with {peer_address} failed: aborted")
            with self._fabric.lock:
                while pending and pair.comm.taken < len(pair.comm.sent):
                    data = pair.comm.sent[pair.comm.taken]
                    index, buffer = pending.pop(0)
                    target = buffer.view(torch.uint8).reshape(-1)
                    target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    pair.comm.taken += 1
                    if after_each is not None:
                        after_each(index)
            return not pending

        return PostedRecv(poll=poll, drained=lambda: True)

    def count_recv_call(self) -> None:
        return None

    def abort(self, peer_address: str) -> None:
        """Drop every pair with this peer; the peer's own rank is not told (as in NCCL)."""
        with self._lock:
            for key in [key for key in self._pairs if key[1] == peer_address]:
                self._pairs.pop(key).aborted = True

    def close(self) -> None:
        with self._lock:
            for pair in self._pairs.values():
                pair.aborted = True
            self._pairs.clear()

    def _live(self, direction: str, peer_address: str) -> _FakePair:
        with self._lock:
            pair = self._pairs.get((direction, peer_address))
        if pair is None or pair.aborted:
            raise KVTransferError(f"no NCCL pair with {peer_address}")
        return pair
