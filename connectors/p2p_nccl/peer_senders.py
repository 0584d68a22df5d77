"""PeerSenders: a producer's sender thread per consumer, and what it knows of each consumer
process (its epoch).

One sender thread a consumer address keeps that consumer's transfers in order on one pair.
A consumer's epoch, carried by each of its pulls, tells a restarted process from the one
before it: the producer drops the old pair, and a sender skips the jobs of the old process.
Every method but ``stop`` takes the worker's lock itself, or says ``_locked`` and expects it.
"""

from __future__ import annotations

from collections.abc import Callable

from connectors.p2p_nccl.sender import PeerSender, SendJob
from connectors.p2p_nccl.worker_state import WorkerState

MAX_ABORT_PEERS = 64  # peers a producer starts a sender for only to answer with an abort
MAX_KNOWN_CONSUMERS = 4096  # consumer addresses whose process epoch a producer remembers


class PeerSenders:
    """The sender threads by consumer address, started on first use."""

    def __init__(self, state: WorkerState, on_done: Callable[[SendJob], None]) -> None:
        self._state = state
        self._on_done = on_done
        self._senders: dict[str, PeerSender] = {}
        # Epoch of the consumer process last seen at each address (from its pulls), least
        # recently heard from first; a new one means that process restarted.
        self._epochs: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._senders)

    def stop(self) -> None:
        """Stop every sender thread (shutdown)."""
        for sender in list(self._senders.values()):
            sender.stop()
        self._senders.clear()

    def get_locked(self, peer_address: str) -> PeerSender:
        """The peer's sender thread, started on first use (call with the lock held)."""
        sender = self._senders.get(peer_address)
        if sender is None:
            state = self._state
            sender = self._senders[peer_address] = PeerSender(
                peer_address, state.own_address, state.epoch, state.codec, state.transport,
                self._on_done, send_timeout_s=min(5.0, state.config.transfer_timeout_s),
                current_epoch=self.current_epoch)
            sender.start()
        return sender

    def submit_abort(self, transfer_id: str, peer_address: str, reason: str) -> None:
        """Tell the consumer at ``peer_address`` that ``transfer_id`` will not come. An abort
        is a courtesy (the consumer's deadline covers it): pulls naming ever new addresses
        start at most ``MAX_ABORT_PEERS`` threads; past that it is counted, not sent."""
        job = SendJob(transfer_id=transfer_id, request_id=None, peer_address=peer_address,
                      first_block=0, num_blocks=0, num_layers=0, dtype="", block_shape=[],
                      deadline=self._state.clock() + self._state.config.transfer_timeout_s,
                      abort_reason=reason)
        with self._state.lock:
            if peer_address not in self._senders and len(self._senders) >= MAX_ABORT_PEERS:
                self._state.counters["messages_rejected"] += 1
                return
            sender = self.get_locked(peer_address)
        sender.submit(job)

    def release(self, job: SendJob, reason: str) -> bool:
        """Drop ``job`` unsent if its sender has not taken it yet (``PeerSender.release``)."""
        with self._state.lock:
            sender = self._senders.get(job.peer_address)
        return sender is not None and sender.release(job, reason)

    def note_epoch(self, address: str, epoch: str) -> bool:
        """Remember the epoch of the consumer process at ``address``; True when it replaces
        another one (the process restarted). Recorded before the caller drops the pair, so a
        sender that builds a pair after the drop sees the new epoch and skips the old jobs."""
        if not epoch:
            return False
        with self._state.lock:
            known = self._epochs.pop(address, None)
            self._epochs[address] = epoch
            while len(self._epochs) > MAX_KNOWN_CONSUMERS:
                del self._epochs[next(iter(self._epochs))]
            restarted = known is not None and known != epoch
            if restarted:
                self._state.counters["consumer_restarts"] += 1
        return restarted

    def current_epoch(self, address: str) -> str | None:
        """The epoch of the consumer process last seen at ``address`` (sender threads ask)."""
        with self._state.lock:
            return self._epochs.get(address)
