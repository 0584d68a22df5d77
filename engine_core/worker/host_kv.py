"""KV offload's host memory and its copies (``--kv-offloading-size``; bookkeeping in
sched/host_tier.py).

Layout: ``[layers, 2, slots, block_size, heads, head_dim]``, the device cache's own order. On
CUDA the store is pinned memory the GPU addresses directly: a step's downloads are one kernel
writing the evicted blocks straight into their host slots, its uploads one kernel reading the
slots straight into free device blocks (block_copy.copy_indexed_blocks): no staging buffer, no
host-side gather, no loop per block, and nothing for the engine's thread to copy. Both run on
the engine's stream in scheduling order, before the step's forward: downloads first (they read
blocks as they were before this pass reused them), then uploads; so an upload always reads a
slot after the download that filled it. A download's slots still stay pending (never served,
never reused) until ``poll`` sees its event, which keeps the tier's rule independent of
stream order.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from engine_core.sched.host_tier import HostTier
from engine_core.sched.kv_cache_manager import HostCopies
from engine_core.worker.block_copy import block_ids_tensor, copy_indexed_blocks
from engine_core.worker.pinned_memory import HostBuffer


class HostKVStore:
    """The host slots of one engine's offloaded KV blocks."""

    def __init__(self, stacked: torch.Tensor, num_slots: int, tier: HostTier) -> None:
        self.device = stacked.device
        self._cuda = stacked.is_cuda
        shape = (stacked.shape[0], 2, num_slots, *stacked.shape[3:])
        # Exact size, GPU-addressable.
        self._memory = HostBuffer(math.prod(shape) * stacked.dtype.itemsize, pinned=self._cuda)
        self.store = self._memory.view(0, shape, stacked.dtype)
        self.tier = tier
        self._downloads: deque[tuple[torch.cuda.Event, list[int]]] = deque()
        if self._cuda:
            self._compile_copy(stacked)

    @property
    def nbytes(self) -> int:
        return self._memory.nbytes

    def _compile_copy(self, stacked: torch.Tensor) -> None:
        """Build the copy kernel now, not inside the first step that offloads: block 0 of the
        empty cache to slot 0 and back (no request holds either yet)."""
        zero = block_ids_tensor([0], self.device)
        copy_indexed_blocks(stacked, self.store, zero, zero)
        copy_indexed_blocks(self.store, stacked, zero, zero)
        torch.cuda.synchronize(self.device)

    def apply(self, stacked: torch.Tensor, copies: HostCopies) -> None:
        """Queue one pass's copies on the current stream: downloads, then uploads."""
        if copies.offload_blocks:
            self._download(stacked, copies.offload_blocks, copies.offload_slots)
        if copies.onload_blocks:
            self._upload(stacked, copies.onload_slots, copies.onload_blocks)

    def poll(self) -> None:
        """Release the slots of the downloads that finished (in order)."""
        while self._downloads and self._downloads[0][0].query():
            _, slots = self._downloads.popleft()
            self.tier.landed(slots)

    def drain(self) -> None:
        """Wait for every queued copy and release the downloads' slots (before sleep or a
        reset)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the engine's stream, whichever it is
        self.poll()

    def _download(self, stacked: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        copy_indexed_blocks(stacked, self.store, block_ids_tensor(blocks, self.device),
                            block_ids_tensor(slots, self.device))
        if not self._cuda:
            self.tier.landed(slots)
            return
        event = torch.cuda.Event()
        event.record()
        self._downloads.append((event, slots))

    def _upload(self, stacked: torch.Tensor, slots: list[int], blocks: list[int]) -> None:
        copy_indexed_blocks(self.store, stacked, block_ids_tensor(slots, self.device),
                            block_ids_tensor(blocks, self.device))
