"""Writing this step's K/V into the paged cache at their slots, one program per token.

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. The cast
to the cache dtype (fp8 e4m3/e5m2 included, unscaled) happens in registers on the way in,
so an fp8 cache costs no extra pass. Slot ``-1`` skips the token: CUDA-graph batches pad
with such rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, pdl: bool = True) -> None:
    """Store k/v ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (``-1`` = skip) in ``kv_cache``;
    ``pdl`` as ``pdl.pdl_args``."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert slot_mapping.shape[0] >= num_tokens
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_h, block_d = next_power_of_2(num_heads), next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[2], num_warps=4 if block_h * block_d >= 2048 else 2,
        **pdl_args(k.device, pdl))
