"""Neox-style (half-split) RoPE of q and k in one launch, one program per token, with
Qwen3's per-head q/k RMSNorm fused in front when norm weights are given.

torch needs about six kernels per tensor (two multiplies, the half swap, the negation, the
add) and runs them for q and for k in every layer. The kernel takes the step's cos/sin
from ``RotaryEmbedding.cos_sin`` unchanged, so every frequency schedule (default, linear,
llama3, dynamic) keeps its exact semantics, and rounds where torch rounds:
``out1 = round(round(x1*cos) + round(-x2*sin))``, ``out2 = round(round(x2*cos) +
round(x1*sin))`` in the model dtype, with FMA contraction off so float32 matches too.
The norm, when fused, rounds as ``RMSNorm`` does (``round(weight * round(x * rsqrt(mean(x^2)
+ eps)))``): three launches per layer (q norm, k norm, RoPE) become one. q and k may be
strided views (the column slices of the fused qkv projection's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.kernels import next_power_of_2
from engine_core.kernels.pdl import pdl_args, wait_for_predecessor


@triton.jit
def _rotate_heads(x_ptr, out_ptr, w_ptr, eps, token, stride_xt, stride_xh, stride_ot,
                  stride_oh, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        inv = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_st,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    # cos/sin rows are cat(freqs, freqs): the first half serves both halves.
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_st + dims, mask=dims < HALF, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, q_w_ptr, eps, token, stride_qt, stride_qh, stride_qot,
                  stride_qoh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, HAS_NORM)
    _rotate_heads(k_ptr, k_out_ptr, k_w_ptr, eps, token, stride_kt, stride_kh, stride_kot,
                  stride_koh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, HAS_NORM)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_norm_weight: torch.Tensor | None = None,
               k_norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by cos/sin ``[T, 1, D]`` (new contiguous
    tensors), after a per-head RMSNorm with ``[D]`` weights when both are given; ``pdl`` as
    ``pdl.pdl_args``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.dtype == q.dtype == k.dtype, "cos/sin come in the model dtype, as in HF"
    has_norm = q_norm_weight is not None and k_norm_weight is not None
    if has_norm:
        assert q_norm_weight.dtype == q.dtype and k_norm_weight.dtype == k.dtype
    q_w = q_norm_weight if has_norm else cos  # placeholders when there is no norm
    k_w = k_norm_weight if has_norm else cos
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, q_w, k_w, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(num_k_heads),
        BLOCK_HALF=next_power_of_2(half), HAS_NORM=has_norm,
        num_warps=4 if num_q_heads * head_dim >= 2048 else 1, enable_fp_fusion=False,
        **pdl_args(q.device, pdl))
    return q_out, k_out


@triton.jit(do_not_specialize=["num_tokens"])  # follows the batch: one variant for all
def _cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, num_tokens,
                    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_HALF)
    token_ok = tokens < num_tokens
    dim_ok = dims < HALF
    pos = tl.load(pos_ptr + tokens, mask=token_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dim_ok, other=0.0)
    freqs = pos[:, None] * inv_freq[None, :]
    dtype = cos_ptr.dtype.element_ty
    # Triton lowers these to libdevice's cosf/sinf (no approximation): what torch's CUDA
    # cos/sin compute, so the values are the same.
    cos = tl.cos(freqs).to(dtype)
    sin = tl.sin(freqs).to(dtype)
    mask = token_ok[:, None] & dim_ok[None, :]
    at = tokens.to(tl.int64)[:, None] * (2 * HALF) + dims[None, :]
    tl.store(cos_ptr + at, cos, mask=mask)
    tl.store(cos_ptr + at + HALF, cos, mask=mask)
    tl.store(sin_ptr + at, sin, mask=mask)
    tl.store(sin_ptr + at + HALF, sin, mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, 1, 2 * F]`` in ``dtype`` of ``positions[t] * inv_freq`` (``[F]``
    float32) repeated over both halves: ``RotaryEmbedding.cos_sin`` in one launch.

    Why: in torch it is six kernels a step (multiply, cat, cos, sin, two casts), ~8 us of
    a decode step's GPU time on an H100 at ~1.4 us a launch in the graph.
    """
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, 1, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens == 0:
        return cos, sin
    block_t = 16
    _cos_sin_kernel[(triton.cdiv(num_tokens, block_t),)](
        positions, inv_freq, cos, sin, num_tokens, HALF=half, BLOCK_T=block_t,
        BLOCK_HALF=next_power_of_2(half), num_warps=4, **pdl_args(positions.device, pdl))
    return cos, sin
