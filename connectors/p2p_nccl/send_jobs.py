"""SendJobs: the send job a consumer's pull asks of a save, in its two shapes.

A *pushed* job (the pull was here when the save was bound) gets a staging buffer that the
layer hooks fill call by call as the step computes the layers. A *deferred* job (the pull
came after the save, or the connector runs GET) gathers each call's layers from the held
blocks when its sender thread reaches it. Both end, at the latest, a margin before the
deadline the pull announced.
"""

from __future__ import annotations

from typing import Any

import torch

from connectors.p2p_nccl.messages import (
    KVPullRequest,
    call_ranges,
    layer_nbytes,
    plan_layers_per_call,
)
from connectors.p2p_nccl.metadata import SaveSpec
from connectors.p2p_nccl.sender import CallSlots, SendJob
from connectors.p2p_nccl.worker_state import WorkerState
from engine_core.worker.block_copy import block_ids_tensor, gather_layers, wire_shape

# A producer's send ends this long before the consumer's deadline that the pull announced,
# so that its header never reaches a consumer that already gave up (control latency).
PULL_DEADLINE_MARGIN_S = 0.25


class SendJobs:
    """Builds a producer's send jobs from its worker state."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state

    def layers_per_call(self, pull: KVPullRequest) -> int:
        """Layers a data call carries: enough to reach ``min_call_bytes``, within the
        consumer's receive slot."""
        num_layers, _, _, element_size = self._state.require_geometry()
        per_layer = layer_nbytes(pull.num_blocks, pull.block_shape, element_size)
        return plan_layers_per_call(num_layers, per_layer, self._state.config.min_call_bytes,
                                    max_layers=pull.max_layers_per_call)

    def make(self, save: SaveSpec, pull: KVPullRequest, arrived: float,
             **source: Any) -> SendJob:
        """The send of ``save`` that ``pull`` (received at ``arrived``) asked for. Its deadline
        is also the consumer's, less a margin (the pull says how long it still waits): a
        header sent after the consumer gave up is refused and, on NCCL, its pair aborted, and
        the sends of every later transfer on that pair queued behind it (one sender thread a
        consumer) failed with it."""
        num_layers, dtype, _, _ = self._state.require_geometry()
        deadline = min(self._state.clock() + self._state.config.transfer_timeout_s,
                       arrived + pull.timeout_s - PULL_DEADLINE_MARGIN_S)
        return SendJob(transfer_id=save.transfer_id, request_id=save.request_id,
                       peer_address=pull.consumer_address, first_block=pull.first_block,
                       num_blocks=pull.num_blocks, num_layers=num_layers, dtype=dtype,
                       block_shape=list(pull.block_shape), deadline=deadline,
                       layers_per_call=self.layers_per_call(pull),
                       peer_epoch=pull.consumer_epoch, **source)

    def pushed(self, save: SaveSpec, pull: KVPullRequest,
               arrived: float) -> tuple[SendJob, torch.Tensor | None]:
        """A job the layer hooks fill as this step computes, and the index of its blocks;
        None for the index when its staging buffer could not be allocated (the job has
        failed then: this transfer fails, not the step)."""
        state = self._state
        num_layers = state.require_geometry()[0]
        calls = call_ranges(num_layers, self.layers_per_call(pull))
        try:
            staging = torch.empty(wire_shape(num_layers, pull.num_blocks, pull.block_shape),
                                  dtype=state.require_stacked().dtype, device=state.device)
        except RuntimeError as exc:
            job = self.make(save, pull, arrived, slots=CallSlots(torch.empty(num_layers, 0),
                                                                 calls))
            assert job.slots is not None
            job.slots.fail(exc)
            return job, None
        index = block_ids_tensor(save.block_ids[pull.first_block:], state.device)
        return self.make(save, pull, arrived, slots=CallSlots(staging, calls)), index

    def deferred(self, save: SaveSpec, ready_event: Any, pull: KVPullRequest,
                 arrived: float) -> SendJob:
        """A job whose sender gathers each call's layers from the held blocks, after
        ``ready_event`` (the end of the step that computed them)."""
        state = self._state
        block_ids = save.block_ids[pull.first_block:]
        peer = pull.consumer_address
        block_shape = list(pull.block_shape)
        index: torch.Tensor | None = None

        def gather_call(first: int, end: int) -> tuple[torch.Tensor, Any]:
            # The blocks are held by the scheduler until this send reports done. The index is
            # uploaded inside the gather context, on the stream that gathers: uploaded on the
            # caller's stream, a gather on the transport's stream could read it unwritten.
            nonlocal index
            stacked = state.require_stacked()
            with state.transport.gather_context(peer, ready_event):
                if index is None:
                    index = block_ids_tensor(block_ids, state.device)
                out = torch.empty(wire_shape(end - first, len(block_ids), block_shape),
                                  dtype=stacked.dtype, device=state.device)
                return gather_layers(stacked, first, end, index, out=out, heads=save.heads), None

        return self.make(save, pull, arrived, call_source=gather_call)
