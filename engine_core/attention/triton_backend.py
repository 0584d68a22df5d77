"""Paged attention with the Triton kernels in engine_core/kernels (CUDA).

A decode-only step (every row one token) calls ``forward_decode``: one kernel norms and
rotates q and the new k (``NewTokenRope``), stores the new K/V and attends, so the
model's q/k norm + RoPE kernel and the KV write are not launched; it reads only device
tensors, so a CUDA graph of a decode batch replays it as is. Any other step calls
``forward``, after the model's own norm + RoPE kernel: one kernel writes the new K/V at
their slots, then the prefill kernel runs over the query tiles of the sequences with more
than one new token (a tile list ``StepInputs`` builds with the step's other inputs) and the
decode kernel over the sequences with exactly one, skipping the others on the device.
Both read only device tensors and take their grids from shapes and the tile list's
length, so a mixed step replays from a CUDA graph like a decode step (a pure prefill step
pays one decode launch whose programs exit at once). We split
rather than send everything through the prefill kernel because in a chunked-prefill batch
the decodes are the majority, and they need split-KV (one prefill program per sequence
would walk a long context alone) and the GQA-packed decode tile.

The backend also tells the model to use the fused RMSNorm, RoPE and SiLU kernels
(``triton_layers``) and the small-batch GEMV (``gemv_max_rows``): one switch,
``--attention-backend``, picks the whole fast path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine_core.attention.backend import AttentionBackend, AttentionPlan, AttentionShapes
from engine_core.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine_core.kernels.paged_decode import NewTokenRope

# Decode batches up to this size run their projections on the Triton GEMV (kernels/gemv.py):
# measured faster than cuBLAS there on an H200.
DEFAULT_GEMV_MAX_ROWS = 8


class TritonAttentionBackend(AttentionBackend):
    """Triton KV write, prefill and split-KV decode kernels; any cache dtype, fp8 included."""

    name = "triton"
    triton_layers = True

    def __init__(self, num_decode_splits: int | None = None,
                 gemv_max_rows: int | None = None, split_k_mlp: bool = False,
                 pdl: bool = True) -> None:
        # None: choose_num_splits decides from shapes; tests force a count to cover merges.
        self.num_decode_splits = num_decode_splits
        self.gemv_max_rows = DEFAULT_GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
        self.split_k_mlp = split_k_mlp
        self.pdl = pdl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from engine_core.attention.decode_work import decode_work
        from engine_core.attention.prefill_tiles import prefill_tiles
        from engine_core.kernels.kv_write import write_kv
        from engine_core.kernels.paged_decode import decode_work_target, paged_decode_attention
        from engine_core.kernels.paged_prefill import paged_prefill_attention, query_tile_tokens

        meta = attn_metadata
        out = torch.empty_like(q)
        tile_tokens = query_tile_tokens(q.shape[1], k.shape[1], q.shape[2], q.dtype)
        if kv_cache is None:  # the profile run: k and v must share strides here
            v = v if v.stride() == k.stride() else v.contiguous()
            tiles, count = prefill_tiles(meta.query_start_loc_cpu, tile_tokens, q.device,
                                         include_single=True)
            paged_prefill_attention(q, k, v, out, None, None, meta.query_start_loc, tiles,
                                    count, tile_tokens, meta.block_size, scale)
            return out
        write_kv(k, v, kv_cache, meta.slot_mapping, pdl=self.pdl)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.prefill_tiles is None:
            tiles, count = prefill_tiles(meta.query_start_loc_cpu, tile_tokens, q.device)
        else:
            tiles, count = meta.prefill_tiles, meta.num_prefill_tiles
            assert meta.prefill_tile_tokens == tile_tokens
        paged_prefill_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, tiles, count, tile_tokens,
                                meta.block_size, scale)
        work = meta.decode_work
        if work is None and self.num_decode_splits is None:
            work = decode_work(meta.query_start_loc_cpu, meta.seq_lens_cpu,
                               decode_work_target(k.shape[1], q.device), q.device)
        paged_decode_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale, self.num_decode_splits, work=work,
                               pdl=self.pdl)
        return out

    def plan(self, shapes: AttentionShapes) -> AttentionPlan:
        from engine_core.kernels.paged_decode import decode_work_target
        from engine_core.kernels.paged_prefill import query_tile_tokens

        tile = query_tile_tokens(shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim,
                                 shapes.dtype)
        return AttentionPlan(prefill_tile_tokens=tile,
                             decode_work_target=decode_work_target(shapes.num_kv_heads,
                                                                   shapes.device),
                             triton_sampling=True, triton_pdl=self.pdl)

    def forward_decode(self, q: torch.Tensor, rope: NewTokenRope, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode-only step (``max_query_len == 1``) from the raw projections: ``q``
        ``[T, Hq, D]`` and ``rope``'s k/v not yet normed, rotated or written."""
        from engine_core.kernels.paged_decode import paged_decode_attention

        meta = attn_metadata
        assert meta.max_query_len == 1
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_decode_attention(q, kv_cache[0], kv_cache[1], out, meta.block_tables,
                               meta.seq_lens, meta.query_start_loc, scale,
                               self.num_decode_splits, rope=rope, pdl=self.pdl)
        return out
