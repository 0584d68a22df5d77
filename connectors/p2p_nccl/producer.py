"""Producer half of the P2P connector worker: serves the consumers' pulls.

``bind_step`` turns each ``SaveSpec`` into a push job when the consumer's pull request is
already here (PUT, PUT_ASYNC) or into a pending entry that is sent from the held blocks when
the pull arrives (GET, or a late pull), under a lease. Transfers move in data calls of
``layers_per_call`` consecutive layers: after the last layer of a call, ``after_layer``
gathers the call's layers with one kernel into the job's staging buffer and tells the peer's
sender thread once; every other layer's hook does nothing (the jobs: ``send_jobs.py``; the
sender thread per consumer: ``peer_senders.py``). Transfers this producer will never send
are tombstoned, so a late pull for one is answered with an abort at once (both registries:
``early_pulls.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from connectors.p2p_nccl.early_pulls import EarlyPulls, Tombstones
from connectors.p2p_nccl.messages import KVPullRequest, check_pull, layer_nbytes
from connectors.p2p_nccl.metadata import P2pConnectorMetadata, SaveSpec
from connectors.p2p_nccl.peer_senders import PeerSenders
from connectors.p2p_nccl.send_jobs import SendJobs
from connectors.p2p_nccl.sender import SendJob
from connectors.p2p_nccl.worker_state import WorkerState
from engine_core.addresses import is_host_port
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import TrustRefusal
from engine_core.parallel.kv_layout import HeadSlice
from engine_core.worker.block_copy import gather_layers

logger = logging.getLogger(__name__)

# Pulls kept while their prefill has not reached the save (each until orphan_ttl_s): more
# would be a flood of pulls for transfers this producer never runs, not a race.
MAX_WAITING_PULLS = 4096


@dataclass
class PendingSave:
    """A computed save held for its consumer's pull, until ``lease_deadline``."""

    save: SaveSpec
    lease_deadline: float
    ready: bool = False
    ready_event: Any = None


class KVProducer:
    """Pull handling, save binding, send jobs, per-peer sender threads and tombstones."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._registrations = EarlyPulls()
        self._pending: dict[str, PendingSave] = {}
        self._in_flight: dict[str, SendJob] = {}
        self._peers = PeerSenders(state, self._on_send_done)
        self._jobs = SendJobs(state)
        # (job, its block index, the KV heads it moves)
        self._step_push: list[tuple[SendJob, torch.Tensor, HeadSlice | None]] = []
        self._step_deferred: list[str] = []
        self._finished_sending: set[str] = set()
        # A request's KV may go out in several sends (routes between tensor-parallel layouts,
        # each its own heads of the same blocks): its blocks are handed back once all ended.
        self._open_saves: dict[str, int] = {}
        # Transfers this producer will never send: a late pull is answered with an abort.
        self._tombstones = Tombstones(state.config.orphan_ttl_s)
        # Checks the grant every pull carries (used by the control thread only).
        self._grants = GrantAuthority(state.config.cluster_secret)

    def stop_senders(self) -> None:
        """Stop every peer sender thread (shutdown)."""
        self._peers.stop()

    def take_finished_locked(self, now: float) -> set[str]:
        """Expire leases, tombstones and orphan pulls, and hand over the requests whose sends
        finished since the last call (call with the lock held)."""
        for transfer_id, pending in list(self._pending.items()):
            if now > pending.lease_deadline:
                del self._pending[transfer_id]
                self._end_save_locked(pending.save.request_id)
                self._state.counters["leases_expired"] += 1
                self._tombstones.add(transfer_id, now)
        self._tombstones.expire(now)
        self._expire_registrations_locked(now)
        finished, self._finished_sending = self._finished_sending, set()
        return finished

    def _expire_registrations_locked(self, now: float) -> None:
        """Drop pulls and releases that waited ``orphan_ttl_s`` for a save (lock held)."""
        self._state.counters["registrations_expired"] += self._registrations.expire(
            now, self._state.config.orphan_ttl_s)

    def gauges_locked(self) -> dict[str, float]:
        """The producer's gauges (call with the lock held); all 0 when idle but
        ``releases_waiting``. Expired registrations go first: an idle engine takes no steps
        (which expire them too), and its gauges are read all the same."""
        self._expire_registrations_locked(self._state.clock())
        pulls = self._registrations.waiting_pulls()
        send_bytes = sum(job.slots.held_bytes for job in self._in_flight.values()
                         if job.slots is not None)
        return {"send_buffer_bytes_in_use": float(send_bytes),
                "sends_in_flight": float(len(self._in_flight)),
                "sends_pending_pull": float(len(self._pending)),
                "pull_requests_waiting": float(pulls),
                "releases_waiting": float(len(self._registrations) - pulls)}

    def idle_locked(self) -> bool:
        """True when no send, held save, waiting pull or unreported finish is kept. A
        release waiting for its prefill's save holds nothing (no bytes, no blocks, no peer
        waits on it): it does not count, and expires with ``orphan_ttl_s`` when that
        prefill never comes (the proxy released a request P never received)."""
        return not (self._pending or self._in_flight or self._finished_sending
                    or self._open_saves or self._registrations.has_waiting_pull())

    def _evict_waiting_release_locked(self) -> bool:
        """Make room for a pull by dropping the oldest waiting release (lock held): a
        release holds nothing, a pull is a decode worker waiting."""
        evicted = self._registrations.evict_oldest_release()
        if evicted:
            self._state.counters["registrations_expired"] += 1
        return evicted

    def bind_step(self, metadata: P2pConnectorMetadata | None) -> None:
        """Decide, once per save, whether it is pushed layer by layer or deferred."""
        self._step_push = []
        self._step_deferred = []
        if metadata is not None:
            for save in metadata.saves:
                self._bind_save(save)

    def after_layer(self, layer_idx: int) -> None:
        """After a call's last layer, gather the call's layers of each pushed
        request with one kernel and wake its sender; every other layer does nothing."""
        stacked = self._state.require_stacked()
        for job, index, heads in self._step_push:
            assert job.slots is not None
            call = job.slots.call_ending_at(layer_idx)
            if call is None or job.done.is_set():
                continue
            try:
                staging = job.slots.staging
                if staging is None:
                    continue
                first, end = job.slots.calls[call]
                gather_layers(stacked, first, end, index, out=staging[first:end], heads=heads)
                job.slots.put(call, self._state.record_event())
            except RuntimeError as exc:  # allocation failure: this transfer fails, not the step
                job.slots.fail(exc)

    def wait_for_save(self) -> None:
        """End of step: deferred saves become sendable; PUT waits for this step's sends."""
        event = self._state.record_event()
        now = self._state.clock()
        to_start: list[tuple[PendingSave, KVPullRequest, float]] = []
        with self._state.lock:
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
        if self._state.config.send_type == "PUT":
            for job, _, _ in self._step_push:
                job.done.wait(max(0.0, job.deadline - now))
        self._step_push = []
        self._step_deferred = []

    def _bind_save(self, save: SaveSpec) -> None:
        with self._state.lock:
            self._open_saves[save.request_id] = self._open_saves.get(save.request_id, 0) + 1
            registration = self._registrations.pop(save.transfer_id, None)
        if registration is not None and self._state.config.send_type != "GET":
            pull, arrived = registration
            if pull.num_blocks == 0:
                self._end_unsent(save)
                return
            if not self._range_ok(pull, save):
                return
            job, index = self._jobs.pushed(save, pull, arrived)
            if index is not None:
                self._step_push.append((job, index, save.heads))
            self._submit(job)
            return
        with self._state.lock:
            self._pending[save.transfer_id] = PendingSave(
                save, lease_deadline=self._state.clock() + self._state.config.get_lease_s)
            if registration is not None:
                self._registrations[save.transfer_id] = registration
        self._step_deferred.append(save.transfer_id)

    def _start_deferred(self, pending: PendingSave, pull: KVPullRequest, arrived: float) -> None:
        save = pending.save
        if pull.num_blocks == 0:
            self._end_unsent(save)
            return
        if not self._range_ok(pull, save):
            return
        self._submit(self._jobs.deferred(save, pending.ready_event, pull, arrived))

    def _range_ok(self, pull: KVPullRequest, save: SaveSpec) -> bool:
        """The pull asks for the save's blocks and, block by block, the KV heads the save
        moves (all of them, or its route's slice); else the transfer is aborted."""
        shape = self._state.slice_shape(save.heads)
        if (pull.first_block + pull.num_blocks == len(save.block_ids)
                and list(pull.block_shape) == shape):
            return True
        reason = (f"consumer asks blocks [{pull.first_block}, {pull.first_block + pull.num_blocks})"
                  f" of shape {list(pull.block_shape)} but the prompt has "
                  f"{len(save.block_ids)} of shape {shape}")
        with self._state.lock:
            self._state.counters["messages_rejected"] += 1
        self._peers.submit_abort(save.transfer_id, pull.consumer_address, reason)
        self._finish_send(save.request_id)
        return False

    def _submit(self, job: SendJob) -> None:
        with self._state.lock:
            self._in_flight[job.transfer_id] = job
            sender = self._peers.get_locked(job.peer_address)
        sender.submit(job)

    def abandon(self, transfer_id: str, peer_address: str) -> None:
        """This producer will never send the transfer: tell a waiting consumer, drop a release."""
        with self._state.lock:
            registration = self._registrations.pop(transfer_id, None)
            if registration is None:
                self._tombstones.add(transfer_id, self._state.clock())
        if registration is not None and registration[0].num_blocks > 0:
            self._peers.submit_abort(transfer_id, registration[0].consumer_address, "producer request ended")

    def _on_send_done(self, job: SendJob) -> None:
        with self._state.lock:
            if job.abort_reason is not None:
                self._state.counters["control_messages_sent"] += 1
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
            self._tombstones.add(job.transfer_id, self._state.clock())
            if job.slots is not None:
                job.slots.clear()
            if job.request_id is not None:
                self._end_save_locked(job.request_id)
            if job.released:
                pass  # the consumer no longer wanted it: not a failure of this producer
            elif job.error is None:
                self._state.counters["transfers_sent"] += 1
                self._state.counters["control_messages_sent"] += 1
                element_size = self._state.require_geometry()[3]
                self._state.counters["bytes_sent"] += job.num_layers * layer_nbytes(
                    job.num_blocks, job.block_shape, element_size)
            else:
                self._state.counters["sends_failed"] += 1
        self._state.doorbell.ring()

    def _end_unsent(self, save: SaveSpec) -> None:
        """A release (``num_blocks=0``) ended ``save`` with nothing sent: its blocks go back
        and its transfer id is tombstoned, so a second release (D's own after the proxy's,
        or the reverse) is dropped instead of waiting as a pull, and a late pull is told."""
        with self._state.lock:
            self._end_save_locked(save.request_id)
            self._tombstones.add(save.transfer_id, self._state.clock())

    def _finish_send(self, request_id: str) -> None:
        with self._state.lock:
            self._end_save_locked(request_id)

    def _end_save_locked(self, request_id: str) -> None:
        """One send of ``request_id`` ended; hand its blocks back once its last one has (call
        with the lock held)."""
        remaining = self._open_saves.pop(request_id, 1) - 1
        if remaining > 0:
            self._open_saves[request_id] = remaining
        else:
            self._finished_sending.add(request_id)

    def on_pull(self, pull: KVPullRequest) -> None:
        if self._state.geometry is None or not self._state.config.is_producer:
            self._state.reject("pull request", "this engine does not produce KV")
            return
        if not self._pull_granted(pull):
            return
        num_layers, dtype, block_shape, _ = self._state.geometry
        reason = check_pull(pull, num_layers, dtype, block_shape)
        if reason is not None:
            self._state.reject("pull request", reason)
            if pull.num_blocks > 0 and is_host_port(pull.consumer_address):
                self._peers.submit_abort(pull.transfer_id, pull.consumer_address, reason)
            return
        if self._peers.note_epoch(pull.consumer_address, pull.consumer_epoch):
            # Our pair's other rank is gone and the new process has none: drop it now (this also
            # ends a send stalled on it), so the next send re-handshakes with an NcclHello.
            logger.info("kv consumer at %s restarted: dropping its pair", pull.consumer_address)
            self._state.transport.abort(pull.consumer_address)
        with self._state.lock:
            dead = pull.transfer_id in self._tombstones
            job = None if dead else self._in_flight.get(pull.transfer_id)
        if job is not None:
            if pull.num_blocks == 0:
                self._release_queued_send(pull, job)
                return
            self._state.reject("pull request", f"{pull.transfer_id!r:.80} is already being sent")
            return
        if dead:
            if pull.num_blocks > 0:
                self._peers.submit_abort(pull.transfer_id, pull.consumer_address, "transfer released")
            return
        if pull.num_blocks == 0 and self._cancel_waiting_pull(pull):
            return
        with self._state.lock:
            pending = self._pending.get(pull.transfer_id)
            full = (pending is None and pull.transfer_id not in self._registrations
                    and len(self._registrations) >= MAX_WAITING_PULLS
                    and not self._evict_waiting_release_locked())
            if pending is not None and pending.ready:
                del self._pending[pull.transfer_id]
            elif not full:  # its prefill has not reached the save yet: kept until it does
                self._registrations[pull.transfer_id] = (pull, self._state.clock())
                return
        if full:
            self._state.reject("pull request", f"{pull.transfer_id!r:.80}: {MAX_WAITING_PULLS} pulls "
                                         "already wait for their prefill")
            if pull.num_blocks > 0:
                self._peers.submit_abort(pull.transfer_id, pull.consumer_address, "producer busy")
            return
        self._start_deferred(pending, pull, self._state.clock())

    def _pull_granted(self, pull: KVPullRequest) -> bool:
        """Whether the pull's grant names this producer and the pull's consumer as D for its
        transfer. A refused pull is counted and logged once per peer, and answered with
        nothing: no byte, not even an abort, goes to an address no grant names."""
        try:
            self._grants.verify(pull.grant, transfer_id=pull.transfer_id,
                                producer=self._state.own_address,
                                consumer=pull.consumer_address, peer=pull.consumer_address)
        except TrustRefusal:
            with self._state.lock:
                self._state.counters["pulls_refused"] += 1
            return False
        return True

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
        with self._state.lock:
            registered = self._registrations.get(release.transfer_id)
            if registered is None or registered[0].num_blocks == 0:
                return False
            pull, arrived = registered
            ours = pull.consumer_address == release.consumer_address
            if ours:
                self._registrations[release.transfer_id] = (release, arrived)
        if not ours:
            self._state.reject("pull release", f"{release.transfer_id!r:.80} was pulled by "
                                         f"{pull.consumer_address}, not "
                                         f"{release.consumer_address!r:.80}")
            return True
        self._peers.submit_abort(release.transfer_id, release.consumer_address,
                           "pull cancelled by the consumer")
        return True

    def _release_queued_send(self, release: KVPullRequest, job: SendJob) -> None:
        """A release (``num_blocks=0``) for a transfer whose send job exists.

        A job still queued behind other sends to this consumer is dropped unsent: its peer
        sender reports it at once (``on_done``: the blocks go back, the id is tombstoned) and
        the abort that answers lets the consumer free the receive bytes it reserved (on NCCL
        it keeps them until this answer, which must not wait for the whole transfer to
        arrive after the jobs ahead of it). A job the sender thread already took runs in full: the
        release crossed it, and its header answers the consumer. The sender decides which,
        under the job's lock, so a job is never half sent. As for a waiting pull, only the
        consumer address that pulled may release (refused, logged and counted otherwise)."""
        if release.consumer_address != job.peer_address:
            self._state.reject("pull release", f"{release.transfer_id!r:.80} is sent to "
                                         f"{job.peer_address}, not "
                                         f"{release.consumer_address!r:.80}")
            return
        if not self._peers.release(job, "transfer released"):
            logger.debug("kv release of %.80r: its send already started", release.transfer_id)
            return
        self._peers.submit_abort(release.transfer_id, release.consumer_address, "transfer released")
