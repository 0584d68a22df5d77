"""The P2P connector's worker side: the one ``ConnectorWorker`` the engine sees.

It composes the producer half (``producer.KVProducer``: serves pulls, sends KV) and the
consumer half (``consumer.KVConsumer``: pulls KV, scatters it), which share one
``WorkerState``; it owns the control socket and dispatches each control message to the half
it concerns, and answers NCCL hellos on the transport's pairs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from connectors.p2p_nccl.consumer import KVConsumer
from connectors.p2p_nccl.handshake import ControlServer
from connectors.p2p_nccl.messages import (
    KVLayerData,
    KVPullRequest,
    KVSendAbort,
    KVSendHeader,
    NcclHello,
    check_hello,
)
from connectors.p2p_nccl.metadata import SHARE_CODEC, P2pConnectorMetadata
from connectors.p2p_nccl.producer import KVProducer
from connectors.p2p_nccl.worker_state import WorkerState
from engine_core.attention.metadata import AttentionMetadata
from engine_core.config import KVTransferConfig
from engine_core.doorbell import Doorbell
from engine_core.errors import KVTransferError
from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.kv_layout import PeerRanks
from engine_core.worker.block_copy import stack_layers

logger = logging.getLogger(__name__)


class P2pConnectorWorker:
    """Producer and/or consumer worker half; explicit ``start``/``shutdown``."""

    def __init__(self, config: KVTransferConfig, device: str, transport: Any | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ranks: PeerRanks | None = None) -> None:
        self.state = WorkerState(config, device, transport, clock)
        self._ranks = ranks  # this worker's layout and rank addresses (registered)
        self.producer_side = KVProducer(self.state)
        self.consumer_side = KVConsumer(self.state)
        # Data calls over the control socket land in the receive buffer: none is larger.
        self._server = ControlServer(
            self.state.own_address, self.state.codec, self._on_message,
            max_message_bytes=(config.kv_buffer_bytes if self.state.transport.uses_data_messages
                               else None))
        self._started = False

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.state.own_address

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Record the paged caches (``[2, num_blocks, block_size, heads, head_dim]``) and start."""
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise KVTransferError(f"unexpected kv cache shape {tuple(first.shape)}")
        self.state.stacked = stack_layers(kv_caches)
        dtype = str(first.dtype).removeprefix("torch.")
        block_shape = [int(d) for d in first.shape[2:]]
        self.state.geometry = (len(kv_caches), dtype, block_shape, first.element_size())
        self.start()

    def release_kv_caches(self) -> None:
        """Forget the caches (the engine frees them to sleep); geometry and sockets stay."""
        if not self.is_idle():
            raise KVTransferError("KV transfers in flight: the caches cannot be released")
        self.state.stacked = None

    def start(self) -> None:
        """Bind the control socket and start its thread (idempotent)."""
        if not self._started:
            self._server.start()
            self._started = True

    def shutdown(self) -> None:
        """Stop every thread and close every socket; pending transfers are dropped."""
        self.producer_side.stop_senders()
        self._server.stop()
        self.consumer_side.close_clients()
        self.state.transport.close()
        self.state.doorbell.close()
        self._started = False

    # ---- runner hooks -------------------------------------------------------------------

    def land_loads(self) -> FinishedTransfers:
        """Consumer, before the scheduling pass: report landed and failed loads at once."""
        return self.consumer_side.land_loads()

    def start_load_kv(self, metadata: P2pConnectorMetadata | None) -> None:
        """Consumer: start new loads, retry pushed-back ones, land finished ones, expire late
        ones; producer: drop the transfers its scheduler abandoned."""
        consumer = self.consumer_side
        now = self.state.clock()
        if metadata is not None:
            for request_id in metadata.cancels:
                consumer.cancel_load(request_id)
            for spec in metadata.loads:
                consumer.add_load(spec, now)
            for notice in metadata.releases:
                consumer.send_pull(notice.peer_address,
                                   consumer.make_pull(notice.transfer_id, notice.grant, 0, 0))
            for notice in metadata.abandons:
                self.producer_side.abandon(notice.transfer_id, notice.peer_address)
        consumer.land_and_expire(now)  # first: a cancelled or landed load's bytes go to the next
        consumer.admit_waiting()

    def bind_step(self, metadata: P2pConnectorMetadata | None, attn_metadata: AttentionMetadata | None) -> None:
        """Producer: decide, once per save, whether it is pushed layer by layer or deferred."""
        self.producer_side.bind_step(metadata)

    def needs_layer_hooks(self, metadata: P2pConnectorMetadata | None) -> bool:
        """Only a producer step with saves gathers per layer; a consumer never waits per
        layer, so its decode steps may replay CUDA graphs."""
        return metadata is not None and bool(metadata.saves)

    def before_layer(self, layer_idx: int) -> None:
        """No wait: a consumer request is scheduled only after all of its KV has landed."""
        return None

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """Producer: gather a finished data call's layers and wake its sender."""
        self.producer_side.after_layer(layer_idx)

    def wait_for_save(self) -> None:
        """End of step: deferred saves become sendable; PUT waits for this step's sends."""
        self.producer_side.wait_for_save()

    def get_finished(self) -> FinishedTransfers:
        """Transfers finished or failed since the last call; also expires leases and orphans."""
        now = self.state.clock()
        with self.state.lock:
            sending = self.producer_side.take_finished_locked(now)
            recving, failed = self.consumer_side.take_landed_locked()
        return FinishedTransfers(sending=sending, recving=recving, failed_recving=failed)

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and gauges; every gauge is 0 when the worker is idle."""
        transport = self.state.transport
        with self.state.lock:
            out = {name: float(value) for name, value in self.state.counters.items()}
            out.update({
                "data_calls": float(transport.data_calls),
                "recv_gpu_seconds": float(getattr(transport, "recv_gpu_seconds", 0.0)),
                "send_gpu_seconds": float(getattr(transport, "send_gpu_seconds", 0.0)),
                "control_messages_received": float(self._server.messages_received),
                "control_messages_rejected": float(self._server.messages_rejected),
            })
            out.update(self.consumer_side.gauges_locked())
            out.update(self.producer_side.gauges_locked())
        out["rank_reports_pending"] = 0.0  # one rank: no report to wait for (rank_group's sum)
        return out

    def doorbell(self) -> Doorbell:
        """Rung when a load lands or fails and when a send finishes (from the control,
        sender and landing threads), so a loop waiting only on transfers steps at once."""
        return self.state.doorbell

    def peer_ranks(self) -> PeerRanks | None:
        """This worker's layout and rank addresses, which it registers with the proxy."""
        return self._ranks

    @staticmethod
    def decode_share(payload: bytes) -> P2pConnectorMetadata:
        """A tensor-parallel rank's share of a step, as rank 0 encoded it
        (``rank_group.RankZeroConnectorWorker.rank_shares``)."""
        share = SHARE_CODEC.decode(payload)
        if not isinstance(share, P2pConnectorMetadata):
            raise KVTransferError(f"a rank's share must be metadata, got {type(share).__name__}")
        return share

    def is_idle(self) -> bool:
        """True when no transfer state or buffer byte is held."""
        with self.state.lock:
            return self.consumer_side.idle_locked() and self.producer_side.idle_locked()

    # ---- control messages (control thread) ----------------------------------------------

    def _on_message(self, message: Any, frames: list[Any]) -> None:
        if isinstance(message, KVPullRequest):
            self.producer_side.on_pull(message)
        elif isinstance(message, KVSendHeader):
            self.consumer_side.on_header(message)
        elif isinstance(message, KVLayerData):
            self.consumer_side.on_layer_data(message, frames)
        elif isinstance(message, KVSendAbort):
            self.consumer_side.on_abort(message)
        elif isinstance(message, NcclHello):
            self._on_hello(message)

    def _on_hello(self, hello: NcclHello) -> None:
        reason = check_hello(hello)
        if reason is None and self.state.transport.uses_data_messages:
            reason = "this worker's KV transport is not NCCL"
        if reason is not None:
            self.state.reject("hello", reason)
            return
        self.state.transport.on_hello(hello)
