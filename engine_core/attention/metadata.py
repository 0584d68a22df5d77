"""Per-step attention metadata, built once by the runner and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine_core.attention.decode_work import DecodeWork


class LayerHooks(Protocol):
    """Connector hooks around each attention layer (wait for a remote load, save a layer)."""

    def before_layer(self, layer_idx: int) -> None: ...

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None: ...


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of prefill chunks and decode tokens.

    Sequences are ordered as in the batch; sequence i owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` whose absolute positions end at
    ``seq_lens[i] - 1``. K/V of every new token is written at ``slot_mapping``
    (``block_id * block_size + offset``) before attention reads the cache. A batch padded
    to a CUDA graph's size ends with empty sequences (no tokens, ``seq_len`` 0) and tokens
    of no sequence (slot -1): nothing reads or writes for them, and their output rows are
    left as they were.
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32: cached + new tokens after this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: list[int]  # host copies, so reference paths need no device sync
    seq_lens_cpu: list[int]
    layer_hooks: LayerHooks | None = None
    # The Triton prefill kernel's work list (kernels/paged_prefill.py): int32 pairs
    # (sequence, first token) of ``prefill_tile_tokens`` tokens each, ``num_prefill_tiles``
    # programs (in a graph the most its size can need, the unused pairs -1). None: the
    # backend builds it from the host lists (metadata built outside StepInputs).
    prefill_tiles: torch.Tensor | None = None
    num_prefill_tiles: int = 0
    prefill_tile_tokens: int = 0
    # The decode kernel's work list for a general (not decode-only) step
    # (attention/decode_work.py); None: the backend builds it from the host lists.
    decode_work: DecodeWork | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
