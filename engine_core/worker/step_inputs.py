"""Persistent step-input buffers: host staging (pinned on CUDA) and the device tensors the
model and the attention kernels read, refilled every step with vectorised numpy.

Why persistent: a CUDA graph reads its inputs from fixed addresses, and allocating fresh
tensors (plus a blocking copy each) every step costs host time the GPU then waits for.
A step moves everything in two packed non-blocking host->device copies (int64: token ids,
positions, slots, logits rows; int32: query starts, sequence lengths, prefill tiles,
block-table rows), then one device copy places the block-table rows into the fixed-width
table, whose width (from ``max_model_len``) is the same for every step, eager or replayed.

Layout of a step with ``n`` tokens and ``s`` sequences (padding included): int64 ``[ids n |
positions n | slots n | logits rows]``, int32 ``[query starts s+1 | seq lens s | prefill
tiles 2 * max_prefill_tiles(n, s) | decode work items 3 * max_decode_items(s) | their
per-sequence (first, splits) 2 * s | block rows]``, each section 16-byte aligned. A graph of
size ``p`` (tokens) is captured on exactly the views a step padded to ``p`` gets (``n = p``,
``s = graph_seqs(p)``), so filling the buffers is all a replay needs. Padding appends empty
sequences (``seq_len`` 0) and tokens of no sequence (id 0, position 0, slot -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_core.attention.decode_work import DecodeWork, fill_decode_work, max_decode_items
from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.prefill_tiles import fill_prefill_tiles, max_prefill_tiles


@dataclass(frozen=True)
class BatchLimits:
    """The largest step the buffers are sized for (the scheduler's limits)."""

    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class HostBlockTable:
    """Each live request's block ids in one row of a host array, appended to in place.

    A step then gathers its rows with one numpy ``take`` instead of rebuilding every
    request's list.
    """

    def __init__(self, num_rows: int, width: int) -> None:
        self.table = np.zeros((max(num_rows, 1), max(width, 1)), dtype=np.int32)
        self.num_blocks = np.zeros(self.table.shape[0], dtype=np.int64)
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A new row holding ``block_ids``."""
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(end, 2 * self.table.shape[1])), np.int32)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        self.num_blocks[row] = 0
        self._free.append(row)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class _Layout:
    """Element offsets of a step's sections for ``n`` tokens and ``s`` sequences.

    Every section starts 16-byte aligned: Triton specialises kernels on pointer alignment,
    so an odd offset would compile (and a graph would miss) a second variant.
    ``tile_tokens`` 0: no prefill tile section; ``work_target`` 0: no decode work list (a
    backend that reads neither).
    """

    n: int
    s: int
    tile_tokens: int
    work_target: int = 0

    @property
    def token_stride(self) -> int:  # int64 sections: ids, positions, slots, logits rows
        return _round_up(self.n, 2)

    @property
    def seq_lens(self) -> int:  # int32 sections: query starts at 0, then these
        return _round_up(self.s + 1, 4)

    @property
    def max_tiles(self) -> int:
        if not self.tile_tokens:
            return 0
        return max_prefill_tiles(self.n, self.s, self.tile_tokens)

    @property
    def tiles(self) -> int:
        return self.seq_lens + _round_up(self.s, 4)

    @property
    def max_items(self) -> int:
        return max_decode_items(self.s, self.work_target) if self.work_target else 0

    @property
    def items(self) -> int:  # decode work items (triples), then per-sequence (first, splits)
        return self.tiles + _round_up(2 * self.max_tiles, 4)

    @property
    def item_rows(self) -> int:
        return self.items + _round_up(3 * self.max_items, 4)

    @property
    def rows(self) -> int:
        return self.item_rows + (_round_up(2 * self.s, 4) if self.work_target else 0)

    def sizes(self, width: int) -> tuple[int, int]:
        """(int64, int32) buffer lengths holding any step within these bounds."""
        return 3 * self.token_stride + self.s, self.rows + self.s * width


@dataclass
class StepBatch:
    """Device inputs of one step; tensors are views of the persistent buffers."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Rows of the hidden states to compute logits for; None: row i of the first num_reqs.
    logits_indices: torch.Tensor | None
    num_reqs: int


class StepInputs:
    """Owns the staging and device buffers and fills them for one step at a time.

    Buffers grow on demand while ``frozen`` is False; once CUDA graphs hold their
    addresses (``freeze``) a step larger than the limits is an error.
    ``prefill_tile_tokens`` (the attention plan's work-list unit; 0: none) sizes
    the prefill tile list built with every step, ``decode_work_target`` (0: none) the
    decode work list of every step that is not decode-only.
    """

    def __init__(self, limits: BatchLimits, device: torch.device,
                 prefill_tile_tokens: int = 0, decode_work_target: int = 0) -> None:
        self.block_size = limits.block_size
        self.tile_tokens = prefill_tile_tokens
        self.work_target = decode_work_target
        self.seq_limit = limits.max_num_seqs
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.frozen = False
        self._copied: torch.cuda.Event | None = None
        self._allocate(limits.max_num_tokens, limits.max_num_seqs, limits.max_blocks_per_seq)

    # ---- buffers ------------------------------------------------------------------------

    def _allocate(self, num_tokens: int, num_seqs: int, width: int) -> None:
        self.max_tokens, self.max_seqs, self.width = num_tokens, num_seqs, width
        at = _Layout(num_tokens, num_seqs, self.tile_tokens, self.work_target)
        size64, size32 = at.sizes(width)
        self._host64 = torch.zeros(size64, dtype=torch.int64, pin_memory=self.is_cuda)
        self._host32 = torch.zeros(size32, dtype=torch.int32, pin_memory=self.is_cuda)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        if self.is_cuda:
            self._dev64 = torch.zeros(size64, dtype=torch.int64, device=self.device)
            self._dev32 = torch.zeros(size32, dtype=torch.int32, device=self.device)
        else:  # the host buffers are the device buffers: no copy at all
            self._dev64, self._dev32 = self._host64, self._host32
        self.block_tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=self.device)

    def reserve(self, num_tokens: int, num_seqs: int, width: int) -> None:
        """Grow the buffers (before ``freeze``) to hold a step of this size."""
        self._reserve(num_tokens, num_seqs, width)

    def _reserve(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and width <= self.width:
            return
        if self.frozen:
            raise RuntimeError(
                f"step of {num_tokens} tokens, {num_seqs} sequences, {width} blocks exceeds "
                f"the buffers ({self.max_tokens}, {self.max_seqs}, {self.width}) that CUDA "
                "graphs captured")
        self._wait_staging_free()
        self._allocate(max(num_tokens, self.max_tokens), max(num_seqs, self.max_seqs),
                       max(width, self.width))

    def freeze(self) -> None:
        """From now on buffers keep their addresses (CUDA graphs read them)."""
        self.frozen = True

    def _wait_staging_free(self) -> None:
        # The previous step's non-blocking copies may still read the pinned staging; a step
        # that sampled has already synchronised, so this wait is normally already over.
        if self._copied is not None:
            self._copied.synchronize()

    # ---- views --------------------------------------------------------------------------

    def graph_seqs(self, size: int) -> int:
        """Sequences a step padded to a graph of ``size`` tokens holds (a step has no more
        sequences than tokens, nor more than the scheduler's limit)."""
        return min(size, self.seq_limit)

    def graph_views(self, size: int, mixed: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) a graph of ``size`` tokens captures: a decode
        graph (``max_query_len`` 1: the model takes its fused decode path) or a mixed one
        (``max_query_len`` 2 stands for "any": the general path, every kernel launched over
        the most work the size allows). The host lists are those now staged (only
        reference paths read them)."""
        at = _Layout(size, self.graph_seqs(size), self.tile_tokens, self.work_target)
        seq_lens = self._np32[at.seq_lens:at.seq_lens + at.s].tolist()
        return self._views(at, self._np32[:at.s + 1].tolist(), seq_lens, 2 if mixed else 1,
                           max(seq_lens, default=0), at.max_tiles,
                           at.max_items if mixed else None)

    def _views(self, at: _Layout, query_start_loc: list[int], seq_lens: list[int],
               max_query_len: int, max_seq_len: int, num_tiles: int, num_items: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``num_items`` None: no decode work list (a decode-only step's kernels read none)."""
        n, s, stride = at.n, at.s, at.token_stride
        work = None
        if self.work_target and num_items is not None:
            work = DecodeWork(self._dev32[at.items:at.items + 3 * at.max_items], num_items,
                              self._dev32[at.item_rows:at.item_rows + 2 * s])
        metadata = AttentionMetadata(
            slot_mapping=self._dev64[2 * stride:2 * stride + n],
            query_start_loc=self._dev32[:s + 1],
            seq_lens=self._dev32[at.seq_lens:at.seq_lens + s],
            block_tables=self.block_tables[:s],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            prefill_tiles=(self._dev32[at.tiles:at.tiles + 2 * at.max_tiles]
                           if self.tile_tokens else None),
            num_prefill_tiles=num_tiles,
            prefill_tile_tokens=self.tile_tokens,
            decode_work=work,
        )
        return self._dev64[:n], self._dev64[stride:stride + n], metadata

    def fill_dummy(self, size: int) -> None:
        """Padding only (empty sequences, tokens of none): what a capture of ``size`` runs on."""
        seqs = self.graph_seqs(size)
        self._reserve(size, seqs, 1)
        self._wait_staging_free()
        at = _Layout(size, seqs, self.tile_tokens, self.work_target)
        np64, np32 = self._np64, self._np32
        stride = at.token_stride
        np64[:2 * stride] = 0
        np64[2 * stride:3 * stride] = -1
        np32[:at.tiles] = 0
        np32[at.tiles:at.item_rows] = -1  # no prefill tile, no decode item
        np32[at.item_rows:at.rows] = 0
        self._copy(3 * stride, at.rows)

    def _copy(self, n64: int, n32: int) -> None:
        if not self.is_cuda:
            return
        self._dev64[:n64].copy_(self._host64[:n64], non_blocking=True)
        self._dev32[:n32].copy_(self._host32[:n32], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()

    # ---- one step -----------------------------------------------------------------------

    def fill_pending_ids(self, input_ids: torch.Tensor, positions: list[int],
                         sources: list[int], samples: torch.Tensor) -> None:
        """Write ``samples[sources[i]]`` into ``input_ids[positions[i]]`` on the device.

        These are tokens the previous step sampled and the host has not read yet. Queued
        after the step's input copy, so the values land before the forward reads them.
        ``positions`` increase strictly (they are built in batch order). In the usual
        decode batch both lists are runs of consecutive indices: then it is one device copy.
        """
        count = len(positions)
        first, source = positions[0], sources[0]
        if (positions[-1] - first == count - 1
                and sources == list(range(source, source + count))):
            input_ids[first:first + count].copy_(samples[source:source + count])
            return
        index = torch.tensor([positions, sources], dtype=torch.int64,
                             pin_memory=self.is_cuda).to(input_ids.device, non_blocking=True)
        input_ids[index[0]] = samples[index[1]]

    def prepare(self, table: HostBlockTable, rows: np.ndarray, starts: np.ndarray,
                num_new: np.ndarray, token_ids: list[int], logits_rows: np.ndarray | None,
                pad_to: int | None = None) -> StepBatch:
        """Fill the buffers for one step and return views of them.

        Sequence i (block-table row ``rows[i]``) adds ``num_new[i]`` tokens after
        ``starts[i]`` computed ones; ``token_ids`` are those tokens, flattened.
        ``logits_rows`` are the sequences to sample (None: all, each with one token).
        ``pad_to`` pads the step to a graph of that many tokens (``graph_views``).
        """
        num_reqs = len(rows)
        num_tokens = len(token_ids)
        if num_reqs and int(num_new.min()) < 1:
            # Every kernel takes a scheduled row to add a token; the fused decode attention
            # takes row i's token to be token i whenever each row adds one.
            raise ValueError("every scheduled sequence must add at least one token")
        if pad_to is None:
            n, num_seqs = num_tokens, num_reqs
        else:
            n, num_seqs = pad_to, self.graph_seqs(pad_to)
            if n < num_tokens or num_seqs < num_reqs:
                raise ValueError(f"a step of {num_tokens} tokens in {num_reqs} sequences "
                                 f"does not fit a graph of size {pad_to}")
        width = int(table.num_blocks[rows].max())
        self._reserve(n, num_seqs, width)
        self._wait_staging_free()
        np64, np32 = self._np64, self._np32
        bs = self.block_size
        at = _Layout(n, num_seqs, self.tile_tokens, self.work_target)
        stride, bt_at = at.token_stride, at.rows

        # int32 pack: query starts, sequence lengths, prefill tiles, this step's block rows.
        qsl = np32[:num_seqs + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:] = num_tokens
        seq_lens = np32[at.seq_lens:at.seq_lens + num_seqs]
        np.add(starts, num_new, out=seq_lens[:num_reqs])
        seq_lens[num_reqs:] = 0
        # The work lists, for the general path only: a decode-only step's kernels read none.
        num_tiles = 0
        num_items: int | None = None
        general = num_tokens != num_reqs
        if self.tile_tokens and general:
            num_tiles = fill_prefill_tiles(qsl, self.tile_tokens,
                                           np32[at.tiles:at.tiles + 2 * at.max_tiles])
            if pad_to is not None:
                num_tiles = at.max_tiles  # the grid the graph was captured with
        if self.work_target and general:
            num_items = fill_decode_work(qsl, seq_lens, self.work_target,
                                         np32[at.items:at.items + 3 * at.max_items],
                                         np32[at.item_rows:at.item_rows + 2 * num_seqs])
            if pad_to is not None:
                num_items = at.max_items
        staged = np32[bt_at:bt_at + num_reqs * width].reshape(num_reqs, width)
        np.take(table.table[:, :width], rows, axis=0, out=staged, mode="clip")

        # int64 pack: token ids, positions, slots, logits rows.
        ids = np64[:n]
        positions = np64[stride:stride + n]
        slots = np64[2 * stride:2 * stride + n]
        ids[:num_tokens] = token_ids
        if num_tokens == num_reqs:  # one token each: no per-token expansion needed
            positions[:num_tokens] = starts
            token_rows = rows
        else:
            seq_of_token = np.repeat(np.arange(num_reqs), num_new)
            positions[:num_tokens] = (np.arange(num_tokens) - qsl[seq_of_token]
                                      + starts[seq_of_token])
            token_rows = rows[seq_of_token]
        pos = positions[:num_tokens]
        blocks = table.table[token_rows, pos // bs].astype(np.int64)
        np.add(blocks * bs, pos % bs, out=slots[:num_tokens])
        ids[num_tokens:] = 0
        positions[num_tokens:] = 0
        slots[num_tokens:] = -1
        num_logits = 0
        if logits_rows is not None:
            num_logits = len(logits_rows)
            np.subtract(qsl[logits_rows + 1], 1,
                        out=np64[3 * stride:3 * stride + num_logits])

        self._copy(3 * stride + num_logits, bt_at + num_reqs * width)
        device_rows = self._dev32[bt_at:bt_at + num_reqs * width].view(num_reqs, width)
        self.block_tables[:num_reqs, :width].copy_(device_rows)
        input_ids, positions_t, metadata = self._views(
            at, qsl.tolist(), seq_lens.tolist(), int(num_new.max()),
            int(seq_lens[:num_reqs].max()), num_tiles, num_items)
        logits_indices = (self._dev64[3 * stride:3 * stride + num_logits]
                          if logits_rows is not None else None)
        return StepBatch(input_ids, positions_t, metadata, logits_indices, num_reqs)
