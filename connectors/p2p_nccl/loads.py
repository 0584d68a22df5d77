"""Load: one transfer a consumer pulls, from its receive-buffer reservation to its report.

Its states: ``WAITING_BUFFER`` (no receive bytes yet), ``REQUESTED`` (the pull went out),
``RECEIVING`` (a producer's header was accepted and its receives are posted), ``DONE`` and
``FAILED``. The consumer (``consumer.py``) moves it between them under the worker's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from connectors.p2p_nccl.messages import KVPullRequest
from connectors.p2p_nccl.metadata import LoadSpec

WAITING_BUFFER, REQUESTED, RECEIVING, DONE, FAILED = "waiting_buffer", "requested", "receiving", "done", "failed"
# A failed load whose receives were posted is reported once its pair's stream has passed
# the scatters queued behind them (an aborted pair's kernels end, so it does): until then
# they could still write into its blocks, which the scheduler holds until the report. A
# stream still busy after this long is logged as an error; the load keeps its blocks (a
# leak is better than another request's KV overwritten).
DRAIN_TIMEOUT_S = 30.0


@dataclass
class Load:
    """One transfer this consumer pulls, from buffer reservation to its report."""

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
