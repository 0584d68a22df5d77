"""Timing helpers, the device limits a run measures (copy bandwidth, matmul rate) and the
model arithmetic the figures are ratios of (bytes read, FLOPs)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_core.models.spec import ModelSpec


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int,
            warmup: int = 3) -> list[float]:
    """Per-call times in ms (CUDA events on GPU, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "min": ordered[0], "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "n": len(ordered)}


def measure_limits(device: torch.device, copy_bytes: int, matmul_n: int,
                   iters: int) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes per second) and the bf16 matmul rate."""
    copy_times = _copy_times(device, copy_bytes, iters)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm_times = _matmul_times(device, matmul_n, dtype, iters)
    free_memory()
    copy_ms, mm_ms = statistics.median(copy_times), statistics.median(mm_times)
    return {
        "copy_bytes_each_way": copy_bytes,
        "copy_ms": stats_ms(copy_times),
        "copy_bandwidth_bytes_per_s": 2 * copy_bytes / (copy_ms / 1e3),
        "copy_bandwidth_best_bytes_per_s": 2 * copy_bytes / (min(copy_times) / 1e3),
        "matmul_n": matmul_n,
        "matmul_dtype": str(dtype),
        "matmul_ms": stats_ms(mm_times),
        "matmul_flops_per_s": 2 * matmul_n ** 3 / (mm_ms / 1e3),
        "matmul_best_flops_per_s": 2 * matmul_n ** 3 / (min(mm_times) / 1e3),
    }


def _copy_times(device: torch.device, nbytes: int, iters: int) -> list[float]:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device, iters)


def _matmul_times(device: torch.device, n: int, dtype: torch.dtype, iters: int) -> list[float]:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return time_ms(lambda: torch.matmul(a, b), device, iters)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_bytes_read(model: torch.nn.Module, spec: ModelSpec) -> int:
    """Parameter bytes a decode step reads: all of them, except an untied input embedding
    (only the batch's rows are gathered)."""
    total = 0
    for name, param in model.named_parameters():  # a tied lm_head appears once
        if name.endswith("embed_tokens.weight") and not spec.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(spec: ModelSpec, element_size: int) -> int:
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * element_size


def decoder_matmul_params(spec: ModelSpec) -> int:
    """Weights of the per-token matmuls of the decoder layers (q, k, v, o, gate, up, down)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return spec.num_hidden_layers * per_layer


def prefill_flops(spec: ModelSpec, num_tokens: int) -> dict[str, float]:
    """FLOPs of one prefill of ``num_tokens`` (logits of the last token only)."""
    matmul = 2.0 * num_tokens * decoder_matmul_params(spec) + 2.0 * spec.hidden_size * spec.vocab_size
    # Causal: query i sees i + 1 keys; QK^T and PV are 2 * head_dim FLOPs per (query, key, head).
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 2 * 2.0 * spec.num_attention_heads * spec.head_dim * pairs * spec.num_hidden_layers
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}
