"""Worker side of the P2P connector: moves KV bytes and reports finished transfers.

Producer (P): ``bind_step`` turns each ``SaveSpec`` into a push job when the consumer's pull
request is already here (PUT, PUT_ASYNC) or into a pending entry that is sent from the held
blocks when the pull arrives (GET, or a late pull), under a lease. Transfers move in data
calls of ``layers_per_call`` consecutive layers: after the last layer of a call,
``after_layer`` gathers the call's layers with one kernel into the job's staging buffer and
tells the peer's sender thread once; every other layer's hook does nothing.

Consumer (D): ``start_load_kv`` reserves receive-buffer bytes for each new load, sends the
pull request (push back: no reservation, no pull), reports landed transfers and fails the
ones past their deadline. The control thread validates headers and posts the receives, each
data call followed by its scatter into the paged cache on the receiving stream (CPU
transport: it copies each call's bytes in and scatters them). A load needs only a whole
number of layers of receive buffer, not its whole size: when the transfer is larger than
``kv_buffer_size``, its calls take turns in the buffer (the stream orders each call's
receive after the scatter of the call that used the space before), so a long prompt streams
through a bounded buffer instead of failing.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from connectors.p2p_nccl.handshake import ControlClient, ControlServer
from connectors.p2p_nccl.messages import (
    KVLayerData,
    KVPullRequest,
    KVSendAbort,
    KVSendHeader,
    NcclHello,
    call_ranges,
    check_header,
    check_hello,
    check_pull,
    layer_nbytes,
    make_codec,
    plan_layers_per_call,
)
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connectors.p2p_nccl.recv_buffer import RecvBuffer
from connectors.p2p_nccl.sender import CallSlots, PeerSender, SendJob
from engine_core.addresses import is_host_port
from engine_core.attention.metadata import AttentionMetadata
from engine_core.config import KVTransferConfig
from engine_core.doorbell import Doorbell
from engine_core.errors import KVTransferError
from engine_core.kv_connector import FinishedTransfers
from engine_core.worker.block_copy import (
    block_ids_tensor,
    gather_layers,
    scatter_layers,
    stack_layers,
    wire_shape,
)

logger = logging.getLogger(__name__)

MAX_ABORT_PEERS = 64  # peers a producer starts a sender for only to answer with an abort
MAX_KNOWN_CONSUMERS = 4096  # consumer addresses whose process epoch a producer remembers
# Pulls kept while their prefill has not reached the save (each until orphan_ttl_s): more
# would be a flood of pulls for transfers this producer never runs, not a race.
MAX_WAITING_PULLS = 4096
# The worker's event counters (``stats()``; /metrics exports each as a counter).
EVENT_COUNTERS = (
    "control_messages_sent", "bytes_sent", "bytes_received", "transfers_sent",
    "transfers_received", "sends_failed", "transfers_failed", "transfers_timed_out",
    "messages_rejected", "leases_expired", "registrations_expired", "loads_pushed_back",
    "consumer_restarts", "loads_streamed")
WAITING_BUFFER, REQUESTED, RECEIVING, DONE, FAILED = "waiting_buffer", "requested", "receiving", "done", "failed"
# A failed load whose receives were posted is reported once its pair's stream has passed
# the scatters queued behind them (an aborted pair's kernels end, so it does): until then
# they could still write into its blocks, which the scheduler holds until the report. A
# stream still busy after this long is logged as an error; the load keeps its blocks (a
# leak is better than another request's KV overwritten).
DRAIN_TIMEOUT_S = 30.0
# A producer's send ends this long before the consumer's deadline that the pull announced,
# so that its header never reaches a consumer that already gave up (control latency).
PULL_DEADLINE_MARGIN_S = 0.25


@dataclass
class _Load:
    spec: LoadSpec
    pull: KVPullRequest
    nbytes: int  # the whole transfer
    staging_bytes: int  # its receive buffer: all of it, or the whole layers kv_buffer_size holds
    deadline: float
    state: str = WAITING_BUFFER
    buffer: torch.Tensor | None = None  # flat, ``staging_bytes``
    # Per data call, its place in ``buffer`` (calls share it in turn when it is smaller than
    # the transfer), and the block ids its scatter writes (uploaded on the scattering stream).
    views: list[torch.Tensor] | None = None
    scatter_ids: torch.Tensor | None = None
    # Recorded on the allocating (engine) stream right after ``buffer`` was allocated: the
    # transport's writes wait on it (the memory may have been another tensor's a moment ago).
    buffer_ready: Any = None
    producer_epoch: str = ""
    # The producer whose header this load accepted: its pair holds the posted receives, so
    # only it may abort the load, and a deadline aborts its pair (not the pull's address).
    producer_address: str = ""
    seq: int = -1
    layers_received: int = 0
    layers_per_call: int = 1
    # Set once the pull went out; a load that ends before that tells P to drop the KV it
    # keeps for it (a release) instead of leaving P to its lease.
    pull_sent: bool = False
    posted: Any = None  # the transport's PostedRecv (NCCL), or None
    drain_deadline: float | None = None
    drain_overdue: bool = False
    # The control thread is posting its receives or landing a call (outside the lock): its
    # scatters may be on the way, so the load is not ended meanwhile.
    busy: bool = False
    cancelled: bool = False
    reason: str = ""
    timed_out: bool = False


@dataclass
class _Pending:
    save: SaveSpec
    lease_deadline: float
    ready: bool = False
    ready_event: Any = None


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


class P2pConnectorWorker:
    """Producer and/or consumer worker half; explicit ``start``/``shutdown``."""

    def __init__(self, config: KVTransferConfig, device: str, transport: Any | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._device = torch.device(device)
        self._clock = clock
        self._own_address = f"{config.kv_ip}:{config.kv_port}"
        self._epoch = uuid.uuid4().hex
        self._codec = make_codec(config.cluster_secret, self._own_address)
        self._transport = transport if transport is not None else make_transport(config, device)
        # Data calls over the control socket land in the receive buffer: none is larger.
        self._server = ControlServer(
            self._own_address, self._codec, self._on_message,
            max_message_bytes=config.kv_buffer_bytes if self._transport.uses_data_messages else None)
        self._doorbell = Doorbell()
        self._recv_buffer = RecvBuffer(config.kv_buffer_bytes)
        self._lock = threading.Lock()
        self._stacked: torch.Tensor | None = None  # the caches as one [layers, 2, blocks, ...]
        self._geometry: tuple[int, str, list[int], int] | None = None
        self._started = False
        self._counters = dict.fromkeys(EVENT_COUNTERS, 0)
        # producer
        self._registrations: dict[str, tuple[KVPullRequest, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._in_flight: dict[str, SendJob] = {}
        self._senders: dict[str, PeerSender] = {}
        # Epoch of the consumer process last seen at each address (from its pulls), least
        # recently heard from first; a new one means that process restarted.
        self._consumer_epochs: dict[str, str] = {}
        self._step_push: list[tuple[SendJob, torch.Tensor]] = []  # (job, its block index)
        self._step_deferred: list[str] = []
        self._finished_sending: set[str] = set()
        # Transfers this producer will never send (abandoned, lease expired): a late pull for
        # one is answered with an abort at once. Bounded; holds no bytes.
        self._tombstones: dict[str, float] = {}
        # consumer
        self._loads: dict[str, _Load] = {}
        self._waiting: deque[str] = deque()
        self._clients: dict[str, ControlClient] = {}
        self._last_seq: dict[tuple[str, str], int] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._own_address

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Record the paged caches (``[2, num_blocks, block_size, heads, head_dim]``) and start."""
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise KVTransferError(f"unexpected kv cache shape {tuple(first.shape)}")
        self._stacked = stack_layers(kv_caches)
        dtype = str(first.dtype).removeprefix("torch.")
        block_shape = [int(d) for d in first.shape[2:]]
        self._geometry = (len(kv_caches), dtype, block_shape, first.element_size())
        self.start()

    def release_kv_caches(self) -> None:
        """Forget the caches (the engine frees them to sleep); geometry and sockets stay."""
        if not self.is_idle():
            raise KVTransferError("KV transfers in flight: the caches cannot be released")
        self._stacked = None

    def start(self) -> None:
        """Bind the control socket and start its thread (idempotent)."""
        if not self._started:
            self._server.start()
            self._started = True

    def shutdown(self) -> None:
        """Stop every thread and close every socket; pending transfers are dropped."""
        for sender in list(self._senders.values()):
            sender.stop()
        self._senders.clear()
        self._server.stop()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._transport.close()
        self._doorbell.close()
        self._started = False

    # ---- runner hooks -------------------------------------------------------------------

    def land_loads(self) -> FinishedTransfers:
        """Consumer, before the scheduling pass: report the loads that landed (their calls
        were scattered as they arrived) and the failed ones at once. Reported only by
        ``get_finished`` after the step, a landed request waited a step to be seen and (async
        scheduling) another to be scheduled: two decode steps added to its first token."""
        with self._lock:
            idle = not self._loads and not self._waiting
        if not idle:  # ended loads free their bytes first, so waiting ones may take them
            self._land_and_expire(self._clock())
            self._admit_waiting()
        with self._lock:
            landed = FinishedTransfers(recving=self._finished_recving,
                                       failed_recving=self._failed_recving)
            self._finished_recving, self._failed_recving = set(), set()
        return landed

    def start_load_kv(self, metadata: P2pConnectorMetadata | None) -> None:
        """Consumer: start new loads, retry pushed-back ones, land finished ones, expire late ones."""
        now = self._clock()
        if metadata is not None:
            for request_id in metadata.cancels:
                self._cancel_load(request_id)
            for spec in metadata.loads:
                self._add_load(spec, now)
            for notice in metadata.releases:
                self._send_pull(notice.peer_address, self._make_pull(notice.transfer_id, 0, 0))
            for notice in metadata.abandons:
                self._abandon(notice.transfer_id, notice.peer_address)
        self._land_and_expire(now)  # first: a cancelled or landed load's bytes go to the next
        self._admit_waiting()

    def bind_step(self, metadata: P2pConnectorMetadata | None, attn_metadata: AttentionMetadata | None) -> None:
        """Producer: decide, once per save, whether it is pushed layer by layer or deferred."""
        self._step_push = []
        self._step_deferred = []
        if metadata is not None:
            for save in metadata.saves:
                self._bind_save(save)

    def needs_layer_hooks(self, metadata: P2pConnectorMetadata | None) -> bool:
        """Only a producer step with saves gathers per layer; a consumer never waits per
        layer, so its decode steps may replay CUDA graphs."""
        return metadata is not None and bool(metadata.saves)

    def before_layer(self, layer_idx: int) -> None:
        """No wait: a consumer request is scheduled only after all of its KV has landed."""
        return None

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """Producer: after a call's last layer, gather the call's layers of each pushed
        request with one kernel and wake its sender; every other layer does nothing."""
        stacked = self._require_stacked()
        for job, index in self._step_push:
            assert job.slots is not None
            call = job.slots.call_ending_at(layer_idx)
            if call is None or job.done.is_set():
                continue
            try:
                staging = job.slots.staging
                if staging is None:
                    continue
                first, end = job.slots.calls[call]
                gather_layers(stacked, first, end, index, out=staging[first:end])
                job.slots.put(call, self._record_event())
            except RuntimeError as exc:  # allocation failure: this transfer fails, not the step
                job.slots.fail(exc)

    def wait_for_save(self) -> None:
        """End of step: deferred saves become sendable; PUT waits for this step's sends."""
        event = self._record_event()
        now = self._clock()
        to_start: list[tuple[_Pending, KVPullRequest, float]] = []
        with self._lock:
            for transfer_id in self._step_deferred:
                pending = self._pending.get(transfer_id)
                if pending is None:
                    continue
                pending.ready, pending.ready_event = True, event
                registration = self._registrations.pop(transfer_id, None)
                if registration is not None:
                    del self._pending[transfer_id]
                    to_start.append((pending, *registration))
        for pending, pull, arrived in to_start:
            self._start_deferred(pending, pull, arrived)
        if self._config.send_type == "PUT":
            for job, _ in self._step_push:
                job.done.wait(max(0.0, job.deadline - now))
        self._step_push = []
        self._step_deferred = []

    def get_finished(self) -> FinishedTransfers:
        """Transfers finished or failed since the last call; also expires leases and orphans."""
        now = self._clock()
        with self._lock:
            for transfer_id, pending in list(self._pending.items()):
                if now > pending.lease_deadline:
                    del self._pending[transfer_id]
                    self._finished_sending.add(pending.save.request_id)
                    self._counters["leases_expired"] += 1
                    self._tombstone(transfer_id, now)
            self._expire_tombstones(now)
            for transfer_id, (_, arrived) in list(self._registrations.items()):
                if now - arrived > self._config.orphan_ttl_s:
                    del self._registrations[transfer_id]
                    self._counters["registrations_expired"] += 1
            finished = FinishedTransfers(sending=self._finished_sending,
                                         recving=self._finished_recving,
                                         failed_recving=self._failed_recving)
            self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return finished

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and gauges; every gauge is 0 when the worker is idle."""
        with self._lock:
            send_bytes = sum(job.slots.held_bytes for job in self._in_flight.values()
                             if job.slots is not None)
            out = {name: float(value) for name, value in self._counters.items()}
            out.update({
                "data_calls": float(self._transport.data_calls),
                "recv_gpu_seconds": float(getattr(self._transport, "recv_gpu_seconds", 0.0)),
                "send_gpu_seconds": float(getattr(self._transport, "send_gpu_seconds", 0.0)),
                "control_messages_received": float(self._server.messages_received),
                "control_messages_rejected": float(self._server.messages_rejected),
                "recv_buffer_bytes_in_use": float(self._recv_buffer.in_use_bytes),
                "send_buffer_bytes_in_use": float(send_bytes),
                "pinned_bytes_in_use": 0.0,  # push back, never spill: see recv_buffer.py
                "loads_in_flight": float(len(self._loads)),
                "loads_waiting_for_buffer": float(len(self._waiting)),
                "sends_in_flight": float(len(self._in_flight)),
                "sends_pending_pull": float(len(self._pending)),
                "pull_requests_waiting": float(len(self._registrations)),
            })
        return out

    def doorbell(self) -> Doorbell:
        """Rung when a load lands or fails and when a send finishes (from the control,
        sender and landing threads), so a loop waiting only on transfers steps at once."""
        return self._doorbell

    def is_idle(self) -> bool:
        """True when no transfer state or buffer byte is held."""
        with self._lock:
            return not (self._loads or self._waiting or self._pending or self._in_flight
                        or self._registrations or self._recv_buffer.in_use_bytes
                        or self._finished_sending or self._finished_recving or self._failed_recving)

    # ---- consumer -----------------------------------------------------------------------

    def _make_pull(self, transfer_id: str, first_block: int, num_blocks: int,
                   max_layers_per_call: int = 0) -> KVPullRequest:
        num_layers, dtype, block_shape, _ = self._require_geometry()
        return KVPullRequest(transfer_id=transfer_id, consumer_address=self._own_address,
                             first_block=first_block, num_blocks=num_blocks, num_layers=num_layers,
                             dtype=dtype, block_shape=list(block_shape),
                             timeout_s=self._config.transfer_timeout_s,
                             consumer_epoch=self._epoch, max_layers_per_call=max_layers_per_call)

    def _add_load(self, spec: LoadSpec, now: float) -> None:
        num_layers, _, block_shape, element_size = self._require_geometry()
        layer_bytes = layer_nbytes(len(spec.block_ids), block_shape, element_size)
        nbytes = num_layers * layer_bytes
        # Larger than the buffer: whole layers of half of it (at least one layer), so that
        # smaller loads are not all pushed back behind it; its calls take turns in them, and
        # the pull tells P to keep each call within them.
        capacity = self._recv_buffer.capacity_bytes
        staging = (nbytes if nbytes <= capacity
                   else max(layer_bytes, capacity // 2 // max(layer_bytes, 1) * layer_bytes))
        pull = self._make_pull(spec.transfer_id, spec.first_block, len(spec.block_ids),
                               max_layers_per_call=(0 if staging >= nbytes
                                                    else staging // max(layer_bytes, 1)))
        load = _Load(spec=spec, pull=pull, nbytes=nbytes, staging_bytes=staging,
                     deadline=now + self._config.transfer_timeout_s)
        with self._lock:
            if spec.transfer_id in self._loads:
                self._counters["messages_rejected"] += 1
                self._failed_recving.add(spec.request_id)
                return
            self._loads[spec.transfer_id] = load
            if not self._recv_buffer.fits_ever(layer_bytes):
                load.state, load.reason = FAILED, (
                    f"one layer of this transfer ({layer_bytes} bytes) exceeds kv_buffer_size")
                return
            self._waiting.append(spec.transfer_id)

    def _admit_waiting(self) -> None:
        """Push back: a load sends its pull request only once its bytes are reserved (FIFO)."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                load = self._loads.get(self._waiting[0])
                if load is None or load.state != WAITING_BUFFER:
                    self._waiting.popleft()
                    continue
                if not self._recv_buffer.try_reserve(load.spec.transfer_id, load.staging_bytes):
                    self._counters["loads_pushed_back"] += 1
                    return
                self._waiting.popleft()
                if load.staging_bytes < load.nbytes:  # larger than the buffer: calls take turns
                    self._counters["loads_streamed"] += 1
            try:
                stacked = self._require_stacked()
                buffer = torch.empty(load.staging_bytes // stacked.element_size(),
                                     dtype=stacked.dtype, device=self._device)
            except RuntimeError as exc:  # allocation failure fails this transfer only
                with self._lock:
                    load.state, load.reason = FAILED, f"buffer allocation failed: {exc}"
                continue
            ready = self._record_event()
            with self._lock:
                load.buffer, load.buffer_ready, load.state = buffer, ready, REQUESTED
                # The producer's send must end by this load's deadline: say how long it has.
                load.pull.timeout_s = max(0.0, load.deadline - self._clock())
            if self._send_pull(load.spec.peer_address, load.pull):
                load.pull_sent = True
            else:
                with self._lock:
                    if load.state == REQUESTED:
                        load.state, load.reason = FAILED, "pull request not sent"

    def _send_pull(self, peer_address: str, pull: KVPullRequest) -> bool:
        client = self._clients.get(peer_address)
        try:
            if client is None:
                client = self._clients[peer_address] = ControlClient(
                    peer_address, self._codec, send_timeout_s=0.5)
            client.send(pull)
        except KVTransferError as exc:
            logger.warning("pull request %s to %s failed: %s", pull.transfer_id, peer_address, exc)
            if client is not None:
                client.close()
            self._clients.pop(peer_address, None)
            return False
        with self._lock:
            self._counters["control_messages_sent"] += 1
        return True

    def _cancel_load(self, request_id: str) -> None:
        """The request ended on D: mark its load cancelled; a REQUESTED one also releases P.

        When its reserved bytes are free again, by state:
        - WAITING_BUFFER: holds none (ends at the next ``_land_and_expire``, releasing P).
        - REQUESTED (pull sent, no header accepted): nothing has been, or can be, written
          into its buffer yet: receives are posted (NCCL) and data messages landed (CPU)
          only for a header accepted under the lock, and only in this state. So P is
          released at once (a ``num_blocks=0`` pull behind the pull on the same socket).
          With data messages (CPU transport) the load ends now: a late header or data
          message for it finds no load waiting and is refused (logged, counted), never
          written. On a pair transport (NCCL) it keeps the bytes until P answers: P's
          abort says it dropped the pull before any send (no header will follow, so the
          bytes are free then), while a send P had started arrives as a header that must
          still be received into them: refused, P's data calls would stay unmatched on the
          pair and D would have to abort it, failing every other transfer on it.
        - RECEIVING: receives are posted or data is landing; freed when the data landed (or
          the pair is drained after a failure), as before.
        """
        with self._lock:
            requested: list[_Load] = []
            for load in self._loads.values():
                if load.spec.request_id != request_id:
                    continue
                load.cancelled = True
                if load.state == REQUESTED:
                    requested.append(load)
                    if self._transport.uses_data_messages:
                        load.state, load.reason = FAILED, "cancelled"
        for load in requested:
            self._send_pull(load.spec.peer_address, self._make_pull(load.spec.transfer_id, 0, 0))

    def _land_and_expire(self, now: float) -> None:
        """Report landed, failed and late loads and free the buffer they held."""
        with self._lock:
            loads = list(self._loads.values())
        for load in loads:
            if load.state == RECEIVING and load.posted is not None:
                try:
                    if load.posted.poll():
                        with self._lock:
                            if load.state == RECEIVING:
                                load.state = DONE
                except Exception as exc:
                    with self._lock:
                        load.state, load.reason = FAILED, f"receive failed: {exc}"
        unasked: list[_Load] = []
        for load in loads:
            with self._lock:
                state = load.state
                if state in (WAITING_BUFFER, REQUESTED, RECEIVING):
                    if load.cancelled and state == WAITING_BUFFER:
                        state = load.state = FAILED
                    elif now > load.deadline:
                        state, load.state, load.timed_out = FAILED, FAILED, True
                        load.reason = "transfer timed out"
                if state not in (DONE, FAILED):
                    continue
                if state == FAILED and not self._drained(load, now):
                    continue
                del self._loads[load.spec.transfer_id]
            if not load.pull_sent:
                unasked.append(load)
            self._recv_buffer.release(load.spec.transfer_id)
            load.buffer = load.views = load.scatter_ids = None
            with self._lock:
                if load.cancelled:
                    # Its request ended while the load ran; the scheduler holds the blocks
                    # the scatters write until this report (ids are never reused).
                    self._failed_recving.add(load.spec.request_id)
                    continue
                if state == DONE:
                    self._finished_recving.add(load.spec.request_id)
                    self._counters["transfers_received"] += 1
                else:
                    logger.warning("kv load %s failed: %s", load.spec.transfer_id, load.reason)
                    self._failed_recving.add(load.spec.request_id)
                    self._counters["transfers_timed_out" if load.timed_out else "transfers_failed"] += 1
        for load in unasked:  # cancelled, pushed back past its deadline, or too large
            self._send_pull(load.spec.peer_address, self._make_pull(load.spec.transfer_id, 0, 0))

    def _drained(self, load: _Load, now: float) -> bool:
        """Whether a failed load's posted receives and scatters are behind its pair's stream
        (call with the lock held). A load past its deadline aborts its pair first, so that
        receives waiting for data that is not coming end; every other failure of a posted
        load (the producer's abort, a failed pair) has aborted it already."""
        if load.busy:
            return False
        if load.posted is None:
            return True
        if load.drain_deadline is None:
            load.drain_deadline = now + DRAIN_TIMEOUT_S
            if load.timed_out:
                self._transport.abort(load.producer_address)
        if load.posted.drained():
            return True
        if now > load.drain_deadline and not load.drain_overdue:
            load.drain_overdue = True
            logger.error("kv load %s: its pair's stream is still busy %.0f s after the load "
                         "failed; its blocks stay held until it drains",
                         load.spec.transfer_id, DRAIN_TIMEOUT_S)
        return False

    def _scatter_call(self, load: _Load, call: int) -> None:
        """Scatter one landed data call into the load's blocks, on the current stream (the
        receiving one): the block ids are uploaded on it the first time."""
        assert load.views is not None
        if load.scatter_ids is None:
            load.scatter_ids = block_ids_tensor(load.spec.block_ids, self._device)
        scatter_layers(self._require_stacked(), load.scatter_ids, load.views[call],
                       call * load.layers_per_call)

    # ---- producer -----------------------------------------------------------------------

    def _bind_save(self, save: SaveSpec) -> None:
        with self._lock:
            registration = self._registrations.pop(save.transfer_id, None)
        if registration is not None and self._config.send_type != "GET":
            pull, arrived = registration
            if pull.num_blocks == 0:
                self._finish_send(save.request_id)
                return
            if not self._range_ok(pull, save):
                return
            index = block_ids_tensor(save.block_ids[pull.first_block:], self._device)
            num_layers, _, block_shape, _ = self._require_geometry()
            layers_per_call = self._layers_per_call(pull)
            calls = call_ranges(num_layers, layers_per_call)
            try:
                staging = torch.empty(wire_shape(num_layers, pull.num_blocks, block_shape),
                                      dtype=self._require_stacked().dtype, device=self._device)
            except RuntimeError as exc:  # allocation failure fails this transfer only
                job = self._make_job(save, pull, arrived,
                                     slots=CallSlots(torch.empty(num_layers, 0), calls))
                job.slots.fail(exc)
                self._submit(job)
                return
            job = self._make_job(save, pull, arrived, slots=CallSlots(staging, calls))
            self._step_push.append((job, index))
            self._submit(job)
            return
        with self._lock:
            self._pending[save.transfer_id] = _Pending(
                save, lease_deadline=self._clock() + self._config.get_lease_s)
            if registration is not None:
                self._registrations[save.transfer_id] = registration
        self._step_deferred.append(save.transfer_id)

    def _start_deferred(self, pending: _Pending, pull: KVPullRequest, arrived: float) -> None:
        save = pending.save
        if pull.num_blocks == 0:
            self._finish_send(save.request_id)
            return
        if not self._range_ok(pull, save):
            return
        block_ids = save.block_ids[pull.first_block:]
        event = pending.ready_event
        peer = pull.consumer_address
        block_shape = self._require_geometry()[2]
        index: torch.Tensor | None = None

        def gather_call(first: int, end: int) -> tuple[torch.Tensor, Any]:
            # The blocks are held by the scheduler until this send reports done. The index is
            # uploaded inside the gather context, on the stream that gathers: uploaded on the
            # caller's stream, a gather on the transport's stream could read it unwritten.
            nonlocal index
            stacked = self._require_stacked()
            with self._transport.gather_context(peer, event):
                if index is None:
                    index = block_ids_tensor(block_ids, self._device)
                out = torch.empty(wire_shape(end - first, len(block_ids), block_shape),
                                  dtype=stacked.dtype, device=self._device)
                return gather_layers(stacked, first, end, index, out=out), None

        self._submit(self._make_job(save, pull, arrived, call_source=gather_call))

    def _range_ok(self, pull: KVPullRequest, save: SaveSpec) -> bool:
        if pull.first_block + pull.num_blocks == len(save.block_ids):
            return True
        reason = (f"consumer asks blocks [{pull.first_block}, {pull.first_block + pull.num_blocks})"
                  f" but the prompt has {len(save.block_ids)}")
        with self._lock:
            self._counters["messages_rejected"] += 1
        self._submit_abort(save.transfer_id, pull.consumer_address, reason)
        self._finish_send(save.request_id)
        return False

    def _layers_per_call(self, pull: KVPullRequest) -> int:
        num_layers, _, block_shape, element_size = self._require_geometry()
        per_layer = layer_nbytes(pull.num_blocks, block_shape, element_size)
        return plan_layers_per_call(num_layers, per_layer, self._config.min_call_bytes,
                                    max_layers=pull.max_layers_per_call)

    def _make_job(self, save: SaveSpec, pull: KVPullRequest, arrived: float,
                  **source: Any) -> SendJob:
        """The send of ``save`` that ``pull`` (received at ``arrived``) asked for. Its deadline
        is also the consumer's, less a margin (the pull says how long it still waits): a
        header sent after the consumer gave up is refused and, on NCCL, its pair aborted, and
        the sends of every later transfer on that pair queued behind it (one sender thread a
        consumer) failed with it."""
        num_layers, dtype, block_shape, _ = self._require_geometry()
        deadline = min(self._clock() + self._config.transfer_timeout_s,
                       arrived + pull.timeout_s - PULL_DEADLINE_MARGIN_S)
        return SendJob(transfer_id=save.transfer_id, request_id=save.request_id,
                       peer_address=pull.consumer_address, first_block=pull.first_block,
                       num_blocks=pull.num_blocks, num_layers=num_layers, dtype=dtype,
                       block_shape=list(block_shape), deadline=deadline,
                       layers_per_call=self._layers_per_call(pull),
                       peer_epoch=pull.consumer_epoch, **source)

    def _submit(self, job: SendJob) -> None:
        with self._lock:
            self._in_flight[job.transfer_id] = job
            sender = self._sender_locked(job.peer_address)
        sender.submit(job)

    def _sender_locked(self, peer_address: str) -> PeerSender:
        """The peer's sender thread, started on first use (call with the lock held)."""
        sender = self._senders.get(peer_address)
        if sender is None:
            sender = self._senders[peer_address] = PeerSender(
                peer_address, self._own_address, self._epoch, self._codec, self._transport,
                self._on_send_done, send_timeout_s=min(5.0, self._config.transfer_timeout_s),
                current_epoch=self._current_consumer_epoch)
            sender.start()
        return sender

    def _submit_abort(self, transfer_id: str, peer_address: str, reason: str) -> None:
        job = SendJob(transfer_id=transfer_id, request_id=None, peer_address=peer_address,
                      first_block=0, num_blocks=0, num_layers=0, dtype="", block_shape=[],
                      deadline=self._clock() + self._config.transfer_timeout_s,
                      abort_reason=reason)
        with self._lock:
            if peer_address not in self._senders and len(self._senders) >= MAX_ABORT_PEERS:
                # An abort is a courtesy (the consumer's deadline covers it): pulls naming
                # ever new addresses must not start a thread and a socket each.
                self._counters["messages_rejected"] += 1
                return
            sender = self._sender_locked(peer_address)
        sender.submit(job)

    def _abandon(self, transfer_id: str, peer_address: str) -> None:
        """This producer will never send the transfer: tell a waiting consumer, drop a release."""
        with self._lock:
            registration = self._registrations.pop(transfer_id, None)
            if registration is None:
                self._tombstone(transfer_id, self._clock())
        if registration is not None and registration[0].num_blocks > 0:
            self._submit_abort(transfer_id, registration[0].consumer_address, "producer request ended")

    def _tombstone(self, transfer_id: str, now: float) -> None:
        """Remember a dead transfer id for ``orphan_ttl_s`` (caller holds the lock). Kept in
        expiry order (re-inserted at the end), so expiring them stops at the first live one."""
        self._tombstones.pop(transfer_id, None)
        self._tombstones[transfer_id] = now + self._config.orphan_ttl_s
        while len(self._tombstones) > 65536:
            del self._tombstones[next(iter(self._tombstones))]

    def _expire_tombstones(self, now: float) -> None:
        """Drop the expired tombstones, oldest first (caller holds the lock): each step costs
        the expired ones only, not every transfer sent in the last ``orphan_ttl_s``."""
        while self._tombstones:
            transfer_id, expiry = next(iter(self._tombstones.items()))
            if now <= expiry:
                return
            del self._tombstones[transfer_id]

    def _on_send_done(self, job: SendJob) -> None:
        with self._lock:
            if job.abort_reason is not None:
                self._counters["control_messages_sent"] += 1
                return
            self._in_flight.pop(job.transfer_id, None)
            # Never sent again (its blocks are handed back now; a job released while queued
            # was never sent at all): a release that crossed the send is dropped, not kept
            # as a waiting pull until orphan_ttl_s, and a late pull is told at once. A
            # release that arrived between the pull's pop and the send's start (neither
            # waiting nor in flight then) was stored: drop it too.
            waiting = self._registrations.get(job.transfer_id)
            if waiting is not None and waiting[0].num_blocks == 0:
                del self._registrations[job.transfer_id]
            self._tombstone(job.transfer_id, self._clock())
            if job.slots is not None:
                job.slots.clear()
            if job.request_id is not None:
                self._finished_sending.add(job.request_id)
            if job.released:
                pass  # the consumer no longer wanted it: not a failure of this producer
            elif job.error is None:
                self._counters["transfers_sent"] += 1
                self._counters["control_messages_sent"] += 1
                _, _, block_shape, element_size = self._require_geometry()
                self._counters["bytes_sent"] += job.num_layers * layer_nbytes(
                    job.num_blocks, block_shape, element_size)
            else:
                self._counters["sends_failed"] += 1
        self._doorbell.ring()

    def _finish_send(self, request_id: str) -> None:
        with self._lock:
            self._finished_sending.add(request_id)

    # ---- control messages (control thread) ----------------------------------------------

    def _on_message(self, message: Any, frames: list[Any]) -> None:
        if isinstance(message, KVPullRequest):
            self._on_pull(message)
        elif isinstance(message, KVSendHeader):
            self._on_header(message)
        elif isinstance(message, KVLayerData):
            self._on_layer_data(message, frames)
        elif isinstance(message, KVSendAbort):
            self._on_abort(message)
        elif isinstance(message, NcclHello):
            self._on_hello(message)

    def _on_hello(self, hello: NcclHello) -> None:
        reason = check_hello(hello)
        if reason is None and self._transport.uses_data_messages:
            reason = "this worker's KV transport is not NCCL"
        if reason is not None:
            self._reject("hello", reason)
            return
        self._transport.on_hello(hello)

    def _reject(self, what: str, reason: str) -> None:
        logger.warning("rejected kv %s: %.300s", what, reason)
        with self._lock:
            self._counters["messages_rejected"] += 1

    def _on_pull(self, pull: KVPullRequest) -> None:
        if self._geometry is None or not self._config.is_producer:
            self._reject("pull request", "this engine does not produce KV")
            return
        num_layers, dtype, block_shape, _ = self._geometry
        reason = check_pull(pull, num_layers, dtype, block_shape)
        if reason is not None:
            self._reject("pull request", reason)
            if pull.num_blocks > 0 and is_host_port(pull.consumer_address):
                self._submit_abort(pull.transfer_id, pull.consumer_address, reason)
            return
        if self._note_consumer_epoch(pull.consumer_address, pull.consumer_epoch):
            # Our pair's other rank is gone and the new process has none: drop it now (this also
            # ends a send stalled on it), so the next send re-handshakes with an NcclHello.
            logger.info("kv consumer at %s restarted: dropping its pair", pull.consumer_address)
            self._transport.abort(pull.consumer_address)
        with self._lock:
            dead = pull.transfer_id in self._tombstones
            job = None if dead else self._in_flight.get(pull.transfer_id)
        if job is not None:
            if pull.num_blocks == 0:
                self._release_queued_send(pull, job)
                return
            self._reject("pull request", f"{pull.transfer_id!r:.80} is already being sent")
            return
        if dead:
            if pull.num_blocks > 0:
                self._submit_abort(pull.transfer_id, pull.consumer_address, "transfer released")
            return
        if pull.num_blocks == 0 and self._cancel_waiting_pull(pull):
            return
        with self._lock:
            pending = self._pending.get(pull.transfer_id)
            full = (pending is None and pull.transfer_id not in self._registrations
                    and len(self._registrations) >= MAX_WAITING_PULLS)
            if pending is not None and pending.ready:
                del self._pending[pull.transfer_id]
            elif not full:  # its prefill has not reached the save yet: kept until it does
                self._registrations[pull.transfer_id] = (pull, self._clock())
                return
        if full:
            self._reject("pull request", f"{pull.transfer_id!r:.80}: {MAX_WAITING_PULLS} pulls "
                                         "already wait for their prefill")
            if pull.num_blocks > 0:
                self._submit_abort(pull.transfer_id, pull.consumer_address, "producer busy")
            return
        self._start_deferred(pending, pull, self._clock())

    def _cancel_waiting_pull(self, release: KVPullRequest) -> bool:
        """A release (``num_blocks=0``) for a pull still waiting for its prefill cancels it;
        True when handled here (cancelled, or refused), False when no such pull waits.

        The waiting pull is the only thing this transfer's send can start from (the pull and
        its release arrive in order on the consumer's one socket): replaced by the release
        under the lock, no header will ever be sent, and the save ends without a send. The
        abort that answers tells the consumer so, and it may reuse the receive bytes it
        reserved at once (on NCCL it waits for this answer). Only the consumer address that
        pulled may cancel (a new process there too: the old one's pull is dead): a release
        from another would leave that consumer waiting for its deadline, so it is refused
        (logged, counted) and the pull kept."""
        with self._lock:
            registered = self._registrations.get(release.transfer_id)
            if registered is None or registered[0].num_blocks == 0:
                return False
            pull, arrived = registered
            ours = pull.consumer_address == release.consumer_address
            if ours:
                self._registrations[release.transfer_id] = (release, arrived)
        if not ours:
            self._reject("pull release", f"{release.transfer_id!r:.80} was pulled by "
                                         f"{pull.consumer_address}, not "
                                         f"{release.consumer_address!r:.80}")
            return True
        self._submit_abort(release.transfer_id, release.consumer_address,
                           "pull cancelled by the consumer")
        return True

    def _release_queued_send(self, release: KVPullRequest, job: SendJob) -> None:
        """A release (``num_blocks=0``) for a transfer whose send job exists.

        A job still queued behind other sends to this consumer is dropped unsent: its peer
        sender reports it at once (``on_done``: the blocks go back, the id is tombstoned) and
        the abort that answers lets the consumer free the receive bytes it reserved (on NCCL
        it keeps them until this answer, which used to be the whole transfer arriving after
        the jobs ahead of it). A job the sender thread already took runs in full: the
        release crossed it, and its header answers the consumer. The sender decides which,
        under the job's lock, so a job is never half sent. As for a waiting pull, only the
        consumer address that pulled may release (refused, logged and counted otherwise)."""
        if release.consumer_address != job.peer_address:
            self._reject("pull release", f"{release.transfer_id!r:.80} is sent to "
                                         f"{job.peer_address}, not "
                                         f"{release.consumer_address!r:.80}")
            return
        with self._lock:
            sender = self._senders.get(job.peer_address)
        if sender is None or not sender.release(job, "transfer released"):
            logger.debug("kv release of %.80r: its send already started", release.transfer_id)
            return
        self._submit_abort(release.transfer_id, release.consumer_address, "transfer released")

    def _note_consumer_epoch(self, address: str, epoch: str) -> bool:
        """Remember the epoch of the consumer process at ``address``; True when it replaces
        another one (the process restarted). Recorded before the caller drops the pair, so a
        sender that builds a pair after the drop sees the new epoch and skips the old jobs."""
        if not epoch:
            return False
        with self._lock:
            known = self._consumer_epochs.pop(address, None)
            self._consumer_epochs[address] = epoch
            while len(self._consumer_epochs) > MAX_KNOWN_CONSUMERS:
                del self._consumer_epochs[next(iter(self._consumer_epochs))]
            restarted = known is not None and known != epoch
            if restarted:
                self._counters["consumer_restarts"] += 1
        return restarted

    def _current_consumer_epoch(self, address: str) -> str | None:
        """The epoch of the consumer process last seen at ``address`` (sender threads ask)."""
        with self._lock:
            return self._consumer_epochs.get(address)

    def _on_header(self, header: KVSendHeader) -> None:
        key = (header.producer_address, header.producer_epoch)
        with self._lock:
            load = self._loads.get(header.transfer_id)
            if load is None or load.state != REQUESTED:
                reason = "no load is waiting for this transfer"
            elif header.producer_address != load.spec.peer_address:
                # Another producer's bytes would land in this request's blocks (on NCCL its
                # next real transfer would be matched into them): refused.
                reason = (f"header from {header.producer_address!r:.80}, but the load pulled "
                          f"from {load.spec.peer_address}")
                load = None  # not this load's failure: it keeps waiting for its producer
            else:
                reason = (check_header(header, load.pull, self._last_seq.get(key))
                          or self._plan_calls(load, header.layers_per_call))
            if reason is None and load is not None:
                self._last_seq[key] = header.seq
                load.state, load.producer_epoch, load.seq = RECEIVING, header.producer_epoch, header.seq
                load.producer_address = header.producer_address
                load.layers_per_call = header.layers_per_call
                load.busy = True
                views = load.views
            else:
                self._counters["messages_rejected"] += 1
                if load is not None and load.state == REQUESTED:
                    load.state, load.reason = FAILED, f"bad header: {reason}"
        if reason is not None:
            logger.warning("rejected kv header %.80r: %.300s", header.transfer_id, reason)
            self._doorbell.ring()
            if not self._transport.uses_data_messages:
                # The producer's sends would never be matched: abort so they fail fast.
                self._transport.abort(header.producer_address)
            return
        assert views is not None
        try:
            posted = self._transport.post_recv(
                header.producer_address, views, ready=load.buffer_ready,
                on_landed=self._doorbell.ring, after_each=lambda call: self._scatter_call(load, call))
        except Exception as exc:  # no pair (a header without its hello): fail now, not at the deadline
            with self._lock:
                # Part may be queued (the pair failed midway): drained before it is reported.
                load.posted = getattr(exc, "posted", None)
                load.busy = False
            self._fail_unposted(load, header, exc)
            return
        with self._lock:
            load.posted, load.busy = posted, False
            if posted is not None:
                self._counters["bytes_received"] += load.nbytes

    def _plan_calls(self, load: _Load, layers_per_call: int) -> str | None:
        """Place each data call of ``load`` in its buffer: calls take the buffer's slots in
        turn, so a buffer of whole layers smaller than the transfer still serves it. Why it
        cannot, or None (call with the lock held)."""
        assert load.buffer is not None
        num_layers = load.pull.num_layers
        calls = call_ranges(num_layers, layers_per_call)
        layer_elems = load.nbytes // num_layers // load.buffer.element_size()
        slot_elems = layers_per_call * layer_elems
        slots = load.buffer.numel() // slot_elems
        if slots == 0:
            return (f"data calls of {slot_elems * load.buffer.element_size()} bytes exceed the "
                    f"{load.staging_bytes}-byte receive buffer")
        shape = wire_shape(1, len(load.spec.block_ids), list(load.pull.block_shape))[1:]
        load.views = [load.buffer[(i % slots) * slot_elems:][:(end - first) * layer_elems]
                      .view(end - first, *shape) for i, (first, end) in enumerate(calls)]
        return None

    def _fail_unposted(self, load: _Load, header: KVSendHeader, exc: Exception) -> None:
        """A header accepted but its receives could not be posted: the load fails at once
        (it used to sit in RECEIVING, nothing posted, until its deadline) and the producer's
        pair is aborted, so its data calls fail instead of stalling."""
        with self._lock:
            if load.state == RECEIVING:
                load.state, load.reason = FAILED, f"receives not posted: {exc}"
        self._reject("header", f"{header.transfer_id!r:.80}: receives not posted: {exc}")
        self._transport.abort(header.producer_address)
        self._doorbell.ring()

    def _on_layer_data(self, message: KVLayerData, frames: list[Any]) -> None:
        if not self._transport.uses_data_messages:
            # NCCL moves the bytes: a data message is no part of any load here.
            self._reject("layer data", f"{message.transfer_id!r:.80}: this consumer receives "
                                       "over NCCL, not in data messages")
            return
        with self._lock:
            load = self._loads.get(message.transfer_id)
            end, expected = -1, -1
            if load is not None:
                num_layers = load.pull.num_layers
                end = min(load.layers_received + load.layers_per_call, num_layers)
                expected = load.nbytes // num_layers * (end - load.layers_received)
            ok = (load is not None and load.state == RECEIVING
                  and message.producer_epoch == load.producer_epoch and message.seq == load.seq
                  and message.layer == load.layers_received and message.nbytes == expected
                  and len(frames) == 1 and len(frames[0]) == expected)
            receiving = load is not None and load.state == RECEIVING
            if ok:
                assert load.views is not None
                call = message.layer // load.layers_per_call
                destination = load.views[call]
                load.busy = True
            elif receiving:
                load.state, load.reason = FAILED, "malformed layer data"
                self._doorbell.ring()
        if not ok:
            self._reject("layer data", f"{message.transfer_id!r:.80} layer {message.layer}: "
                         + ("does not match the transfer being received" if receiving
                            else "no transfer is being received"))
            return
        try:
            self._transport.land(destination.view(torch.uint8).reshape(-1),
                                 np.frombuffer(frames[0].buffer, dtype=np.uint8),
                                 load.buffer_ready, then=lambda: self._scatter_call(load, call))
        finally:
            with self._lock:
                load.busy = False
        self._transport.count_recv_call()
        with self._lock:
            if load.state == RECEIVING and load.seq == message.seq:
                load.layers_received = end
                self._counters["bytes_received"] += expected
                if load.layers_received == load.pull.num_layers:
                    load.state = DONE
                    self._doorbell.ring()

    def _on_abort(self, message: KVSendAbort) -> None:
        """Fail the load the abort names. Once a header was accepted only its producer may
        abort: an abort from another address used to fail the load and abort that address's
        pair, leaving the real producer's receives posted into a buffer about to be freed."""
        with self._lock:
            load = self._loads.get(message.transfer_id)
            if load is None or load.state not in (REQUESTED, RECEIVING):
                return  # the load already ended: a late abort is expected
            was_receiving = load.state == RECEIVING
            # Only the producer the load pulled from (then: whose header it accepted).
            expected = load.producer_address if was_receiving else load.spec.peer_address
            stranger = message.producer_address != expected
            if not stranger:
                load.state, load.reason = FAILED, f"producer aborted: {message.reason[:200]}"
                self._doorbell.ring()
        if stranger:
            self._reject("abort", f"{message.transfer_id!r:.80} is pulled from {expected}, "
                                  f"not {message.producer_address!r:.80}")
            return
        if was_receiving and not self._transport.uses_data_messages:
            self._transport.abort(load.producer_address)

    # ---- helpers ------------------------------------------------------------------------

    def _require_geometry(self) -> tuple[int, str, list[int], int]:
        if self._geometry is None:
            raise KVTransferError("register_kv_caches was not called")
        return self._geometry

    def _require_stacked(self) -> torch.Tensor:
        if self._stacked is None:
            raise KVTransferError("register_kv_caches was not called")
        return self._stacked

    def _record_event(self) -> Any:
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event
