"""Decode-step kernels timed as a CUDA graph replays them: GEMV (cuBLAS vs Triton) and
split-KV decode attention, over tile choices.

Why: inside a decode graph a kernel costs its GPU time plus no launch overhead, so timing
a Python loop of launches would measure the launcher. Each case here captures ``--reps``
calls into one graph and reports the replay time per call. The GEMV cases are the
projections of Qwen3-8B and Qwen3-0.6B (fused qkv, o, fused gate/up, down) at 1-16 rows;
the attention cases one sequence of 1k tokens with each model's heads.

    python3 -m benchmarks.decode_kernels --out /tmp/decode_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

# (model, projection, N, K): weight [N, K]
GEMV_SHAPES = [
    ("qwen3-8b", "qkv", 6144, 4096), ("qwen3-8b", "o", 4096, 4096),
    ("qwen3-8b", "gate_up", 24576, 4096), ("qwen3-8b", "down", 4096, 12288),
    ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o", 1024, 2048),
    ("qwen3-0.6b", "gate_up", 6144, 1024), ("qwen3-0.6b", "down", 1024, 3072),
]
GEMV_TILES = [(bn, bk, w, s) for bn, bk, w, s in itertools.product(
    (16, 32, 64), (128, 256, 512), (4,), (3, 4))] + [(16, 256, 2, 4), (32, 256, 8, 4)]
# (model, q heads, kv heads)
ATTN_SHAPES = [("qwen3-8b", 32, 8), ("qwen3-0.6b", 16, 8)]
ATTN_CONFIGS = [(splits, bn, stages, w) for splits, bn, stages, w in itertools.product(
    (None, 4, 8, 16), (32, 64), (1, 2, 3), (4,))] + [(None, 64, 1, 2), (8, 64, 1, 2)]


def graph_us(fn: Callable[[], object], reps: int, trials: int = 5) -> float:
    """Median over ``trials`` of one replay of ``reps`` captured calls, per call, in us."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gemv_cases(rows_list: list[int], reps: int) -> list[dict[str, Any]]:
    from engine_core.kernels.gemv import GEMV_TILES, gemv

    out = []
    for (model, name, n, k), rows in itertools.product(GEMV_SHAPES, rows_list):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        case: dict[str, Any] = {"model": model, "proj": name, "n": n, "k": k, "rows": rows,
                                "weight_bytes": n * k * 2}
        case["cublas_us"] = graph_us(lambda x=x, w=w: F.linear(x, w), reps)
        case["triton_default_tiles"] = list(GEMV_TILES)
        case["triton_default_us"] = graph_us(lambda x=x, w=w: gemv(x, w), reps)
        if rows == 1:
            sweep = {}
            for tiles in GEMV_TILES:
                try:
                    sweep[str(tiles)] = graph_us(lambda x=x, w=w, t=tiles: gemv(x, w, tiles=t),
                                                 reps)
                except triton.runtime.errors.OutOfResources:  # too much shared memory
                    continue
            best = min(sweep, key=sweep.get)
            case["triton_sweep_us"] = sweep
            case["triton_best"] = {"tiles": best, "us": sweep[best]}
        case["cublas_tb_per_s"] = case["weight_bytes"] / case["cublas_us"] / 1e6
        case["triton_default_tb_per_s"] = case["weight_bytes"] / case["triton_default_us"] / 1e6
        out.append(case)
        print(f"gemv {model:10} {name:8} m{rows:<2} cublas {case['cublas_us']:7.2f} us "
              f"triton {case['triton_default_us']:7.2f} us"
              + (f" best {case['triton_best']['us']:7.2f} us {case['triton_best']['tiles']}"
                 if "triton_best" in case else ""), flush=True)
        del w, x
    return out


def attention_cases(context: int, reps: int) -> list[dict[str, Any]]:
    return [attention_case(model, hq, hkv, context, reps) for model, hq, hkv in ATTN_SHAPES]


def attention_case(model: str, hq: int, hkv: int, context: int, reps: int) -> dict[str, Any]:
    from engine_core.kernels.paged_decode import choose_num_splits, paged_decode_attention

    block_size, width = 16, 10240 // 16  # the benchmark engine's block-table width
    num_blocks = width + 8
    cache = torch.randn(2, num_blocks, block_size, hkv, 128, dtype=torch.bfloat16,
                        device="cuda")
    q = torch.randn(1, hq, 128, dtype=torch.bfloat16, device="cuda")
    out_t = torch.empty_like(q)
    tables = torch.zeros(1, width, dtype=torch.int32, device="cuda")
    tables[0] = torch.randperm(num_blocks, device="cuda")[:width].to(torch.int32)
    seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    default_splits = choose_num_splits(1, hkv, width, block_size, q.device)
    results = {}
    for splits, block_n, stages, warps in ATTN_CONFIGS:
        def run(s=splits, bn=block_n, st=stages, w=warps):
            paged_decode_attention(q, cache[0], cache[1], out_t, tables, seq_lens, qsl,
                                   0.088, num_splits=s, block_n=bn, num_warps=w,
                                   num_stages=st)
        results[str((splits or default_splits, block_n, stages, warps))] = graph_us(run, reps)
    best = min(results, key=results.get)
    print(f"attn {model:10} ctx{context}: " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(results.items(), key=lambda kv: kv[1])[:6]),
        flush=True)
    return {"model": model, "q_heads": hq, "kv_heads": hkv, "context": context,
            "default_splits": default_splits, "us": results,
            "best": {"config": best, "us": results[best]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="attention,gemv")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "attention" in parts:
        results["attention"] = attention_cases(args.context, args.reps)
    if "gemv" in parts:
        results["gemv"] = gemv_cases(rows, args.reps)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
