"""Reference paged attention in plain torch: runs anywhere, defines correct behaviour.

One Python iteration per sequence (never per token): gather that sequence's cached K/V
through its block table, then causal SDPA with the query block offset to its positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core.attention.backend import AttentionBackend
from engine_core.attention.metadata import AttentionMetadata


def write_to_paged_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Store k/v ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]``, casting to the cache dtype.

    Slot -1 skips the token (pad rows of a padded decode batch), as in the Triton kernel.
    """
    _, num_blocks, block_size, num_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_heads, head_dim)
    slots = slot_mapping[:k.shape[0]].to(device=kv_cache.device, dtype=torch.long)
    if bool((slots < 0).any()):
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    if kv_cache.dtype.itemsize == 1 and kv_cache.dtype.is_floating_point:
        # fp8: index_copy_ has no fp8 kernels on every device; copy the bytes instead.
        flat_bytes = flat.view(torch.uint8)
        flat_bytes[0].index_copy_(0, slots, k.to(kv_cache.dtype).view(torch.uint8))
        flat_bytes[1].index_copy_(0, slots, v.to(kv_cache.dtype).view(torch.uint8))
        return
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[seq_len, Hkv, D]`` of one sequence, read through its block table."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    kv = kv_cache[:, blocks]  # [2, n, block_size, Hkv, D]
    kv = kv.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])[:, :seq_len]
    kv = kv.to(dtype)
    return kv[0], kv[1]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q ``[Lq, Hq, D]`` at the last Lq positions of k/v ``[Lk, Hkv, D]`` -> ``[Lq, Hq, D]``."""
    q_len, num_q_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    groups = num_q_heads // num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        # Query j sits at absolute position (k_len - q_len + j) and sees keys up to it.
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
        k_pos = torch.arange(k_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class TorchRefAttentionBackend(AttentionBackend):
    """Write K/V into the paged cache with one scatter, then attend sequence by sequence."""

    name = "torch_ref"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = attn_metadata.query_start_loc_cpu
        if kv_cache is None:
            for i in range(attn_metadata.num_seqs):
                lo, hi = starts[i], starts[i + 1]
                out[lo:hi] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], scale)
            return out
        write_to_paged_cache(k, v, kv_cache, attn_metadata.slot_mapping)
        for i, seq_len in enumerate(attn_metadata.seq_lens_cpu):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            if seq_len == 0:  # a pad row: nothing to attend to, zeros as the Triton kernel
                out[lo:hi] = 0
                continue
            seq_k, seq_v = gather_sequence_kv(kv_cache, attn_metadata.block_tables[i],
                                              seq_len, q.dtype)
            out[lo:hi] = causal_attention(q[lo:hi], seq_k, seq_v, scale)
        return out
