"""Consumer half of the P2P connector worker: pulls KV and scatters it into the paged cache.

``add_load`` and ``admit_waiting`` reserve receive-buffer bytes for each new load and send the
pull request (push back: no reservation, no pull); ``land_and_expire`` reports landed
transfers and fails the ones past their deadline. The control thread validates headers and
posts the receives, each data call followed by its scatter into the paged cache on the
receiving stream (CPU transport: it copies each call's bytes in and scatters them). A load
needs only a whole number of layers of receive buffer, not its whole size: when the transfer
is larger than ``kv_buffer_size``, its calls take turns in the buffer (the stream orders each
call's receive after the scatter of the call that used the space before), so a long prompt
streams through a bounded buffer instead of failing. The control thread's handlers:
``receives.py``; a load and its states: ``loads.py``.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.loads import (
    DONE,
    DRAIN_TIMEOUT_S,
    FAILED,
    RECEIVING,
    REQUESTED,
    WAITING_BUFFER,
    Load,
)
from connectors.p2p_nccl.messages import (
    KVPullRequest,
    layer_nbytes,
)
from connectors.p2p_nccl.metadata import LoadSpec
from connectors.p2p_nccl.receives import ReceiveHandlers
from connectors.p2p_nccl.recv_buffer import RecvBuffer
from connectors.p2p_nccl.worker_state import WorkerState
from engine_core.errors import KVTransferError
from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.kv_layout import HeadSlice

logger = logging.getLogger(__name__)

class KVConsumer(ReceiveHandlers):
    """Loads, pull requests, headers, layer data, scatters and aborts on the consuming side."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self.recv_buffer = RecvBuffer(state.config.kv_buffer_bytes)
        self._loads: dict[str, Load] = {}
        self._waiting: deque[str] = deque()
        self._clients: dict[str, ControlClient] = {}
        self._last_seq: dict[tuple[str, str], int] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # A request's KV may come in several loads (routes between tensor-parallel layouts,
        # each its own heads of the same blocks): it is reported once all of them ended,
        # landed only if every one landed, so no scatter still writes its blocks after.
        self._open_loads: dict[str, int] = {}
        self._requests_failed: set[str] = set()

    def close_clients(self) -> None:
        """Close the control sockets to producers (shutdown)."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def take_landed_locked(self) -> tuple[set[str], set[str]]:
        """Hand over the requests whose loads landed and failed since the last call (call
        with the lock held)."""
        landed = (self._finished_recving, self._failed_recving)
        self._finished_recving, self._failed_recving = set(), set()
        return landed

    def gauges_locked(self) -> dict[str, float]:
        """The consumer's gauges (call with the lock held); all 0 when idle."""
        return {"recv_buffer_bytes_in_use": float(self.recv_buffer.in_use_bytes),
                "pinned_bytes_in_use": 0.0,  # push back, never spill: see recv_buffer.py
                "loads_in_flight": float(len(self._loads)),
                "loads_waiting_for_buffer": float(len(self._waiting))}

    def idle_locked(self) -> bool:
        """True when no load, reserved byte or unreported result is kept."""
        return not (self._loads or self._waiting or self.recv_buffer.in_use_bytes
                    or self._finished_recving or self._failed_recving or self._open_loads)

    def land_loads(self) -> FinishedTransfers:
        """Before the scheduling pass: report the loads that landed (their calls
        were scattered as they arrived) and the failed ones at once. Reported only by
        ``get_finished`` after the step, a landed request waited a step to be seen and (async
        scheduling) another to be scheduled: two decode steps added to its first token."""
        with self._state.lock:
            idle = not self._loads and not self._waiting
        if not idle:  # ended loads free their bytes first, so waiting ones may take them
            self.land_and_expire(self._state.clock())
            self.admit_waiting()
        with self._state.lock:
            recving, failed = self.take_landed_locked()
        return FinishedTransfers(recving=recving, failed_recving=failed)

    def make_pull(self, transfer_id: str, grant: str, first_block: int, num_blocks: int,
                  max_layers_per_call: int = 0, heads: HeadSlice | None = None) -> KVPullRequest:
        """A pull (``num_blocks == 0``: a release) under the transfer's ``grant``."""
        num_layers, dtype, block_shape, _ = self._state.require_geometry()
        return KVPullRequest(transfer_id=transfer_id, consumer_address=self._state.own_address,
                             first_block=first_block, num_blocks=num_blocks, num_layers=num_layers,
                             dtype=dtype, block_shape=self._state.slice_shape(heads),
                             timeout_s=self._state.config.transfer_timeout_s,
                             consumer_epoch=self._state.epoch, max_layers_per_call=max_layers_per_call,
                             grant=grant)

    def add_load(self, spec: LoadSpec, now: float) -> None:
        num_layers, _, _, element_size = self._state.require_geometry()
        layer_bytes = layer_nbytes(len(spec.block_ids), self._state.slice_shape(spec.heads),
                                   element_size)
        nbytes = num_layers * layer_bytes
        # Larger than the buffer: whole layers of half of it (at least one layer), so that
        # smaller loads are not all pushed back behind it; its calls take turns in them, and
        # the pull tells P to keep each call within them.
        capacity = self.recv_buffer.capacity_bytes
        staging = (nbytes if nbytes <= capacity
                   else max(layer_bytes, capacity // 2 // max(layer_bytes, 1) * layer_bytes))
        pull = self.make_pull(spec.transfer_id, spec.grant, spec.first_block, len(spec.block_ids),
                               max_layers_per_call=(0 if staging >= nbytes
                                                    else staging // max(layer_bytes, 1)),
                               heads=spec.heads)
        load = Load(spec=spec, pull=pull, nbytes=nbytes, staging_bytes=staging,
                     deadline=now + self._state.config.transfer_timeout_s)
        with self._state.lock:
            if spec.transfer_id in self._loads:
                self._state.counters["messages_rejected"] += 1
                self._open_loads[spec.request_id] = self._open_loads.get(spec.request_id, 0) + 1
                self._end_load_locked(spec.request_id, landed=False)
                return
            self._loads[spec.transfer_id] = load
            self._open_loads[spec.request_id] = self._open_loads.get(spec.request_id, 0) + 1
            if not self.recv_buffer.fits_ever(layer_bytes):
                load.state, load.reason = FAILED, (
                    f"one layer of this transfer ({layer_bytes} bytes) exceeds kv_buffer_size")
                return
            self._waiting.append(spec.transfer_id)

    def admit_waiting(self) -> None:
        """Push back: a load sends its pull request only once its bytes are reserved (FIFO)."""
        while True:
            with self._state.lock:
                if not self._waiting:
                    return
                load = self._loads.get(self._waiting[0])
                if load is None or load.state != WAITING_BUFFER:
                    self._waiting.popleft()
                    continue
                if not self.recv_buffer.try_reserve(load.spec.transfer_id, load.staging_bytes):
                    self._state.counters["loads_pushed_back"] += 1
                    return
                self._waiting.popleft()
                if load.staging_bytes < load.nbytes:  # larger than the buffer: calls take turns
                    self._state.counters["loads_streamed"] += 1
            try:
                stacked = self._state.require_stacked()
                buffer = torch.empty(load.staging_bytes // stacked.element_size(),
                                     dtype=stacked.dtype, device=self._state.device)
            except RuntimeError as exc:  # allocation failure fails this transfer only
                with self._state.lock:
                    load.state, load.reason = FAILED, f"buffer allocation failed: {exc}"
                continue
            ready = self._state.record_event()
            with self._state.lock:
                load.buffer, load.buffer_ready, load.state = buffer, ready, REQUESTED
                # The producer's send must end by this load's deadline: say how long it has.
                load.pull.timeout_s = max(0.0, load.deadline - self._state.clock())
            if self.send_pull(load.spec.peer_address, load.pull):
                load.pull_sent = True
            else:
                with self._state.lock:
                    if load.state == REQUESTED:
                        load.state, load.reason = FAILED, "pull request not sent"

    def send_pull(self, peer_address: str, pull: KVPullRequest) -> bool:
        client = self._clients.get(peer_address)
        try:
            if client is None:
                client = self._clients[peer_address] = ControlClient(
                    peer_address, self._state.codec, send_timeout_s=0.5)
            client.send(pull)
        except KVTransferError as exc:
            logger.warning("pull request %s to %s failed: %s", pull.transfer_id, peer_address, exc)
            if client is not None:
                client.close()
            self._clients.pop(peer_address, None)
            return False
        with self._state.lock:
            self._state.counters["control_messages_sent"] += 1
        return True

    def cancel_load(self, request_id: str) -> None:
        """The request ended on D: mark its load cancelled; a REQUESTED one also releases P.

        When its reserved bytes are free again, by state:
        - WAITING_BUFFER: holds none (ends at the next ``land_and_expire``, releasing P).
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
          the pair is drained after a failure).
        """
        with self._state.lock:
            requested: list[Load] = []
            for load in self._loads.values():
                if load.spec.request_id != request_id:
                    continue
                load.cancelled = True
                if load.state == REQUESTED:
                    requested.append(load)
                    if self._state.transport.uses_data_messages:
                        load.state, load.reason = FAILED, "cancelled"
        for load in requested:
            self.send_pull(load.spec.peer_address,
                           self.make_pull(load.spec.transfer_id, load.spec.grant, 0, 0))

    def land_and_expire(self, now: float) -> None:
        """Report landed, failed and late loads and free the buffer they held."""
        with self._state.lock:
            loads = list(self._loads.values())
        for load in loads:
            if load.state == RECEIVING and load.posted is not None:
                try:
                    if load.posted.poll():
                        with self._state.lock:
                            if load.state == RECEIVING:
                                load.state = DONE
                except Exception as exc:
                    with self._state.lock:
                        load.state, load.reason = FAILED, f"receive failed: {exc}"
        unasked: list[Load] = []
        for load in loads:
            with self._state.lock:
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
            self.recv_buffer.release(load.spec.transfer_id)
            load.buffer = load.views = load.scatter_ids = None
            with self._state.lock:
                if load.cancelled:
                    # Its request ended while the load ran; the scheduler holds the blocks
                    # the scatters write until this report (ids are never reused).
                    self._end_load_locked(load.spec.request_id, landed=False)
                    continue
                if state == DONE:
                    self._end_load_locked(load.spec.request_id, landed=True)
                    self._state.counters["transfers_received"] += 1
                else:
                    logger.warning("kv load %s failed: %s", load.spec.transfer_id, load.reason)
                    self._end_load_locked(load.spec.request_id, landed=False)
                    self._state.counters["transfers_timed_out" if load.timed_out else "transfers_failed"] += 1
        for load in unasked:  # cancelled, pushed back past its deadline, or too large
            self.send_pull(load.spec.peer_address,
                           self.make_pull(load.spec.transfer_id, load.spec.grant, 0, 0))

    def _end_load_locked(self, request_id: str, landed: bool) -> None:
        """One load of ``request_id`` ended; report the request once its last one has (call
        with the lock held)."""
        if not landed:
            self._requests_failed.add(request_id)
        remaining = self._open_loads.pop(request_id, 1) - 1
        if remaining > 0:
            self._open_loads[request_id] = remaining
            return
        if request_id in self._requests_failed:
            self._requests_failed.discard(request_id)
            self._failed_recving.add(request_id)
        else:
            self._finished_recving.add(request_id)

    def _drained(self, load: Load, now: float) -> bool:
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
                self._state.transport.abort(load.producer_address)
        if load.posted.drained():
            return True
        if now > load.drain_deadline and not load.drain_overdue:
            load.drain_overdue = True
            logger.error("kv load %s: its pair's stream is still busy %.0f s after the load "
                         "failed; its blocks stay held until it drains",
                         load.spec.transfer_id, DRAIN_TIMEOUT_S)
        return False
