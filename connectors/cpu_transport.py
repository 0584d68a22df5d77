"""CPU data plane of the P2P connector: tensor bytes over the ZMQ control channel.

The same protocol as NCCL (pull request, header validated before receiving, one data call
per group of layers, aborts, deadlines); only the bytes travel as a ZMQ frame after a
``KVLayerData`` message instead of an NCCL send. Chosen when the engine runs on CPU, so
the whole protocol runs in CI. A CUDA engine may choose it too (``"transport": "cpu"`` in
``kv_connector_extra_config``): its bytes are staged through host memory (slow), but a
producer and a consumer can then share one GPU, where NCCL cannot pair a device with
itself. On CUDA it keeps NCCL's stream discipline: deferred gathers, device-to-host copies
and landing copies run on a side stream of their own that waits only on the events it is
given, so the one-GPU cluster exercises the same cross-stream ordering as two GPUs do.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.messages import KVLayerData, KVSendHeader, NcclHello


class CpuTransport:
    """Sends each data call as one ZMQ message; the receiver's control thread copies it in."""

    name = "cpu"
    uses_data_messages = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._lock = threading.Lock()
        self.data_calls = 0
        device = torch.device(device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _on_side_stream(self, event: Any) -> contextlib.AbstractContextManager[Any]:
        """CUDA: the side stream, after ``event``; CPU: nothing to order."""
        if self._stream is None:
            return contextlib.nullcontext()
        if event is not None:
            self._stream.wait_event(event)
        return torch.cuda.stream(self._stream)

    def open_pair(self, client: ControlClient, peer_address: str, deadline: float) -> None:
        """Nothing to set up: the DEALER connects (and reconnects) by itself."""
        return None

    def send_call(self, client: ControlClient, header: KVSendHeader, first_layer: int,
                   buffer: torch.Tensor, event: Any, deadline: float) -> None:
        """One message per call: K and V of every block of layers from ``first_layer``."""
        with self._on_side_stream(event):  # CUDA: after the gather, then a synchronous download
            payload = buffer.contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
        client.send(KVLayerData(transfer_id=header.transfer_id, producer_epoch=header.producer_epoch,
                                seq=header.seq, layer=first_layer, nbytes=int(payload.nbytes)),
                    [memoryview(payload)])
        with self._lock:
            self.data_calls += 1

    @contextlib.contextmanager
    def gather_context(self, peer_address: str, event: Any) -> Iterator[None]:
        """CPU: gather where we are; CUDA: on the side stream, after the step that wrote the
        blocks (``event``), as NCCL gathers on its pair's stream."""
        with self._on_side_stream(event):
            yield

    def land(self, target: torch.Tensor, data: np.ndarray, ready: Any,
             then: Callable[[], None]) -> None:
        """Write one data call's bytes into ``target`` (uint8, flat), then run ``then`` (the
        consumer's scatter of the call); on CUDA after ``ready`` (the buffer's allocation on
        the engine's stream), on the side stream. Both are finished when this returns: the
        next call may reuse ``target``, and the engine may run the request."""
        if not target.is_cuda:
            target.numpy()[:] = data
            then()
            return
        with self._on_side_stream(ready), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only frame, only ever read
            target.copy_(torch.from_numpy(data))  # pageable source: synchronous
            then()
            torch.cuda.current_stream().synchronize()

    def finish_sends(self, peer_address: str, deadline: float) -> None:
        return None

    def post_recv(self, peer_address: str, buffers: list[torch.Tensor], ready: Any = None,
                  on_landed: Callable[[], None] | None = None,
                  after_each: Callable[[int], None] | None = None) -> None:
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
