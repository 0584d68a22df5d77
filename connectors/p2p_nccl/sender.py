"""Producer send jobs and the per-peer sender thread (ordered, with deadlines).

A ``SendJob`` is one request's transfer to one consumer: a header, then one data call per
group of ``layers_per_call`` consecutive layers. Its layers come either from
``after_layer`` (push: each call's layers gathered with one kernel into the job's contiguous
staging buffer on the step's stream, right after the call's last layer is computed) or, for GET and late pull requests, from
the held paged blocks at send time. One ``PeerSender`` thread per consumer issues the jobs in order,
so both sides post data operations on the pair in the same order. A job its consumer
releases while it still waits in the queue is never sent (``PeerSender.release``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.p2p_nccl.handshake import ControlClient
from connectors.p2p_nccl.messages import KVSendAbort, KVSendHeader, call_ranges
from engine_core.codec import MessageCodec
from engine_core.errors import KVTransferError

logger = logging.getLogger(__name__)

# (first_layer, end_layer) -> (contiguous buffer of those layers, event to wait for)
CallSource = Callable[[int, int], tuple[torch.Tensor, Any]]


class CallSlots:
    """Readiness of each data call's slice of a job's staging buffer, from ``after_layer``
    to the sender: one signal per call, not per layer (each wake-up of the sender thread
    costs the stepping thread the GIL).

    ``staging`` is ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``: call c's
    layers ``[first, end)`` are gathered into ``staging[first:end]`` with one kernel.
    """

    def __init__(self, staging: torch.Tensor, calls: list[tuple[int, int]]) -> None:
        self.staging: torch.Tensor | None = staging
        self.calls = calls
        self._call_ending_at = {end - 1: call for call, (_, end) in enumerate(calls)}
        self._events: list[tuple[Any] | None] = [None] * len(calls)
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def held_bytes(self) -> int:
        """Bytes of the staging buffer (held until the job finishes)."""
        with self._cond:
            return self.staging.nbytes if self.staging is not None else 0

    def call_ending_at(self, layer: int) -> int | None:
        """The call whose last layer is ``layer`` (its gather is due after it), or None."""
        return self._call_ending_at.get(layer)

    def put(self, call: int, event: Any) -> None:
        """Call ``call``'s layers are gathered once ``event`` completes."""
        with self._cond:
            if self.staging is None:  # the job already ended (failed or aborted)
                return
            self._events[call] = (event,)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def take(self, call: int, deadline: float) -> tuple[torch.Tensor, Any]:
        """Wait for call ``call`` until ``deadline``: its staging slice and event."""
        with self._cond:
            while self._events[call] is None:
                if self._error is not None:
                    raise KVTransferError(f"layer gather failed: {self._error}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    first, end = self.calls[call]
                    raise KVTransferError(f"layers {first}-{end - 1} not computed before "
                                          "the deadline")
                self._cond.wait(min(remaining, 0.5))
            if self.staging is None:
                raise KVTransferError("staging buffer released")
            (event,) = self._events[call]
            first, end = self.calls[call]
            return self.staging[first:end], event

    def clear(self) -> int:
        """Drop the staging buffer; returns its bytes."""
        with self._cond:
            nbytes = self.staging.nbytes if self.staging is not None else 0
            self.staging = None
            self._events = [None] * len(self._events)
            return nbytes


@dataclass
class SendJob:
    """One transfer (or, with ``abort_reason``, one abort notice) to one consumer.

    A job is either started by its sender thread or released by its consumer while still
    queued, never both (``try_start`` / ``try_release``, under the job's own lock): so it is
    sent entirely or not at all, and reported through ``on_done`` exactly once.
    """

    transfer_id: str
    request_id: str | None
    peer_address: str
    first_block: int
    num_blocks: int
    num_layers: int
    dtype: str
    block_shape: list[int]
    deadline: float
    layers_per_call: int = 1
    peer_epoch: str = ""  # the consumer process that asked (its pull's ``consumer_epoch``)
    call_source: CallSource | None = None
    slots: CallSlots | None = None
    abort_reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    started: bool = False  # the sender thread took it: it runs to its end
    released: bool = False  # dropped while queued: never sent, already reported
    _claim: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                   compare=False)

    def try_start(self) -> bool:
        """Sender thread, on taking the job (its point of no return): False when the job was
        released meanwhile (skip it), else it is started and can no longer be released."""
        with self._claim:
            if self.released:
                return False
            self.started = True
            return True

    def try_release(self, reason: str) -> bool:
        """Control thread, on the consumer's release: True when the job was still queued (it
        is now released, failed with ``reason``, and will be skipped), False when the sender
        thread already took it (or it was released before)."""
        with self._claim:
            if self.started or self.released:
                return False
            self.released, self.error = True, reason
            return True


class PeerSender:
    """One thread that sends jobs to one consumer in submission order.

    ``current_epoch(address)`` names the consumer process now at the address (the epoch of
    its latest pull), or None when unknown; a job asked for by another process is failed.
    """

    def __init__(self, peer_address: str, own_address: str, epoch: str, codec: MessageCodec,
                 transport: Any, on_done: Callable[[SendJob], None],
                 send_timeout_s: float,
                 current_epoch: Callable[[str], str | None] | None = None) -> None:
        self.peer_address = peer_address
        self._current_epoch = current_epoch
        self._own_address = own_address
        self._epoch = epoch
        self._codec = codec
        self._transport = transport
        self._on_done = on_done
        self._send_timeout_s = send_timeout_s
        self._queue: queue.Queue[SendJob | None] = queue.Queue()
        self._client: ControlClient | None = None
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-sender-{peer_address}",
                                        daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: SendJob) -> None:
        """Queue a job; it runs after every job submitted before it."""
        self._queue.put(job)

    def release(self, job: SendJob, reason: str) -> bool:
        """Drop a job of this sender that is queued but not started, because its consumer
        released the transfer (its request ended there): True when dropped, False when the
        thread already took it (the send then runs, or ran, in full: its header answers).

        A dropped job is reported through ``on_done`` now (``released`` set, ``error`` the
        reason), so its blocks go back at once instead of after every job queued before it;
        the thread skips it when it gets there. Nothing of it was sent, so nothing needs
        aborting on the pair."""
        if not job.try_release(reason):
            return False
        self._finish(job)
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Fail queued jobs, stop the thread, close the socket."""
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    break
                if not job.try_start():  # released while queued: ``release`` reported it
                    continue
                if self._stopping:
                    job.error = "connector shutting down"
                    self._finish(job)
                    continue
                self._process(job)
        finally:
            if self._client is not None:
                self._client.close()

    def _client_for(self) -> ControlClient:
        if self._client is None:
            self._client = ControlClient(self.peer_address, self._codec,
                                         send_timeout_s=self._send_timeout_s, high_water_mark=64)
        return self._client

    def _process(self, job: SendJob) -> None:
        header_sent = False
        try:
            if job.abort_reason is not None:
                self._send_abort(job, job.abort_reason)
                return
            if time.monotonic() > job.deadline:
                raise KVTransferError("deadline passed before the send started")
            self._check_current(job)
            client = self._client_for()
            self._transport.open_pair(client, self.peer_address, job.deadline)
            self._check_current(job)  # the restart may have been seen while open_pair waited
            self._seq += 1
            header = KVSendHeader(
                transfer_id=job.transfer_id, producer_address=self._own_address,
                producer_epoch=self._epoch, seq=self._seq, first_block=job.first_block,
                num_blocks=job.num_blocks, num_layers=job.num_layers, dtype=job.dtype,
                block_shape=list(job.block_shape), layers_per_call=job.layers_per_call)
            client.send(header)
            header_sent = True
            for call, (first, end) in enumerate(call_ranges(job.num_layers, job.layers_per_call)):
                if job.slots is not None:
                    buffer, event = job.slots.take(call, job.deadline)
                else:
                    assert job.call_source is not None
                    buffer, event = job.call_source(first, end)
                self._transport.send_call(client, header, first, buffer, event, job.deadline)
                del buffer
            self._transport.finish_sends(self.peer_address, job.deadline)
        except Exception as exc:  # any failure fails this job only, never the thread
            job.error = f"{type(exc).__name__}: {exc}"
            logger.warning("kv send %s to %s failed: %s", job.transfer_id, self.peer_address,
                           job.error)
            if header_sent:
                # Data calls may be posted: abort the pair so neither side waits on them.
                self._transport.abort(self.peer_address)
            if self._client is not None:
                self._client.close()
                self._client = None
            if header_sent or job.abort_reason is None:
                self._send_abort(job, job.error)
        finally:
            self._finish(job)

    def _check_current(self, job: SendJob) -> None:
        """Fail a job asked for by an earlier process at the consumer's address (it restarted).

        That process is gone, and the new one would reject the header and abort its new pair,
        so the data calls would stall on the producer until their deadline.
        """
        current = self._current_epoch(self.peer_address) if self._current_epoch else None
        if job.peer_epoch and current is not None and job.peer_epoch != current:
            raise KVTransferError("the consumer restarted: the process that asked is gone")

    def _send_abort(self, job: SendJob, reason: str) -> None:
        try:
            self._client_for().send(KVSendAbort(job.transfer_id, self._own_address, reason[:200]))
        except Exception as exc:  # best effort: the consumer's deadline covers a lost abort
            logger.info("abort notice for %s not sent: %s", job.transfer_id, exc)
            if self._client is not None:
                self._client.close()
                self._client = None

    def _finish(self, job: SendJob) -> None:
        """Report the job; a failing report is logged, never the end of this thread (which
        would leave every later job to this peer queued, and its blocks held, for good)."""
        try:
            self._on_done(job)
        except Exception:
            logger.exception("reporting kv send %s to %s failed", job.transfer_id,
                             self.peer_address)
        finally:
            job.done.set()
