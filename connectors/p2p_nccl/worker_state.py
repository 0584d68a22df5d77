"""What the producer and consumer halves of a P2P connector worker share.

One ``WorkerState`` a worker: the address and process epoch it speaks for, the control codec,
the data-plane transport (one pair per peer), the lock that guards both halves' tables, the
event counters, the doorbell, and the registered paged caches with their geometry.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from connectors.p2p_nccl.messages import make_codec
from engine_core.config import KVTransferConfig
from engine_core.doorbell import Doorbell
from engine_core.errors import KVTransferError
from engine_core.parallel.kv_layout import HeadSlice

logger = logging.getLogger(__name__)

# The worker's event counters (``stats()``; /metrics exports each as a counter).
EVENT_COUNTERS = (
    "control_messages_sent", "bytes_sent", "bytes_received", "transfers_sent",
    "transfers_received", "sends_failed", "transfers_failed", "transfers_timed_out",
    "messages_rejected", "leases_expired", "registrations_expired", "loads_pushed_back",
    "consumer_restarts", "loads_streamed", "pulls_refused")


def make_transport(config: KVTransferConfig, device: str) -> Any:
    """The data plane: NCCL for CUDA engines, tensor bytes over ZMQ for CPU engines."""
    kind = config.transport
    if kind == "auto":
        kind = "nccl" if str(device).startswith("cuda") else "cpu"
    if kind == "nccl":
        from connectors.p2p_nccl.transport import NcclPairTransport  # imports cupy lazily

        return NcclPairTransport(device, config)
    from connectors.cpu_transport import CpuTransport

    return CpuTransport(device)


class WorkerState:
    """The state both halves read and write; ``lock`` guards every table either keeps."""

    def __init__(self, config: KVTransferConfig, device: str, transport: Any | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.device = torch.device(device)
        self.clock = clock
        self.own_address = f"{config.kv_ip}:{config.kv_port}"
        self.epoch = uuid.uuid4().hex
        self.codec = make_codec(config.cluster_secret, self.own_address)
        self.transport = transport if transport is not None else make_transport(config, device)
        self.doorbell = Doorbell()
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.stacked: torch.Tensor | None = None  # the caches as one [layers, 2, blocks, ...]
        self.geometry: tuple[int, str, list[int], int] | None = None

    def require_geometry(self) -> tuple[int, str, list[int], int]:
        """(layers, dtype, block shape, element size) of the registered caches."""
        if self.geometry is None:
            raise KVTransferError("register_kv_caches was not called")
        return self.geometry

    def slice_shape(self, heads: HeadSlice | None) -> list[int]:
        """``[block_size, heads, head_dim]`` of a transfer that moves ``heads`` of each block
        (None: all of them)."""
        block_size, num_heads, head_dim = self.require_geometry()[2]
        return [block_size, num_heads if heads is None else heads.count, head_dim]

    def require_stacked(self) -> torch.Tensor:
        """The registered caches stacked as one tensor."""
        if self.stacked is None:
            raise KVTransferError("register_kv_caches was not called")
        return self.stacked

    def record_event(self) -> Any:
        """A CUDA event recorded on the current stream (None on CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def reject(self, what: str, reason: str) -> None:
        """Log and count a refused control message."""
        logger.warning("rejected kv %s: %.300s", what, reason)
        with self.lock:
            self.counters["messages_rejected"] += 1
