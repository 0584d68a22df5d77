"""KV offload's host memory and its copies (``--kv-offloading-size``; bookkeeping in
sched/host_tier.py).

Layout: ``[layers, 2, slots, block_size, heads, head_dim]``, the device cache's own order, so
a step's downloads are one gather kernel plus one device-to-host copy, and its uploads one
host-side index_select, one host-to-device copy and one scatter kernel (block_copy.py), never
a loop per block. Everything runs on the engine's stream in scheduling order, before the
step's forward: downloads first (they read blocks as they were before this pass reused them),
then uploads. On CUDA a download lands in host memory asynchronously: its slots stay pending
(never served, never reused) until ``poll`` sees its event and copies the pinned staging into
place; an upload's pinned staging is kept until its copy is done.
"""

from __future__ import annotations

from collections import deque

import torch

from engine_core.kernels import as_int_words
from engine_core.sched.host_tier import HostTier
from engine_core.sched.kv_cache_manager import HostCopies
from engine_core.worker.block_copy import block_ids_tensor, gather_layers, scatter_layers


class HostKVStore:
    """The host slots of one engine's offloaded KV blocks."""

    def __init__(self, stacked: torch.Tensor, num_slots: int, tier: HostTier) -> None:
        self.device = stacked.device
        self._cuda = stacked.is_cuda
        shape = (stacked.shape[0], 2, num_slots, *stacked.shape[3:])
        self.store = torch.empty(shape, dtype=stacked.dtype, device="cpu", pin_memory=self._cuda)
        self.tier = tier
        self._downloads: deque[tuple[torch.cuda.Event, torch.Tensor, list[int]]] = deque()
        self._uploads: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def apply(self, stacked: torch.Tensor, copies: HostCopies) -> None:
        """Queue one pass's copies on the current stream: downloads, then uploads."""
        if copies.offload_blocks:
            self._download(stacked, copies.offload_blocks, copies.offload_slots)
        if copies.onload_blocks:
            self._upload(stacked, copies.onload_slots, copies.onload_blocks)

    def poll(self) -> None:
        """Land the downloads that finished (in order) and drop finished uploads' staging."""
        while self._downloads and self._downloads[0][0].query():
            _, staging, slots = self._downloads.popleft()
            self._land(staging, slots)
        while self._uploads and self._uploads[0][0].query():
            self._uploads.popleft()

    def drain(self) -> None:
        """Wait for every queued copy and land the downloads (before sleep or a reset)."""
        for event, _, _ in self._downloads:
            event.synchronize()
        for event, _ in self._uploads:
            event.synchronize()
        self.poll()

    def _download(self, stacked: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        ids = block_ids_tensor(blocks, self.device)
        gathered = torch.empty((stacked.shape[0], 2, len(blocks), *stacked.shape[3:]),
                               dtype=stacked.dtype, device=self.device)
        gather_layers(stacked, 0, stacked.shape[0], ids, out=gathered)
        if not self._cuda:
            self._land(gathered, slots)
            return
        staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staging.copy_(gathered, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._downloads.append((event, staging, slots))

    def _land(self, staging: torch.Tensor, slots: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        as_int_words(self.store).index_copy_(2, index, as_int_words(staging))
        self.tier.landed(slots)

    def _upload(self, stacked: torch.Tensor, slots: list[int], blocks: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        staging = torch.empty((self.store.shape[0], 2, len(slots), *self.store.shape[3:]),
                              dtype=self.store.dtype, pin_memory=self._cuda)
        torch.index_select(as_int_words(self.store), 2, index, out=as_int_words(staging))
        buffer = staging.to(self.device, non_blocking=True)
        scatter_layers(stacked, block_ids_tensor(blocks, self.device), buffer)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._uploads.append((event, staging))
