"""The consumer's receive side: what its control thread does with a producer's messages.

A header is checked against the load that pulled it (its producer, sequence and geometry),
its data calls placed in the load's receive buffer and its receives posted, each call's
scatter into the paged cache queued behind it; data messages (CPU transport) are landed
call by call; an abort fails the load, but only from the producer the load pulled from.
A mixin of ``KVConsumer`` (``consumer.py``), under the worker's lock like the rest of it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from connectors.p2p_nccl.loads import DONE, FAILED, RECEIVING, REQUESTED, Load
from connectors.p2p_nccl.messages import (
    KVLayerData,
    KVSendAbort,
    KVSendHeader,
    call_ranges,
    check_header,
)
from engine_core.worker.block_copy import block_ids_tensor, scatter_layers, wire_shape

if TYPE_CHECKING:
    from connectors.p2p_nccl.consumer import KVConsumer

logger = logging.getLogger("connectors.p2p_nccl.consumer")


class ReceiveHandlers:
    """``KVConsumer``'s handlers of headers, layer data and aborts."""

    def _scatter_call(self: KVConsumer, load: Load, call: int) -> None:
        """Scatter one landed data call into the load's blocks, on the current stream (the
        receiving one): the block ids are uploaded on it the first time."""
        assert load.views is not None
        if load.scatter_ids is None:
            load.scatter_ids = block_ids_tensor(load.spec.block_ids, self._state.device)
        scatter_layers(self._state.require_stacked(), load.scatter_ids, load.views[call],
                       call * load.layers_per_call, load.spec.heads)

    def on_header(self: KVConsumer, header: KVSendHeader) -> None:
        key = (header.producer_address, header.producer_epoch)
        with self._state.lock:
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
                self._state.counters["messages_rejected"] += 1
                if load is not None and load.state == REQUESTED:
                    load.state, load.reason = FAILED, f"bad header: {reason}"
        if reason is not None:
            logger.warning("rejected kv header %.80r: %.300s", header.transfer_id, reason)
            self._state.doorbell.ring()
            if not self._state.transport.uses_data_messages:
                # The producer's sends would never be matched: abort so they fail fast.
                self._state.transport.abort(header.producer_address)
            return
        assert views is not None
        try:
            posted = self._state.transport.post_recv(
                header.producer_address, views, ready=load.buffer_ready,
                on_landed=self._state.doorbell.ring, after_each=lambda call: self._scatter_call(load, call))
        except Exception as exc:  # no pair (a header without its hello): fail now, not at the deadline
            with self._state.lock:
                # Part may be queued (the pair failed midway): drained before it is reported.
                load.posted = getattr(exc, "posted", None)
                load.busy = False
            self._fail_unposted(load, header, exc)
            return
        with self._state.lock:
            load.posted, load.busy = posted, False
            if posted is not None:
                self._state.counters["bytes_received"] += load.nbytes

    def _plan_calls(self: KVConsumer, load: Load, layers_per_call: int) -> str | None:
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

    def _fail_unposted(self: KVConsumer, load: Load, header: KVSendHeader, exc: Exception) -> None:
        """A header accepted but its receives could not be posted: the load fails at once
        (never left in RECEIVING, nothing posted, until its deadline) and the producer's
        pair is aborted, so its data calls fail instead of stalling."""
        with self._state.lock:
            if load.state == RECEIVING:
                load.state, load.reason = FAILED, f"receives not posted: {exc}"
        self._state.reject("header", f"{header.transfer_id!r:.80}: receives not posted: {exc}")
        self._state.transport.abort(header.producer_address)
        self._state.doorbell.ring()

    def on_layer_data(self: KVConsumer, message: KVLayerData, frames: list[Any]) -> None:
        if not self._state.transport.uses_data_messages:
            # NCCL moves the bytes: a data message is no part of any load here.
            self._state.reject("layer data", f"{message.transfer_id!r:.80}: this consumer receives "
                                       "over NCCL, not in data messages")
            return
        with self._state.lock:
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
                self._state.doorbell.ring()
        if not ok:
            self._state.reject("layer data", f"{message.transfer_id!r:.80} layer {message.layer}: "
                         + ("does not match the transfer being received" if receiving
                            else "no transfer is being received"))
            return
        try:
            self._state.transport.land(destination.view(torch.uint8).reshape(-1),
                                 np.frombuffer(frames[0].buffer, dtype=np.uint8),
                                 load.buffer_ready, then=lambda: self._scatter_call(load, call))
        finally:
            with self._state.lock:
                load.busy = False
        self._state.transport.count_recv_call()
        with self._state.lock:
            if load.state == RECEIVING and load.seq == message.seq:
                load.layers_received = end
                self._state.counters["bytes_received"] += expected
                if load.layers_received == load.pull.num_layers:
                    load.state = DONE
                    self._state.doorbell.ring()

    def on_abort(self: KVConsumer, message: KVSendAbort) -> None:
        """Fail the load the abort names. Once a header was accepted only its producer may
        abort: an abort from another address must not fail the load and abort that address's
        pair, which would leave the real producer's receives posted into a buffer about to be
        freed."""
        with self._state.lock:
            load = self._loads.get(message.transfer_id)
            if load is None or load.state not in (REQUESTED, RECEIVING):
                return  # the load already ended: a late abort is expected
            was_receiving = load.state == RECEIVING
            # Only the producer the load pulled from (then: whose header it accepted).
            expected = load.producer_address if was_receiving else load.spec.peer_address
            stranger = message.producer_address != expected
            if not stranger:
                load.state, load.reason = FAILED, f"producer aborted: {message.reason[:200]}"
                self._state.doorbell.ring()
        if stranger:
            self._state.reject("abort", f"{message.transfer_id!r:.80} is pulled from {expected}, "
                                  f"not {message.producer_address!r:.80}")
            return
        if was_receiving and not self._state.transport.uses_data_messages:
            self._state.transport.abort(load.producer_address)

