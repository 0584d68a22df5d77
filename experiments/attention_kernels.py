"""Triton attention / norm / RoPE kernels against the torch reference path, GPU-timed.

Geometry of Qwen3-8B / Llama-3-8B attention (32 q heads, 8 KV heads, head dim 128,
bfloat16, block size 16). Cases: decode batches over long contexts (split-KV), a chunked
prefill after a cached prefix, a full prefill, and RMSNorm(+residual) / RoPE of a decode
batch. Each figure is the median of ``--iters`` CUDA-event timings after warm-up; the
reference is what the engine runs with ``--attention-backend torch_ref``. Prints JSON.

    python3 experiments/attention_kernels.py --out /tmp/attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from functools import partial

import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.torch_ref import TorchRefAttentionBackend
from engine_core.attention.triton_backend import TritonAttentionBackend

HQ, HKV, D, BS = 32, 8, 128, 16


def time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def batch(cached: list[int], new: list[int], dtype: torch.dtype):
    """Inputs and metadata of one step over a cache with room for every sequence."""
    seq_lens = [c + n for c, n in zip(cached, new)]
    counts = [-(-s // BS) for s in seq_lens]
    tables = torch.zeros(len(new), max(counts), dtype=torch.int32)
    perm = torch.randperm(sum(counts), dtype=torch.int32)
    slots, at = [], 0
    for i, (c, n, count) in enumerate(zip(cached, new, counts)):
        tables[i, :count] = perm[at:at + count]
        at += count
        pos = torch.arange(c, c + n)
        slots.append(tables[i, pos // BS].long() * BS + pos % BS)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).cuda(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), max_query_len=max(new), max_seq_len=max(seq_lens),
        block_size=BS, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    total = starts[-1]
    q = torch.randn(total, HQ, D, dtype=dtype, device="cuda")
    k = torch.randn(total, HKV, D, dtype=dtype, device="cuda")
    v = torch.randn(total, HKV, D, dtype=dtype, device="cuda")
    kv_cache = torch.randn(2, sum(counts), BS, HKV, D, dtype=dtype, device="cuda")
    return q, k, v, kv_cache, meta


def attention_cases(iters: int) -> list[dict]:
    triton_backend, ref = TritonAttentionBackend(), TorchRefAttentionBackend()
    cases = {
        "decode bs=1 ctx=32k": ([32768], [1]),
        "decode bs=32 ctx=4k": ([4096] * 32, [1] * 32),
        "decode bs=128 ctx=2k": ([2048] * 128, [1] * 128),
        "chunk 2048 after 6k prefix": ([6144], [2048]),
        "prefill 4x2048": ([0] * 4, [2048] * 4),
        "mixed 1 chunk 1024 + 63 decodes ctx=2k": ([0] + [2048] * 63, [1024] + [1] * 63),
    }
    results = []
    for name, (cached, new) in cases.items():
        q, k, v, kv_cache, meta = batch(cached, new, torch.bfloat16)
        scale = D ** -0.5
        row = {"case": name}
        for label, backend in (("triton_ms", triton_backend), ("torch_ref_ms", ref)):
            step = partial(backend.forward, q, k, v, kv_cache, meta, scale)
            row[label] = round(time_ms(step, iters), 4)
        row["speedup"] = round(row["torch_ref_ms"] / row["triton_ms"], 2)
        results.append(row)
    return results


def layer_cases(iters: int) -> list[dict]:
    from engine_core.kernels.rotary import apply_rope
    from engine_core.layers.norm import RMSNorm
    from engine_core.layers.rotary import RotaryEmbedding

    results = []
    for tokens in (64, 4096):
        x = torch.randn(tokens, 4096, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn_like(x)
        fast = RMSNorm(4096, 1e-6, use_triton=True).to("cuda", torch.bfloat16)
        slow = RMSNorm(4096, 1e-6).to("cuda", torch.bfloat16)
        rope = RotaryEmbedding(D, 500000.0).cuda()
        cos, sin = rope.cos_sin(torch.arange(tokens, device="cuda"), torch.bfloat16)
        q = torch.randn(tokens, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(tokens, HKV, D, dtype=torch.bfloat16, device="cuda")
        for name, fast_fn, slow_fn in (
            ("add+rmsnorm", partial(fast.add_and_norm, x, residual),
             partial(slow.add_and_norm, x, residual)),
            ("rope q+k", partial(apply_rope, q, k, cos, sin),
             lambda q=q, k=k, cos=cos, sin=sin: (RotaryEmbedding.apply(q, cos, sin),
                                                 RotaryEmbedding.apply(k, cos, sin))),
        ):
            row = {"case": f"{name} T={tokens}", "triton_ms": round(time_ms(fast_fn, iters), 4),
                   "torch_ref_ms": round(time_ms(slow_fn, iters), 4)}
            row["speedup"] = round(row["torch_ref_ms"] / row["triton_ms"], 2)
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "geometry": dict(hq=HQ, hkv=HKV, d=D,
                                                                        block_size=BS),
              "attention": attention_cases(args.iters), "layers": layer_cases(args.iters)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
