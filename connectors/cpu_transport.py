"""CPU data plane of the P2P connector: tensor bytes over the ZMQ control channel.

The same protocol as NCCL (pull request, header validated before receiving, one data call
per group of layers, aborts, deadlines); only the bytes travel as a ZMQ frame after a
``KVLayerData`` message instead of an NCCL send. Chosen when the engine runs on CPU, so
the whole protocol runs in CI.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.messages import KVLayerData, KVSendHeader, NcclHello


class CpuTransport:
    """Sends each data call as one ZMQ message; the receiver's control thread copies it in."""

    name = "cpu"
    uses_data_messages = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data_calls = 0

    def open_pair(self, client: ControlClient, peer_address: str, deadline: float) -> None:
        """Nothing to set up: the DEALER connects (and reconnects) by itself."""
        return None

    def send_call(self, client: ControlClient, header: KVSendHeader, first_layer: int,
                   buffer: torch.Tensor, event: Any, deadline: float) -> None:
        """One message per call: K and V of every block of layers from ``first_layer``."""
        payload = buffer.contiguous().view(torch.uint8).reshape(-1).numpy()
        client.send(KVLayerData(transfer_id=header.transfer_id, producer_epoch=header.producer_epoch,
                                seq=header.seq, layer=first_layer, nbytes=int(payload.nbytes)),
                    [memoryview(payload)])
        with self._lock:
            self.data_calls += 1

    @contextlib.contextmanager
    def gather_context(self, peer_address: str, event: Any) -> Iterator[None]:
        """CPU work is synchronous: gather where we are."""
        yield

    def finish_sends(self, peer_address: str, deadline: float) -> None:
        return None

    def post_recv(self, peer_address: str, buffers: list[torch.Tensor],
                  on_landed: Callable[[], None] | None = None) -> Callable[[], bool] | None:
        """Bytes arrive as ``KVLayerData`` messages (the control thread rings on the last);
        nothing to post."""
        return None

    def count_recv_call(self) -> None:
        with self._lock:
            self.data_calls += 1

    def on_hello(self, hello: NcclHello) -> None:
        raise ValueError("NcclHello sent to a CPU transport")

    def abort(self, peer_address: str) -> None:
        return None

    def close(self) -> None:
        return None
